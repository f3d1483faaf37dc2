"""The traced steps on the CPU GPT and small block stacks: what the offload trace and the
compute trace record per block, what they leave out (a slow first offload, a first call that
loads kernels), tracing again when the inputs' shapes change, and no extra call of any block."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import storm
from planner_fakes import FakeClock, gpt, grads_of, pack_clock
from storm.examples.models import GPT, same_bits
from storm.planner import Phase
from storm.planner.trace import Shared


def test_larger_inputs_trace_again_for_at_least_their_shapes():
    """A batch larger than the traced one: the trace no longer holds, and the next trace is made for
    inputs no smaller than that batch's. A smaller step at the offload trace (before: traced, so
    padding to each batch's longest sequence made every trace of whatever came next) is not read."""
    model, idx = gpt()
    larger = torch.randint(0, 256, (16, 65))
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0)
    for _ in range(3):
        grads_of(model, idx, planner.step())
    assert planner.plan is not None and planner.replans == 0
    grads_of(model, larger, planner.step())  # a larger batch: the trace no longer holds
    ctx = planner.step()
    assert planner.plan is None and planner.replans == 1
    assert "forward" not in vars(model.blocks[0])  # the offload trace recomputes nothing
    grads_of(model, idx[:, :33], ctx)  # smaller than the batch that outgrew the trace: not read
    assert not planner.settled  # reads the step
    assert planner.trace is None and planner.smaller_steps == 1
    assert "1 step since this trace began took smaller inputs" in planner.explain()
    grads_of(model, larger, planner.step())  # the offload trace
    grads_of(model, larger, planner.step())  # the compute trace
    grads_of(model, larger, planner.step())  # planned from the two
    assert planner.plan is not None and planner.replans == 1
    assert planner.trace.blocks[0].input_bytes == 16 * 64 * 64 * 4
    planner.close()


def test_smaller_inputs_keep_the_settled_plan_and_are_not_read_before():
    """Steps of smaller inputs than traced (a shorter sequence, a smaller batch) run the plan, which
    holds for them: the settled plan stays settled (before: each traced again, and inputs padded
    to their batch's longest never settled); before it settles, they are not read, and the phase
    they ran in runs again. Every step's gradients are those of the model without STORM, bit for bit."""
    model, idx = gpt()
    ref = copy.deepcopy(model)
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    smaller = [idx[:, :33], idx[:4], idx[:2, :17]]
    phases = []
    for step in range(60):
        batch = smaller[step % 3] if step % 2 else idx  # every other step smaller, in three shapes
        phase = planner.phase
        got = grads_of(model, batch, planner.step())
        assert all(same_bits(a, b) for a, b in zip(grads_of(ref, batch), got)), step
        phases.append(phase)
        if planner.settled and step % 2:
            break
    assert planner.settled and planner.replans == 0, planner.explain()
    assert planner.smaller_steps > 0 and planner.trace.blocks[0].input_bytes == 8 * 64 * 64 * 4
    # the phase a smaller step ran in runs again: each step of idx runs the phase of the step before it
    assert all(phases[i + 1] is phases[i] for i in range(1, len(phases) - 1, 2)), phases
    settled_smaller = planner.smaller_steps
    for batch in smaller:
        grads_of(model, batch, planner.step())
        assert planner.settled and planner.replans == 0
    assert planner.smaller_steps == settled_smaller  # the settled plan's steps are read: nothing to skip
    planner.close()


def test_cpu_blocks_are_planned_raw_and_explained():
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    codecs = []
    for _ in range(4):
        ctx = planner.step()
        codecs.append(ctx.options["codec"])
        grads_of(model, idx, ctx)
    t, p = planner.trace, planner.plan
    assert codecs == ["raw", None, None, None]  # the offload trace raw, then no frame codec passed
    assert all(b.framed == b.framed_bytes == b.frame_bytes == 0 for b in t.blocks)  # CPU: nothing framed
    assert t.frame_host_ms_per_tensor == t.frame_device_ms_per_GiB == 0.0 and not p.compressed
    # whether offloading (saves or recomputed blocks' inputs) or recomputing wins depends on this
    # machine's speed; either way, no frames
    said = ("none of the offloaded blocks' saves would be compressed" if p.offloaded else
            "no block's saves are offloaded, the only ones frames are weighed for")
    assert (f"offloaded tensors go raw (codec): {said}" if p.offloads else "nothing is offloaded") in planner.explain()
    planner.close()


