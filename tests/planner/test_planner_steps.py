"""Issue 53, item 3: a step is what runs between backwards, not one forward. Two forwards before
one backward (chosen and rejected sequences in preference training, a siamese model's two
towers) plan as one step: the trace holds both forwards' saves, the plan settles, and every
step's gradients are those of training without STORM, bit for bit."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import storm
from planner_fakes import FakeClock, gpt, grads_of

STEPS = 30  # more than a budget=0.5 plan of the CPU GPT takes to settle on a clock standing still


def two_forward_step(model, a: torch.Tensor, b: torch.Tensor, step: int, handle=None) -> list[torch.Tensor]:
    """One step of two forwards (``a`` and ``b``) and one backward of their losses' sum; the
    gradients. With ``handle``, the step is marked by its begin() and end()."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(step)  # the same dropout masks with and without STORM
    if handle is not None:
        handle.begin()
    loss = model.loss(a[:, :-1], a[:, 1:]) + 0.5 * model.loss(b[:, :-1], b[:, 1:])
    if handle is not None:
        handle.end()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def saved_bytes_of_a_step(model, a: torch.Tensor, b: torch.Tensor, losses: bool) -> int:
    """What a step of the model's two forwards saves that storm.offload would take (min_bytes=0:
    everything it offloads); with ``losses``, the losses too, as a step marked by begin() and end()
    around the forwards and the losses has them."""
    ctx = storm.offload(mode="embedded", min_bytes=0)
    with ctx:
        logits = model(a[:, :-1])
    with ctx.resume() if losses else contextlib.nullcontext():
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), a[:, 1:].reshape(-1))
    with ctx.resume():
        logits = model(b[:, :-1])
    with ctx.resume() if losses else contextlib.nullcontext():
        loss = loss + 0.5 * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    loss.backward()
    return ctx.stats.offloaded_bytes


@pytest.mark.parametrize("marked", [False, True], ids=["on-forward", "begin-end"])
def test_two_forwards_before_one_backward_plan_as_one_step_that_settles_bit_exact(marked, caplog):
    model, idx = gpt()
    a, b = idx, idx.flip(0)
    reference = copy.deepcopy(model)
    whole_step = saved_bytes_of_a_step(copy.deepcopy(model), a, b, losses=marked)
    handle = storm.enable(model, budget=0.5, on_forward=not marked, mode="embedded", min_bytes=0, clock=FakeClock())
    planner = handle.planner
    caplog.set_level(logging.INFO, logger="storm")
    try:
        for step in range(STEPS):
            want = two_forward_step(reference, a, b, step)
            got = two_forward_step(model, a, b, step, handle if marked else None)
            for g, w in zip(got, want):
                assert torch.equal(g, w), f"step {step}: gradients differ from training without STORM"
            if planner.settled:
                break
        assert planner.settled, f"not settled after {STEPS} steps:\n{handle.explain()}"
        assert planner.trace.forwards == 2
        # the plan is of the whole step: both forwards' saves, not one forward's
        assert planner.trace.total_bytes == whole_step
        assert planner.replans == 0
        assert "2 forwards" in handle.explain()
        # settled, it stays so, bit-exact
        for step in range(STEPS, STEPS + 3):
            want = two_forward_step(reference, a, b, step)
            got = two_forward_step(model, a, b, step, handle if marked else None)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert planner.settled and planner.replans == 0
    finally:
        handle.disable()
    joined = [r for r in caplog.records if "before the backward" in r.getMessage()]
    assert len(joined) == (0 if marked else 1), [r.getMessage() for r in joined]  # said once, where it was seen


def test_a_step_of_fewer_forwards_than_traced_unsettles_the_plan_as_it_is_read():
    """A settled plan of two-forward steps, then a step of one forward: ``settled`` and ``phase``,
    read before the next step begins, already say that step traces again (step() finds the same)."""
    from storm.planner import Phase

    model, idx = gpt()
    a, b = idx, idx.flip(0)
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    planner = handle.planner
    try:
        for step in range(STEPS):
            two_forward_step(model, a, b, step)
            if planner.settled:
                break
        assert planner.settled and planner.trace.forwards == 2
        model.zero_grad(set_to_none=True)
        model.loss(a[:, :-1], a[:, 1:]).backward()  # one forward
        assert not planner.settled
        assert planner.phase is Phase.TRACE_OFFLOAD
        two_forward_step(model, a, b, STEPS)
        assert planner.replans == 1
    finally:
        handle.disable()


def test_reading_settled_between_a_steps_forward_and_its_backward_leaves_the_step_to_be_read_whole():
    """storm.enable begins a step at the model's forward: a loop that reads ``settled`` right after
    the loss (to log it) must not have the step read before its backward ran, or a trial's steps are
    never timed and the plan never settles."""
    model, idx = gpt()
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    planner = handle.planner
    try:
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            loss = model.loss(idx[:, :-1], idx[:, 1:])
            mid = planner.settled
            loss.backward()
            if planner.settled:
                break
        assert planner.settled, handle.explain()
        assert not mid  # read before the settling step's backward, it told that step's phase
    finally:
        handle.disable()


def test_a_step_whose_forward_raised_past_the_blocks_is_traced_again():
    """The head raises (an out-of-memory a loop catches to skip the batch) after every block ran:
    that step saved less than a step does, so it is no offload trace; the next step traces again,
    a whole step's saves as another planner traces them."""
    def planner_of(model) -> storm.Planner:
        return storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())

    other, idx = gpt()
    model, _ = gpt()
    whole, planner = planner_of(other), planner_of(model)
    try:
        grads_of(other, idx, whole.step())
        whole.settled
        head = model.head.forward

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("out of memory (in the head)")

        model.head.forward = out_of_memory
        with pytest.raises(torch.OutOfMemoryError), planner.step():
            model.loss(idx[:, :-1], idx[:, 1:])
        model.head.forward = head
        grads_of(model, idx, planner.step())
        planner.settled
        assert (planner.trace.total_bytes, planner.trace.after_bytes) == (whole.trace.total_bytes,
                                                                           whole.trace.after_bytes)
    finally:
        planner.close()
        whole.close()