def test_the_offload_trace_reads_each_blocks_own_storages():
    """What a frame codec would frame is read from the storages each block offloaded: here, as
    if it framed every one."""
    def every(saves, setting):
        saves = list(saves)
        return len(saves), sum(s.nbytes for s in saves), 0

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, frames_of=every)
    grads_of(model, idx, planner.step())
    planner.step()  # reads the offload trace
    assert all(b.framed == b.tensors > 0 and b.framed_bytes == b.saved_bytes for b in planner.trace.blocks)
    planner.close()


@pytest.mark.parametrize("given, counted",
                         [({}, "auto"), ({"codec": "ancf_exp"}, "ancf_exp"), ({"codec": "raw"}, "auto")])
def test_the_offload_trace_counts_frames_by_the_codec_a_compressed_plan_takes(given, counted):
    """A compressed plan's steps take codec auto (phases.plan_context), or the user's frame codec:
    the trace counts what that codec frames."""
    settings = []

    def count(saves, setting):
        settings.append(setting)
        return 0, 0, 0

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, frames_of=count, **given)
    grads_of(model, idx, planner.step())
    planner.step()  # reads the offload trace
    assert settings and set(settings) == {counted}
    planner.close()


def test_a_pool_smaller_than_the_step_is_traced_whole_and_planned_within(caplog):
    """The offload trace counts each block's saves as the step made them: the store's refusals
    once its pool is full come back later, in other blocks, and must not move bytes between
    blocks. Plans then offload no more than the store took, and say so, those that offload
    recomputed blocks' inputs too: the store places a step's tensors where the traced step's
    went (stormd/placement.py), in a region as large as that step's, and a tensor of another
    pattern takes a free gap of it (it was POOL_FULL in a pool with no room beside the region)."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    traces = []
    for pool in (None, "small"):
        options = {} if pool is None else {"pool_size": int(traces[0].total_bytes * 0.4)}
        planner = storm.Planner(model.blocks, budget=0.05, mode="embedded", min_bytes=0, **options)
        with caplog.at_level(logging.WARNING, logger="storm"):
            for step in range(3):
                ctx = planner.step()
                got = grads_of(model, idx, ctx)
                assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
        traces.append(planner.trace)
        if pool is not None:
            assert storm.Keep.POOL_FULL not in ctx.stats.kept  # the planned step fits in the pool
            assert ctx.stats.offloaded_bytes <= planner.trace.store_bytes
            assert "the store took" in planner.explain()
        planner.close()
    roomy, small = traces
    assert roomy.store_bytes is None and 0 < small.store_bytes < small.total_bytes
    assert [(b.saved_bytes, b.tensors) for b in small.blocks] == [(b.saved_bytes, b.tensors) for b in roomy.blocks]
    assert (small.before_bytes, small.after_bytes, small.offloaded_before) == \
        (roomy.before_bytes, roomy.after_bytes, roomy.offloaded_before)
    assert "plans offload at most that" in caplog.text


def test_one_slow_first_offload_does_not_make_offloading_look_slow(monkeypatch):
    """A process's first offload also sets up the pinned pool (seconds for a large one on a
    GPU host): the host time per tensor is the median block's, not the step's mean. Here each
    put takes 10 us on the packs' clock, the first 0.5 s more."""
    from storm import mover

    put, calls, clock = mover.Mover.put, [], pack_clock(monkeypatch)

    def first_put_slow(self, req):
        calls.append(req)
        clock.now += 1e-5 + 0.5 * (len(calls) == 1)
        return put(self, req)

    monkeypatch.setattr(mover.Mover, "put", first_put_slow)
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())
    planner.step()  # reads the offload trace
    t = planner.trace
    assert t.host_ms_per_tensor == pytest.approx(2e3 * 1e-5)  # pack and unpack, as the trace counts them
    assert 2e3 * 0.5 / len(calls) > 10 * t.host_ms_per_tensor  # what the step's mean would have said
    planner.close()


class FirstCallSlow(torch.nn.Module):
    """A block that takes 1 ms a call on ``clock``, and the first call without autograd of any
    block sharing ``loaded`` (a process, as loaded kernels are) 300 ms more, as a GPU's does
    where it loads kernels that grad-mode steps never used."""

    def __init__(self, clock: FakeClock, loaded: dict[str, bool]) -> None:
        super().__init__()
        self.lin, self.clock, self.loaded = torch.nn.Linear(64, 64), clock, loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.001
        if not torch.is_grad_enabled() and not self.loaded["kernels"]:
            self.loaded["kernels"] = True
            self.clock.now += 0.3
        return torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_compute_trace_charges_each_block_its_recompute(reentrant):
    """What recomputing a block costs is timed on its recompute in backward, with autograd as in
    training: block 0 is not charged for a process's first call without autograd (on a GPU it
    once looked many times dearer than its like blocks), and no extra call of it pays that beforehand.
    A compute trace whose forward paid that call is repeated once, so the forward's totals (the
    host's lead, forward's slack) are those of later steps too."""
    clock, loaded = FakeClock(first_calls_load=True), {"kernels": False}
    blocks = torch.nn.ModuleList(FirstCallSlow(clock, loaded) for _ in range(6))
    x = torch.randn(32, 64)
    planner = storm.plan(blocks, budget=0.5, mode="embedded", min_bytes=0, reentrant=reentrant, clock=clock)
    for _ in range(4):  # the offload trace, the compute trace, and (reentrant) the compute trace again
        with planner.step():
            h = x
            for b in blocks:
                h = b(h)
        h.sum().backward()
    planner.step()  # takes the last traced step in
    t = planner.trace
    assert loaded["kernels"] == reentrant  # the reentrant form's forward runs without autograd
    assert [b.forward_ms for b in t.blocks] == pytest.approx([1.0] * 6)
    assert t.forward_device_ms == pytest.approx(6.0) and t.forward_host_ms == pytest.approx(6.0)
    assert t.lead_ms == pytest.approx([0.0] * 7)
    planner.close()


class FirstRecomputeSlow(torch.nn.Module):
    """A block that takes 1 ms a call on ``clock``, and the first call in backward of any block
    sharing ``loaded`` (a process) 30 ms more, as a fresh process's first recompute did on a GPU
    (phi3-wide: its last block charged 37.6 ms, the others 4.2)."""

    def __init__(self, clock: FakeClock, loaded: dict[str, bool]) -> None:
        super().__init__()
        self.lin, self.clock, self.loaded = torch.nn.Linear(64, 64), clock, loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.001
        if torch._C._current_graph_task_id() != -1 and not self.loaded["backward"]:
            self.loaded["backward"] = True
            self.clock.now += 0.03
        return torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_compute_trace_whose_first_recompute_paid_first_calls_is_traced_again(reentrant):
    """Backward's first recompute (the last block's) in a fresh process paid what its first calls in
    backward load: that block was charged many times its like blocks' cost, and plans weighed by it
    offloaded where recomputing was cheaper (and lost their trials). That trace is repeated once."""
    clock, loaded = FakeClock(first_calls_load=True), {"backward": False}
    blocks = torch.nn.ModuleList(FirstRecomputeSlow(clock, loaded) for _ in range(6))
    x = torch.randn(32, 64)
    planner = storm.plan(blocks, budget=0.5, mode="embedded", min_bytes=0, reentrant=reentrant, clock=clock)
    for _ in range(4):  # the offload trace, the compute trace, and the compute trace again
        with planner.step():
            h = x
            for b in blocks:
                h = b(h)
        h.sum().backward()
    planner.step()
    assert planner.traced_again and loaded["backward"]
    assert [b.forward_ms for b in planner.trace.blocks] == pytest.approx([1.0] * 6)
    planner.close()


class Counted(torch.nn.Module):
    """A block with a side effect: it counts its calls outside backward (a recompute's are in
    backward), as a layer that updates a cache or statistics as it runs would change them."""

    def __init__(self, phase: dict) -> None:
        super().__init__()
        self.lin, self.phase, self.calls = torch.nn.Linear(64, 64), phase, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += not self.phase["backward"]
        return torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_planner_calls_no_block_more_often_than_training_does(reentrant):
    """Through the traces, the plan and its trials, each block runs once a step in forward, as
    without storm.plan; only a recompute, in backward, runs it again (its untimed warm-up call
    of block 0 once appended to a Hugging Face model's KV cache and changed its gradients)."""
    phase = {"backward": False}
    blocks = torch.nn.ModuleList(Counted(phase) for _ in range(4))
    x = torch.randn(32, 64)
    planner = storm.plan(blocks, budget=0.3, mode="embedded", min_bytes=0, reentrant=reentrant)
    for step in range(6):
        with planner.step():
            h = x
            for b in blocks:
                h = b(h)
        phase["backward"] = True
        h.sum().backward()
        phase["backward"] = False
        assert [b.calls for b in blocks] == [step + 1] * 4, (step, planner.explain())
    assert planner.trace is not None and planner.plan is not None
    planner.close()