def test_a_backward_between_forwards_makes_them_steps_of_their_own():
    """Gradient accumulation (forward, backward, forward, backward): each forward is a step."""
    model, idx = gpt()
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    try:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            for half in (idx[:4], idx[4:]):
                model.loss(half[:, :-1], half[:, 1:]).backward()
        assert handle.planner.trace is not None and handle.planner.trace.forwards == 1
    finally:
        handle.disable()


def test_resume_enters_the_same_step_again():
    """storm.offload's resume(): a second forward's saves join the step; refused before entry and
    while active."""
    model, idx = gpt()
    reference = copy.deepcopy(model)
    ctx = storm.offload(mode="embedded", min_bytes=0)
    with pytest.raises(RuntimeError, match="enter the context first"):
        ctx.resume()
    torch.manual_seed(3)
    with ctx:
        l1 = model.loss(idx[:, :-1], idx[:, 1:])
        with pytest.raises(RuntimeError, match="is active"):
            ctx.resume()
    first = ctx.stats.saved
    with ctx.resume():
        l2 = model.loss(idx[:, :-1], idx[:, 1:])
    assert ctx.stats.saved == 2 * first  # one step's counters, both forwards
    (l1 + l2).backward()
    torch.manual_seed(3)
    (reference.loss(idx[:, :-1], idx[:, 1:]) + reference.loss(idx[:, :-1], idx[:, 1:])).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("want", [{"budget": 0.25}, {"peak": 0.5}])
def test_a_two_forward_step_on_cuda_settles_bit_exact_within_its_measured_target(want):
    """On CUDA, where the planner measures each planned step's peak against its target: a step of
    two forwards (the second on other tokens) settles to a plan of the whole step, every step's
    gradients are those without STORM, and a settled step peaks within the target. budget 0.25
    needs offloading on this model (below what recomputing every block keeps)."""
    from storm.examples.models import GPT

    torch.manual_seed(0)
    model = GPT(seq_len=256, d_model=256, n_heads=4, n_layers=8).cuda()
    idx = torch.randint(0, 256, (8, 257), device="cuda")
    a, b = idx, idx.flip(0)
    reference = copy.deepcopy(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    two_forward_step(reference, a, b, 0)
    no_offload_peak = torch.cuda.max_memory_allocated() - base
    if "peak" in want:
        want = {"peak": int(want["peak"] * no_offload_peak)}
    handle = storm.enable(model, **want, mode="embedded", min_bytes=1 << 16, pool_size="1GiB")
    planner, peaks = handle.planner, []
    try:
        for step in range(60):
            expected = two_forward_step(reference, a, b, step)
            settled = planner.settled
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            got = two_forward_step(model, a, b, step)
            if settled:
                peaks.append(torch.cuda.max_memory_allocated() - base)
            assert all(torch.equal(g, w) for g, w in zip(got, expected)), f"step {step}"
        assert planner.settled and planner.trace.forwards == 2, handle.explain()
        assert planner.plan.fits and (planner.plan.offloaded or planner.plan.recomputed)
        assert len(peaks) >= 2, handle.explain()
        assert max(peaks) <= 1.02 * planner.target, (peaks, planner.target, handle.explain())
        assert max(peaks) < no_offload_peak
    finally:
        handle.disable()


@pytest.mark.gpu
def test_a_peak_no_plan_of_the_blocks_reaches_gets_full_offload_measured_and_the_least_measured_kept_on_cuda():
    """On CUDA, a peak= below what any plan of the blocks reaches: the planner measures full
    offload (over every block recomputed, then alone, and where it framed the saves by its own
    choice, alone raw last) once its room has settled, keeps the plan of least measured peak, and
    its settled steps peak as that measure said; every step's gradients are those without STORM."""
    from storm.examples.models import GPT

    torch.manual_seed(0)
    model = GPT(seq_len=256, d_model=256, n_heads=4, n_layers=8, dropout=0.0).cuda()
    idx = torch.randint(0, 256, (8, 257), device="cuda")
    reference = copy.deepcopy(model)
    handle = storm.enable(model, peak=1 << 20, mode="embedded", min_bytes=1 << 16, pool_size="1GiB")
    planner, peaks = handle.planner, []
    try:
        for step in range(60):
            expected = two_forward_step(reference, idx, idx.flip(0), step)
            settled = planner.settled
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            got = two_forward_step(model, idx, idx.flip(0), step)
            if settled:
                peaks.append(torch.cuda.max_memory_allocated() - base)
            assert all(torch.equal(g, w) for g, w in zip(got, expected)), f"step {step}"
        measured = list(planner.state.measured.values())
        framed = any(b.framed for b in planner.trace.blocks)  # float32 saves of 4 MiB and more, on CUDA
        assert planner.settled and sum(p.full for p in measured) == 2 + framed, handle.explain()
        assert [p.compressed for p in measured if p.full] == [framed, framed, False][:2 + framed]
        kept = planner.plan
        assert kept.measured_over == min(p.measured_over for p in measured), handle.explain()
        assert len(peaks) >= 2
        assert max(peaks) <= planner.target + kept.measured_over + (16 << 20), (peaks, handle.explain())
    finally:
        handle.disable()