def test_the_offload_trace_offloads_every_save_as_storm_plan_s_step_not_a_full_offload():
    """The offload trace has no budget, but it is no full offload: a full-offload step follows the
    session's room of full offload (rooms.py), and a room that an earlier full offload left in the
    process (storm.enable(model) before storm.enable(model, peak=...)) kept forward's last saves on
    the device and out of the trace's count: BERT at 2 x 8192 tokens on a lent H200 counted its last
    block's saves as 0 bytes, and every plan's predicted peak came out that much short."""
    model, idx = gpt()
    full = storm.offload(mode="embedded", min_bytes=0)  # what storm.enable(model) runs
    grads_of(model, idx, full)
    assert full._step.full_offload
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    trace = planner.step()
    grads_of(model, idx, trace)
    assert not trace._step.full_offload and trace._step.room is None and trace._step.profile is None
    assert trace.stats.offloaded > 0 and not trace.stats.kept.get(storm.Keep.ROOM)
    planner.close()


class SlowBackward(torch.nn.Module):
    """A block that takes 1 ms a call on ``clock`` and ``backward_s`` (3 ms) in its backward."""

    def __init__(self, clock: FakeClock, backward_s: float = 0.003) -> None:
        super().__init__()
        self.lin, self.clock, self.backward_s = torch.nn.Linear(64, 64), clock, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.001
        clock, backward_s = self.clock, self.backward_s

        class Timed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                clock.now += backward_s
                return g

        return Timed.apply(torch.nn.functional.gelu(self.lin(x)))


def test_the_compute_trace_times_the_blocks_backward_and_explain_sets_it_beside_the_link_model_s():
    """Offloading's link model counts on the blocks' backward taking about twice their forward (a
    frozen base's fine-tune takes about one); the compute trace times it, its recomputes left out,
    so that explain() shows the two side by side on every model the planner meets. What runs
    before the blocks (a stem, an embedding: 5 ms of backward here) is not theirs."""
    clock = FakeClock()
    stem = SlowBackward(clock, backward_s=0.005)
    blocks = torch.nn.ModuleList(SlowBackward(clock) for _ in range(6))
    x = torch.randn(32, 64)
    planner = storm.plan(blocks, budget=0.5, mode="embedded", min_bytes=0, clock=clock)
    for _ in range(2):  # the offload trace, the compute trace
        with planner.step():
            h = stem(x)
            for b in blocks:
                h = b(h)
        h.sum().backward()
    planner.step()  # takes the compute trace in
    t = planner.trace
    assert t.backward_device_ms == pytest.approx(18.0)  # 6 blocks' 3 ms, their 1 ms recomputes left out
    assert sum(b.forward_ms for b in t.blocks) == pytest.approx(6.0)
    assert "the blocks' backward 18.00 ms compute stream (offloading's link model takes twice their forward, " \
           "12.00)" in planner.explain()
    planner.close()


def test_a_storage_at_a_freed_ones_address_is_another_storage():
    """Shared gives each storage an identity: a view of a live storage is the same one (shared
    once another call passes it), a new storage where a freed one was (as CUDA's caching
    allocator hands T5's decoder the memory of the encoder's position bias) is another, which the
    cost model must not count as kept once for both."""
    memory = bytearray(1024)
    shared = Shared()
    first = torch.frombuffer(memory, dtype=torch.float32)
    a, a_keys = shared.called_with([first, 3])
    b, b_keys = shared.called_with([first[:8]])
    assert a == b and all(key in shared for key in a)
    assert a_keys == [*a, None] and b_keys == a_keys[:1]  # each argument's identity by position
    del first
    c, _ = shared.called_with([torch.frombuffer(memory, dtype=torch.float32)])
    assert c.keys().isdisjoint(a.keys()) and not any(key in shared for key in c)


def test_a_compute_trace_step_whose_backward_did_not_run_is_traced_again(monkeypatch):
    """Off CUDA too: a compute-trace step that ran its forward alone (a batch skipped after it) has no
    recomputes, its blocks' last calls being the forward's (without autograd, in the reentrant form);
    the next step traces again and each block's recompute is timed as it runs in backward. Here a
    block's call takes 5 ms with autograd and 1 ms without."""
    from storm.examples.models import GPTBlock

    clock = FakeClock()
    own = GPTBlock.forward

    def timed(self, x):
        clock.now += (5.0 if torch.is_grad_enabled() else 1.0) / 1e3
        return own(self, x)

    monkeypatch.setattr(GPTBlock, "forward", timed)
    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=clock)
    try:
        grads_of(model, idx, planner.step())  # the offload trace
        with planner.step():                  # the compute trace's forward, and no backward
            model.loss(idx[:, :-1], idx[:, 1:])
        grads_of(model, idx, planner.step())
        planner.settled
        assert [b.forward_ms for b in planner.trace.blocks] == pytest.approx([5.0] * len(model.blocks))
        assert planner.trace.backward_device_ms is not None
    finally:
        planner.close()


def test_a_traced_step_that_skipped_or_reordered_blocks_says_which_and_what_a_plan_needs(caplog):
    """An offload-traced step that left a block out, or ran the blocks in another order, is traced
    again with a warning that names what ran otherwise (before: only that some block had not run
    once, which a model that never calls one of the blocks given repeats at every step, naming none).
    At the compute trace, a step that left a block out is a layer dropped (LayerDrop): not read."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
    x = torch.randn(8, 16)

    def step(ctx, order) -> None:
        with ctx:
            y = x
            for i in order:
                y = torch.tanh(blocks[i](y))
        y.sum().backward()
        planner.settled  # reads the step

    planner = storm.plan(blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger="storm"):
        step(planner.step(), [0, 1, 3])  # the offload trace, block 2 left out
        assert planner.trace is None and "block 2 never ran" in caplog.text, caplog.text
        caplog.clear()
        step(planner.step(), [0, 2, 1, 3])
        assert planner.trace is None and "block 2 ran where block 1 was due" in caplog.text, caplog.text
        assert "once in each forward, in the order given" in caplog.text
        caplog.clear()
        step(planner.step(), [0, 1, 2, 3])  # traced
        caplog.clear()
        step(planner.step(), [0, 1, 3])  # the compute trace, block 2 left out: a layer dropped, not read
        assert planner.plan is None and planner.smaller_steps == 1 and planner.phase is Phase.TRACE_COMPUTE
        assert not caplog.text
    planner.close()


def test_steps_that_drop_a_layer_run_the_plan_and_are_not_read_before_it_settles():
    """LayerDrop (Wav2Vec2's and HuBERT's encoders drop each layer with a chance in training): a step
    that leaves a block out saves less than the traced one, so it runs the plan without being read,
    as a step of smaller inputs does (before: it was read, a planned step measured or timed without
    one of its blocks). Gradients are those of the model without STORM, bit for bit."""
    import random
    import types

    def dropping(model, seed):
        rng = random.Random(seed)

        def forward(self, idx):
            x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
            for block in self.blocks:
                if not (self.training and rng.random() < 0.1):
                    x = block(x)
            return self.head(self.ln(x))
        model.forward = types.MethodType(forward, model)
        return model

    torch.manual_seed(0)
    model, idx = GPT(seq_len=32, d_model=32, n_heads=2, n_layers=4), torch.randint(0, 256, (4, 33))
    ref = dropping(copy.deepcopy(model), 1)
    model = dropping(model, 1)
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    phases, unread = [], []
    for step in range(80):
        phases.append(planner.phase)
        before = planner.smaller_steps
        got = grads_of(model, idx, planner.step())
        want = grads_of(ref, idx)
        assert all(a is None and b is None or same_bits(a, b) for a, b in zip(want, got)), step
        if not planner.settled and planner.smaller_steps > before:
            unread.append(step)
        if planner.settled and unread:
            break
    assert planner.settled and planner.replans == 0, planner.explain()
    assert unread and all(phases[i + 1] is phases[i] for i in unread if i + 1 < len(phases)), (unread, phases)
    assert all(b.saved_bytes > 0 for b in planner.trace.blocks)  # traced on a step that ran every block
    planner.close()


def test_a_larger_forward_without_backward_leaves_the_plan_as_it_is():
    """An evaluation with grad enabled (no torch.no_grad()) of a batch larger than training's: no
    backward follows, so it is no step to plan for, and the settled plan stays (at 0707e5e it traced
    again for at least the evaluation's batch, whose steps never came, so every training step after
    it ran as an offload trace; before that, it traced again once)."""
    model, idx = gpt()
    handle = storm.enable(model, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    planner = handle.planner
    try:
        for _ in range(40):
            grads_of(model, idx)
            if planner.settled:
                break
        assert planner.settled
        evaluation = torch.randint(0, 256, (32, 65))
        model.loss(evaluation[:, :-1], evaluation[:, 1:]).item()  # grad enabled, no backward
        for _ in range(3):
            grads_of(model, idx)
            assert planner.settled and planner.replans == 0, planner.explain()
    finally:
        handle.disable()


def test_an_evaluation_before_training_is_no_trace_and_a_batch_larger_than_any_other_is_waited_for_a_while():
    """Two steps not to plan for. A grad-enabled evaluation of a larger batch before training's
    first step: no backward followed, so it is not the offload trace (before: it was, and every
    training step after it, smaller, was left unread). One training batch larger than any other:
    the trace made for it waits SMALLER_RUN steps of the usual batch, then traces them (before:
    it waited for good, each step an offload trace)."""
    from storm.planner.driver import SMALLER_RUN

    model, idx = gpt()
    handle = storm.enable(model, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    planner = handle.planner
    try:
        evaluation = torch.randint(0, 256, (32, 65))
        model.loss(evaluation[:, :-1], evaluation[:, 1:]).item()  # grad enabled, no backward
        for _ in range(40):
            grads_of(model, idx)
            if planner.settled:
                break
        assert planner.settled and planner.trace.blocks[0].input_bytes == 8 * 64 * 64 * 4 and not planner.smaller_steps
        grads_of(model, torch.cat([idx, idx[:1]]))  # one batch a row larger, never again
        assert not planner.settled  # reads the step: the trace no longer holds
        steps = 0
        while True:
            grads_of(model, idx)
            steps += 1
            planner.settled  # reads the step
            if planner.plan is not None:
                break
            assert steps <= SMALLER_RUN + 2, planner.explain()  # the wait, then the two traces
        assert planner.replans == 2 and planner.trace.blocks[0].input_bytes == 8 * 64 * 64 * 4
        assert steps == SMALLER_RUN + 2 and planner.smaller_steps == 0  # a new trace's count
    finally:
        handle.disable()


def test_two_forward_steps_that_drop_block_0_in_one_forward_keep_the_plan():
    """A step of two forwards whose LayerDrop left block 0 out of one: a layer dropped, not another
    number of forwards (before: the forwards were counted by block 0's calls, and it traced again)."""
    import types

    model, idx = gpt()
    skip: list[int] = []

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = block(x)
        return self.head(self.ln(x))

    model.forward = types.MethodType(forward, model)
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())

    def step(second_skips: list[int]) -> None:
        model.zero_grad(set_to_none=True)
        with planner.step():
            skip[:] = []
            first = model.loss(idx[:, :-1], idx[:, 1:])
            skip[:] = second_skips
            second = model.loss(idx[:, :-1], idx[:, 1:])
        (first + second).backward()

    for _ in range(40):
        step([])
        if planner.settled:
            break
    assert planner.settled and planner.trace.forwards == 2
    for dropped in ([2], [0]):
        step(dropped)
        assert planner.settled and planner.replans == 0, dropped
    planner.close()


def test_a_trace_made_stale_by_its_forwards_waits_for_no_earlier_larger_inputs():
    """Steps of two forwards, then larger ones (traced again for them), then steps of one smaller
    forward: another number of forwards traces again, on the next step as it comes (before: that
    trace still waited for the larger inputs, and each step was left unread)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model, idx = GPT(seq_len=32, d_model=32, n_heads=2, n_layers=4), torch.randint(0, 256, (8, 33))
    planner = storm.Planner(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())

    def step(batch, forwards) -> None:
        model.zero_grad(set_to_none=True)
        with planner.step():
            loss = sum(F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
                       for _ in range(forwards))
        loss.backward()
        planner.settled  # reads the step

    for batch in (idx[:4], idx):  # two forwards of 4 rows, then of 8: traced again for them
        for _ in range(80):
            step(batch, 2)
            if planner.settled:
                break
        assert planner.settled
    assert planner.replans == 1
    for _ in range(3):  # one forward of 4 rows: stale, then the two traces, and a plan
        step(idx[:4], 1)
    assert planner.replans == 2 and planner.plan is not None and planner.trace.forwards == 1
    assert planner.smaller_steps == 0
    planner.close()
