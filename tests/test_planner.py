"""storm.plan: the choice made from a trace (choose), and the planner on a real model on CPU:
traced steps, the plan applied, gradients bit-identical to no offload, re-planning, bad input."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

import storm
import storm.session as session_mod
from storm.examples.models import GPT, same_bits
from storm.kernels.frame import frame_nbytes
from storm.planner import BlockTrace, Trace, _moments, _Offloading, choose, frames_of, predicted_peak
from storm.recompute import Recompute, _warn_cache_off

MiB = 1 << 20


def trace(n: int = 8, saved: int = 100 * MiB, inputs: int = 10 * MiB, fwd_ms: float = 1.0, gbps: float = 50.0,
          host_ms: float = 0.0, tensors: int = 5) -> Trace:
    blocks = [BlockTrace(saved, tensors, inputs, fwd_ms) for _ in range(n)]
    return Trace(blocks, before_bytes=MiB, after_bytes=2 * MiB,
                 offloaded_before=[MiB + i * saved for i in range(n)], host_ms_per_tensor=host_ms,
                 forward_host_ms=n * fwd_ms, forward_device_ms=n * fwd_ms, d2h_GBps=gbps, h2d_GBps=gbps)


def test_a_budget_above_the_step_changes_nothing():
    t = trace()
    p = choose(t, t.total_bytes)
    assert (p.offloaded, p.recomputed, p.offload_budget, p.predicted_cost_ms, p.fits) == (0, frozenset(), 0, 0.0, True)
    assert p.predicted_peak == t.total_bytes


def test_a_slow_link_recomputes_instead_of_offloading():
    t = trace(gbps=0.5)  # 100 MiB takes ~210 ms each way; recomputing a block costs 1 ms
    budget = t.total_bytes - 350 * MiB
    p = choose(t, budget)
    assert p.fits and p.predicted_peak <= budget
    assert p.offloaded == 0 and len(p.recomputed) == 4  # each recompute removes 90 MiB, plus the largest's 100
    assert p.predicted_cost_ms == pytest.approx(4.0)


def test_no_block_is_recomputed_that_the_fit_does_not_need():
    """Like blocks, each traced 1% cheaper than the one before (noise makes such differences):
    meeting backward's moments in turn picked block 11 for its own moment's kept_extra and
    block 10 for backward's start, where one block fits (and 6 where 5 did, ...). Every block
    the plan recomputes is needed: without any one of them the peak is over the budget, and
    no more are recomputed than checkpointing the first blocks would need."""
    n, extra = 12, 50 * MiB
    t = trace(n=n, saved=200 * MiB, inputs=16 * MiB, gbps=0.5)  # a slow link: plans recompute
    for i, b in enumerate(t.blocks):
        b.forward_ms, b.grad_bytes = 1.0 - 0.01 * i, 24 * MiB
    for budget in range(1000 * MiB, 2600 * MiB, 200 * MiB):
        p = choose(t, budget, grads=True, kept_extra=extra)
        assert p.fits and p.offloaded == 0
        for j in p.recomputed:
            assert predicted_peak(t, 0, p.recomputed - {j}, 0, True, extra) > budget, (budget, sorted(p.recomputed), j)
        first = next(k for k in range(n + 1) if predicted_peak(t, 0, set(range(k)), 0, True, extra) <= budget)
        assert len(p.recomputed) <= first, (budget, sorted(p.recomputed), first)


def test_only_a_kept_blocks_backward_holds_the_kept_extra():
    t = trace(n=4, gbps=0.5)  # a slow link: plans recompute
    every, extra = set(range(4)), 5 * MiB

    def added(offloaded: int, recomputed: set[int]) -> list[int]:  # per block's backward, then backward's start
        return [a - b for a, b in zip(_moments(t, offloaded, recomputed, 0, True, extra),
                                      _moments(t, offloaded, recomputed, 0, True))]

    assert added(0, set()) == [extra] * 4 + [0]
    assert added(0, {1, 2}) == [extra, 0, 0, extra, 0]
    assert added(0, every) == [0] * 5  # handed over
    assert added(2, {3}) == [0, 0, extra, 0, 0]  # fetched ones are handed over too
    # a budget that recomputing blocks 0-2 meets exactly, but not with block 3's kept extra:
    # recomputing block 3 too removes it there
    budget = predicted_peak(t, 0, {0, 1, 2}, 0)
    assert choose(t, budget).recomputed == {0, 1, 2}
    assert predicted_peak(t, 0, {0, 1, 2}, 0, kept_extra=extra) > budget
    assert choose(t, budget, kept_extra=extra).recomputed == every


def test_the_cheapest_blocks_per_byte_are_recomputed_first():
    t = trace(gbps=0.5)
    t.blocks[5].forward_ms = 0.1
    t.blocks[2].forward_ms = 0.2
    assert choose(t, t.total_bytes - 20 * MiB).recomputed == frozenset({5})
    assert choose(t, t.total_bytes - 150 * MiB).recomputed == frozenset({5, 2})


def test_w2_like_blocks_recompute_the_fewest_that_fit():
    """24 like blocks whose parameter gradients count at the peak (peak=), the later ones a
    little cheaper to recompute (measurement noise): every moment of backward over the budget
    is met by blocks before it, so 7 recomputed blocks fit where picking the cheapest first
    recomputed 23."""
    n = 24
    blocks = [BlockTrace(512 * MiB, 9, 32 * MiB, 2.8 * (1 - 0.002 * i), grad_bytes=384 * MiB) for i in range(n)]
    t = Trace(blocks, offloaded_before=[i * 512 * MiB for i in range(n)], forward_host_ms=70.0,
              forward_device_ms=70.0, d2h_GBps=0.5, h2d_GBps=0.5)
    budget = predicted_peak(t, 0, set(range(n)), 0) + 20 * MiB
    p = choose(t, budget, grads=True)
    assert p.fits and p.offloaded == 0 and len(p.recomputed) == 7
    assert predicted_peak(t, 0, p.recomputed, 0) <= budget


@pytest.mark.parametrize("seed", range(4))
def test_like_blocks_are_recomputed_at_the_least_cost(seed):
    """Blocks that free the same bytes: the plan's recompute cost is the least of every set of
    blocks that fits (all 2^8 tried), at each budget."""
    import itertools
    import random
    rng = random.Random(seed)
    n = 8
    blocks = [BlockTrace(100 * MiB, 5, 10 * MiB, rng.uniform(0.5, 2.0), grad_bytes=60 * MiB) for _ in range(n)]
    t = Trace(blocks, before_bytes=MiB, after_bytes=2 * MiB, offloaded_before=[MiB + i * 100 * MiB for i in range(n)],
              forward_host_ms=8.0, forward_device_ms=8.0, d2h_GBps=0.01, h2d_GBps=0.01)  # offloading never pays
    floor = predicted_peak(t, 0, set(range(n)), 0)
    for budget in range(floor, predicted_peak(t, 0, set(), 0) + 1, 45 * MiB):
        best = min(sum(blocks[i].forward_ms for i in r) for size in range(n + 1)
                   for r in itertools.combinations(range(n), size) if predicted_peak(t, 0, set(r), 0) <= budget)
        p = choose(t, budget, grads=True)
        assert p.fits and p.offloaded == 0
        assert p.predicted_cost_ms == pytest.approx(best, abs=1e-3)


def test_recomputing_only_the_last_block_saves_next_to_nothing():
    t = trace(n=2)
    # backward needs the last block's saves first: rebuilt or kept, they are all there at once,
    # and only the saves after the blocks (the loss's) are gone by then
    assert predicted_peak(t, 0, {1}, 0) == t.total_bytes - t.after_bytes
    assert predicted_peak(t, 0, {0}, 0) == t.total_bytes - 90 * MiB


def test_parameter_gradients_count_from_the_block_whose_backward_allocates_them():
    t = trace(n=4)
    for b in t.blocks:
        b.grad_bytes = 50 * MiB
    # nothing offloaded: the start of backward holds every save and the last block's gradients
    assert predicted_peak(t, 0, set(), 0) == t.total_bytes + 50 * MiB
    # everything offloaded: the end, block 0's fetched saves beside every block's gradients
    assert predicted_peak(t, 4, set(), 0) == 100 * MiB + 4 * 50 * MiB


def test_a_link_that_forward_hides_offloads_the_earliest_blocks():
    t = trace(fwd_ms=20.0, gbps=50.0)  # 100 MiB in ~2 ms against 160 ms of forward: free
    budget = t.total_bytes - 250 * MiB
    p = choose(t, budget)
    assert p.fits and p.recomputed == frozenset() and p.offloaded == 3
    assert p.offload_budget == t.offloaded_before[3]  # storm.offload(budget=) stops at block 3's first save
    assert p.predicted_cost_ms == 0.0
    # the link drains everything during forward, so nothing offloaded is left at the peak, and
    # backward frees kept blocks before it needs the offloaded ones: no prefetch window either
    assert p.predicted_peak == t.total_bytes - t.before_bytes - 300 * MiB and p.prefetch_bytes == 0
    assert p.max_held_bytes == 100 * MiB  # a block's copy takes 2 ms of the next block's 20: no stall


def test_a_busy_link_costs_a_stall_or_memory():
    t = trace(fwd_ms=1.0, gbps=50.0)  # 100 MiB per 1 ms block against 2 ms to copy it
    slow = _Offloading.of(t, 8, 100 * MiB)[0]
    fast = _Offloading.of(t, 8, None)[-1]
    assert fast.held == slow.sent == fast.sent == t.total_bytes
    assert slow.cost_ms > 5 and slow.leftover <= 100 * MiB  # forward waits for the link
    assert fast.leftover > 300 * MiB  # forward does not wait; the bytes stay on the device meanwhile
    nothing = choose(t, 10**12, held_bytes=64 * MiB, prefetch_bytes=32 * MiB)
    assert nothing.offloaded == 0 and nothing.predicted_peak == t.total_bytes  # no window counted: nothing to fetch
    p = choose(t, 300 * MiB, held_bytes=64 * MiB, prefetch_bytes=32 * MiB)
    assert (p.max_held_bytes, p.prefetch_bytes) == (64 * MiB, 32 * MiB)  # the user's options are kept


def test_host_time_per_tensor_counts_when_the_compute_stream_does_not_hide_it():
    t = trace(fwd_ms=20.0, gbps=50.0, host_ms=50.0, tensors=5)  # 250 ms per offloaded block: recompute wins
    p = choose(t, t.total_bytes - 250 * MiB)
    assert p.offloaded == 0 and p.recomputed
    # the GPU ends forward far behind the host, but the host is not ahead while it launches the
    # first blocks (as at a step's start): their packs (half of each tensor's time) still cost
    t.forward_device_ms = t.forward_host_ms + 10_000
    t.lead_ms = [0.0] * (len(t.blocks) + 1)
    p = choose(t, t.total_bytes - 250 * MiB)
    assert p.offloaded == 0 and p.recomputed
    assert _Offloading.of(t, 3, None)[0].host_ms == pytest.approx(3 * 5 * 50.0 / 2)  # the packs; unpacks hidden
    t.lead_ms = [0.0] + [10_000.0] * len(t.blocks)  # far ahead from block 1 on: host time is free
    p = choose(t, t.total_bytes - 250 * MiB)
    assert p.offloaded == 3 and not p.recomputed


def test_an_unreachable_budget_gets_the_least_peak_plan_and_says_so():
    t = trace()
    p = choose(t, 0)
    assert not p.fits
    every = set(range(len(t.blocks)))
    assert p.predicted_peak <= predicted_peak(t, 0, every, 0)  # no worse than recomputing all
    assert p.predicted_peak <= min(o.leftover for o in _Offloading.of(t, len(t.blocks), None)) + 100 * MiB


# --- raw or compressed (frames) ----------------------------------------------

def framed(t: Trace, per_block: int, frame_ms: float, saved_by_frames: int | None = None) -> Trace:
    """Every block's tensors are CUDA bf16 ones a frame codec frames (``per_block`` of equal size),
    each adding ``frame_ms`` of host time; their frames save ``saved_by_frames`` bytes per block
    over the link (what real frames save, when None)."""
    for b in t.blocks:
        b.framed, b.framed_bytes = per_block, b.saved_bytes
        b.frame_bytes = (per_block * frame_nbytes(b.saved_bytes // per_block // 2) if saved_by_frames is None
                         else b.saved_bytes - saved_by_frames)
    t.frame_host_ms_per_tensor = frame_ms
    return t


def test_the_mover_frames_cuda_bf16_storages_of_at_least_4_mib():
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    saves = [SimpleNamespace(device=d, dtype=t, nbytes=n) for d, t, n in [
        (cuda, bf16, 4 * MiB), (cuda, bf16, 64 * MiB),                        # framed
        (cuda, bf16, 4 * MiB - 2), (cuda, torch.float16, 8 * MiB), (cuda, torch.float32, 8 * MiB),
        (cpu, bf16, 8 * MiB)]]
    assert frames_of(saves) == (2, 68 * MiB, frame_nbytes(2 * MiB) + frame_nbytes(32 * MiB))
    assert frames_of([]) == (0, 0, 0)


def test_a_link_bound_step_offloads_compressed():
    # 100 MiB per 1 ms block over 50 GB/s, host time hidden by the GPU: the link decides
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + 50
    t.lead_ms = [0.0] + [50.0] * len(t.blocks)
    budget = 300 * MiB
    p, raw = choose(t, budget), choose(t, budget, codec="raw")
    assert p.compressed and p.fits and p.offloaded > 0
    assert raw.fits and raw.offloaded > 0 and not raw.compressed
    assert p.predicted_cost_ms < raw.predicted_cost_ms
    assert choose(t, budget, codec="ancf_exp") == p  # the user's frame codec: the same choice, made alone
    off_raw, off_compressed = (_Offloading.of(t, p.offloaded, p.max_held_bytes, c)[0] for c in (False, True))
    assert off_compressed.link_ms < off_raw.link_ms
    # the peak counts one block's frames beside what is in flight
    assert off_compressed.frames == t.blocks[0].frame_bytes and off_raw.frames == 0
    assert p.in_flight_bytes >= off_compressed.frames


def test_the_codecs_device_time_can_make_raw_the_cheaper():
    # the link-bound step above, with a codec whose kernels take 30 ms per GiB framed (encode and
    # decode): they share the GPU with the step's, so they count in full
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + 50
    t.lead_ms = [0.0] + [50.0] * len(t.blocks)
    budget = 300 * MiB
    assert choose(t, budget).compressed
    t.frame_device_ms_per_GiB = 30.0
    p, forced = choose(t, budget), choose(t, budget, codec="ancf_exp")
    assert p.fits and p.offloaded > 0 and not p.compressed
    assert forced.compressed and forced.predicted_cost_ms > p.predicted_cost_ms
    off = _Offloading.of(t, forced.offloaded, forced.max_held_bytes, True)[0]
    assert off.codec_ms == pytest.approx(forced.offloaded * 100 / 1024 * 30.0)
    assert off.cost_ms == pytest.approx(off.host_ms + off.link_ms + off.codec_ms)
    assert _Offloading.of(t, forced.offloaded, forced.max_held_bytes, False)[0].codec_ms == 0.0


def test_a_host_bound_step_offloads_raw():
    # 200 tensors a block, frames that save 1 MiB of its 100 and cost 150 us each, nothing hidden
    t = framed(trace(inputs=60 * MiB, host_ms=0.02, tensors=200), per_block=200, frame_ms=0.15,
               saved_by_frames=MiB)
    budget = 300 * MiB
    p = choose(t, budget)
    assert p.fits and p.offloaded > 0 and not p.compressed
    forced = choose(t, budget, codec="ancf_exp")  # the user's frame codec is respected, at its cost
    assert forced.compressed and forced.predicted_cost_ms > p.predicted_cost_ms
    off_raw, off_compressed = (_Offloading.of(t, forced.offloaded, forced.max_held_bytes, c)[0] for c in (False, True))
    assert off_compressed.host_ms - off_raw.host_ms == pytest.approx(forced.offloaded * 200 * 0.15)


@pytest.mark.parametrize("codec", [None, "ancf_exp", "auto"])
def test_nothing_frameable_is_never_compressed(codec):
    t = trace(inputs=60 * MiB, gbps=1.0)  # a slow link: frames would pay, if anything could be framed
    t.frame_host_ms_per_tensor = 0.0
    for budget in (0, 150 * MiB, 300 * MiB, 600 * MiB, t.total_bytes):
        p = choose(t, budget, codec=codec)
        assert not p.compressed and p == choose(t, budget, codec="raw")


# --- the planner on a real model ---------------------------------------------

def gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(seq_len=64, d_model=64, n_heads=4, n_layers=6, dropout=0.1), torch.randint(0, 256, (8, 65))


def grads_of(model: GPT, idx: torch.Tensor, ctx=None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in every step
    with ctx if ctx is not None else torch.enable_grad():
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    if ctx is not None:
        ctx.synchronize()  # every copy done: what backward fetches does not depend on the machine's speed
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


class FakeClock:
    """A planner's clock (storm.planner.Clock) that moves only where a test moves it: the host's
    time and the compute stream's marks are both ``now`` (seconds). Tests of decisions made by
    timings give the timings this way, never by sleeping, which a loaded machine outweighs."""

    def __init__(self, first_calls_load: bool = False) -> None:
        self.now = 0.0
        self.first_calls_load = first_calls_load  # as a GPU's clock: a slow first call is traced again

    def host(self) -> float:
        return self.now

    def mark(self) -> float:
        return self.now

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


def traced_gpt_planner(clock: FakeClock | None = None) -> tuple[GPT, torch.Tensor, list[torch.Tensor], storm.Planner]:
    """The CPU GPT, its gradients without offload, and a storm.plan(budget=0.5) over its blocks
    (timed by ``clock``, where given) past the two traced steps."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=clock)
    for _ in range(2):  # the traces
        grads_of(model, idx, planner.step())
    return model, idx, ref, planner


@pytest.mark.parametrize("budget", [0.5, 0.05])
def test_planned_steps_train_bit_exact_and_follow_the_plan(budget):
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=budget, mode="embedded", min_bytes=0)
    assert "no plan yet" in planner.explain()
    for step in range(4):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
        if step == 0:  # the offload trace: everything
            assert ctx.stats.offloaded_bytes > 0 and storm.Keep.BUDGET not in ctx.stats.kept
    plan, t = planner.plan, planner.trace
    assert plan is not None and len(t.blocks) == 6
    assert all(b.saved_bytes > 0 and b.tensors > 0 and b.input_bytes > 0 and b.forward_ms > 0 for b in t.blocks)
    # on CPU host and "stream" are one clock: the host is never ahead
    assert len(t.lead_ms) == len(t.blocks) + 1 and all(abs(lead) < 5.0 for lead in t.lead_ms)
    # set to None before each step: each block's backward allocates its parameters' gradients
    assert [b.grad_bytes for b in t.blocks] == [sum(q.numel() * q.element_size() for q in m.parameters())
                                                for m in model.blocks]
    # the last planned step did what the plan says
    recomputing = {i for i, b in enumerate(model.blocks) if "forward" in vars(b)}
    assert recomputing == set(plan.recomputed)
    expected = t.total_bytes if plan.offload_budget is None else plan.offload_budget
    assert ctx.stats.offloaded_bytes == expected
    if budget == 0.05:  # 5% of the step cannot stay on the device without recomputing or offloading most
        assert plan.offloaded + len(plan.recomputed) >= 5
    assert plan.fits == (plan.predicted_peak <= int(budget * t.total_bytes))
    text = planner.explain()
    assert len([line for line in text.splitlines() if line.rstrip().endswith(("offload", "recompute", "keep"))]) >= 6
    planner.close()
    assert not any("forward" in vars(b) for b in model.blocks)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)


def test_new_input_shapes_trace_again():
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0)
    for _ in range(3):
        grads_of(model, idx, planner.step())
    assert planner.plan is not None and planner.replans == 0
    grads_of(model, idx[:, :33], planner.step())  # a shorter sequence: the trace no longer holds
    ctx = planner.step()
    assert planner.plan is None and planner.replans == 1
    assert "forward" not in vars(model.blocks[0])  # the offload trace recomputes nothing
    grads_of(model, idx[:, :33], ctx)
    grads_of(model, idx[:, :33], planner.step())  # the compute trace
    grads_of(model, idx[:, :33], planner.step())  # planned from the two
    assert planner.plan is not None
    assert planner.trace.blocks[0].input_bytes == 8 * 32 * 64 * 4
    planner.close()


def test_an_unreachable_budget_warns_and_trains(caplog):
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=1, mode="embedded", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(3):
            got = grads_of(model, idx, planner.step())
    assert not planner.plan.fits
    assert any("no plan keeps the saved activations under" in r.getMessage() for r in caplog.records)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    planner.close()


@pytest.mark.parametrize("blocks, budget, options, error", [
    ([], "1GiB", {}, TypeError),
    (["not a module"], "1GiB", {}, TypeError),
    (None, None, {}, TypeError),
    (None, -1, {}, ValueError),
    (None, 1.5, {}, ValueError),
    (None, "lots", {}, ValueError),
    (None, "1GiB", {"budget": 0.5}, TypeError),
    (None, "1GiB", {"min_bytes": -1}, ValueError),
    (None, "1GiB", {"peak": "1GiB"}, TypeError),  # one or the other
    (None, None, {"peak": 0.5}, ValueError),
    (None, None, {"peak": "a lot"}, ValueError),
    (None, None, {"peak": -5}, ValueError),
])
def test_bad_plans_are_refused(blocks, budget, options, error):
    model, _ = gpt()
    with pytest.raises(error):
        storm.plan(model.blocks if blocks is None else blocks, budget=budget, **options)


def test_plan_options_in_sizes_reach_the_plan_as_bytes(monkeypatch):
    """The options go to the planner's choice as bytes, whatever it chooses (which depends on
    the trace's timings: on a busy CPU recomputing every block can win, and a plan that
    offloads nothing has no copy queue); a plan that offloads uses them."""
    import storm.planner as planner_mod

    asked = []
    choose = planner_mod.choose

    def recorded(trace, budget, held_bytes=None, prefetch_bytes=None, *args, **kwargs):
        asked.append((held_bytes, prefetch_bytes))
        return choose(trace, budget, held_bytes, prefetch_bytes, *args, **kwargs)

    monkeypatch.setattr(planner_mod, "choose", recorded)
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes="0", max_held_bytes="1MiB",
                         prefetch_bytes="2MiB")
    assert planner._options == {"mode": "embedded", "min_bytes": 0, "max_held_bytes": 1 << 20,
                                "prefetch_bytes": 2 << 20}
    for _ in range(3):  # two traces, then a plan made with those options
        grads_of(model, idx, planner.step())
    assert asked and set(asked) == {(1 << 20, 2 << 20)}
    assert planner.plan is not None and planner.plan.max_held_bytes == (1 << 20 if planner.plan.offloaded else 0)
    planner.close()


def test_reentrant_false_recomputes_for_torch_autograd_grad():
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=0.05, mode="embedded", min_bytes=0, reentrant=False)
    for _ in range(4):
        ctx = planner.step()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with ctx:
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        ctx.synchronize()
        got = torch.autograd.grad(loss, list(model.parameters()))
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.plan.recomputed
    assert all(not model.blocks[i].forward.reentrant for i in planner.plan.recomputed)
    planner.close()


def test_a_block_with_its_own_forward_attribute_is_refused_clearly():
    model, idx = gpt()
    model.blocks[3].forward = model.blocks[3].forward  # e.g. wrapped by another tool
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())
    with pytest.raises(RuntimeError, match="block 3 .*own forward"):
        planner.step()


def test_cpu_blocks_are_planned_raw_and_explained():
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    codecs = []
    for _ in range(4):
        ctx = planner.step()
        codecs.append(ctx._options["codec"])
        grads_of(model, idx, ctx)
    t, p = planner.trace, planner.plan
    assert codecs == ["raw", None, None, None]  # the offload trace raw, then no frame codec passed
    assert all(b.framed == b.framed_bytes == b.frame_bytes == 0 for b in t.blocks)  # CPU: nothing framed
    assert t.frame_host_ms_per_tensor == t.frame_device_ms_per_GiB == 0.0 and not p.compressed
    # whether offloading or recomputing wins depends on this machine's speed; either way, no frames
    assert ("offloaded tensors go raw: none would be framed" if p.offloaded else "nothing offloaded") \
        in planner.explain()
    planner.close()


def test_the_offload_trace_reads_each_blocks_own_storages(monkeypatch):
    """What a frame codec would frame is read from the storages each block offloaded: here, as
    if it framed every one."""
    from storm import planner as planner_module

    def every(saves):
        saves = list(saves)
        return len(saves), sum(s.nbytes for s in saves), 0

    monkeypatch.setattr(planner_module, "frames_of", every)
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())
    planner.step()  # reads the offload trace
    assert all(b.framed == b.tensors > 0 and b.framed_bytes == b.saved_bytes for b in planner.trace.blocks)
    planner.close()


@pytest.mark.parametrize("hidden_ms, choice", [(50.0, "compressed"), (0.0, "raw")])
def test_explain_says_raw_or_compressed_and_why(hidden_ms, choice):
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=300 * MiB, mode="embedded")
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + hidden_ms  # unhidden, frames' host time outweighs their link time
    planner.trace, planner.plan = t, choose(t, 300 * MiB)
    raw, compressed = (_Offloading.of(t, planner.plan.offloaded, planner.plan.max_held_bytes, c)[0]
                       for c in (False, True))
    text = planner.explain()
    assert f"offloaded tensors go {choice}: predicted link {compressed.link_ms:.2f} ms compressed against " \
           f"{raw.link_ms:.2f} ms raw" in text
    assert f"host {compressed.host_ms - raw.host_ms:+.2f} ms (100 us per frame" in text
    assert f"codec kernels +{compressed.codec_ms:.2f} ms on the device (0.00 ms per GiB framed)" in text
    planner.close()


def fix_plan(monkeypatch, offloaded: int, recomputed: set[int], compressed: bool = False) -> None:
    """The planner chooses this plan, whatever it measured. Its predicted peak is far above the
    step, so backward has room to fetch everything ahead as soon as it starts."""
    from storm import planner as planner_module

    def fixed(trace, budget, held_bytes=None, prefetch_bytes=None, offload_margin=0, grads=False, codec=None,
              offload=None, kept_extra=0):
        return planner_module.Plan(offloaded, frozenset(recomputed), trace.offloaded_before[offloaded], 1 << 30, 0,
                                   1 << 40, 0.0, True, compressed=compressed)

    monkeypatch.setattr(planner_module, "choose", fixed)


def test_a_given_plan_is_applied_and_backward_progress_drives_prefetch(monkeypatch):
    """With the choice fixed (blocks 0-1 offloaded, 4 recomputed, the rest kept), a planned step
    offloads exactly the first two blocks, recomputes block 4, and fetches every offloaded
    tensor ahead of its unpack although its own prefetch window is 0: the hooks on the kept
    blocks' outputs report the room backward has made."""
    fix_plan(monkeypatch, 2, {4})
    model, idx, ref, planner = traced_gpt_planner()
    past = []  # saves past the offloaded blocks that reached STORM's hooks
    monkeypatch.setattr(session_mod.ClientSession, "save_past_budget",
                        lambda self, t, step: past.append(t) or session_mod.Kept(t))
    ctx = planner.step()
    got = grads_of(model, idx, ctx)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    t = planner.trace
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == {4}
    st = ctx.stats
    assert st.offloaded_bytes == t.before_bytes + t.blocks[0].saved_bytes + t.blocks[1].saved_bytes
    # the hooks came off after block 1: blocks 2-5 saved as without STORM
    assert not past and storm.Keep.BUDGET not in st.kept
    assert st.fetched == st.offloaded and st.prefetch_hits == st.offloaded
    planner.close()


@pytest.mark.parametrize("given, passed", [({}, "ancf_exp"), ({"codec": "raw"}, "raw")])
def test_a_compressed_plan_offloads_with_a_frame_codec_unless_the_user_gave_one(monkeypatch, given, passed):
    fix_plan(monkeypatch, 2, set(), compressed=True)
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0, **given)
    for _ in range(3):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
    assert ctx._options["codec"] == passed
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    planner.close()


def test_a_raw_plan_says_raw_where_frames_were_weighed(monkeypatch):
    """Where the trace found tensors a frame codec would frame, a plan that chose raw says so, so
    that a daemon whose codec setting frames CUDA tensors does not frame them behind its back."""
    from storm import planner as planner_module

    monkeypatch.setattr(planner_module, "frames_of", lambda saves: (1, 8 * MiB, 6 * MiB))
    fix_plan(monkeypatch, 2, set(), compressed=False)
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    for _ in range(3):
        ctx = planner.step()
        grads_of(model, idx, ctx)
    assert ctx._options["codec"] == "raw"
    planner.close()


@pytest.mark.parametrize("told", [False, True])
def test_allow_prefetch_lets_offloaded_bytes_come_back_ahead(told):
    """storm.offload's allow_prefetch(): with no prefetch window, backward fetches ahead only
    when told that room was made."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(6)]
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes=0) as ctx:
        h = torch.randn(64, 256)
        for layer in layers:
            h = torch.relu(layer(h))
        if told:
            h.register_hook(lambda g: ctx.allow_prefetch(1 << 30))  # runs as backward starts
    ctx.synchronize()  # every copy done: backward has to fetch them all
    h.sum().backward()
    ctx.synchronize()
    assert ctx.stats.offloaded == ctx.stats.fetched > 0
    assert ctx.stats.prefetch_hits == (ctx.stats.offloaded if told else 0)


def test_prefetch_takes_no_more_than_the_room_backward_made():
    """A fetch starts only where the whole tensor fits in the room allow_prefetch() reports
    (storm.plan's is its peak's slack): 2.5 tensors' room fetches two, not three."""
    x = torch.randn(64, 256, requires_grad=True)
    one = x.numel() * x.element_size()
    seen = []
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes=0) as ctx:
        h = x
        for _ in range(6):
            h = torch.tanh(h * 1.5)  # six fresh tensors of `one` bytes

        def room(grad: torch.Tensor) -> None:
            ctx.allow_prefetch(5 * one // 2)
            seen.append(ctx._session.prefetch.nbytes)

        h.register_hook(room)
    ctx.synchronize()
    h.sum().backward()
    assert seen == [2 * one]
    assert ctx.stats.fetched == ctx.stats.offloaded == 6


def test_a_pool_smaller_than_the_step_is_traced_whole_and_planned_within(caplog):
    """The offload trace counts each block's saves as the step made them: the store's refusals
    once its pool is full come back later, in other blocks, and must not move bytes between
    blocks. Plans then offload no more than the store took, and say so."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    traces = []
    for pool in (None, "small"):
        options = {} if pool is None else {"pool_size": int(traces[0].total_bytes * 0.4)}
        planner = storm.plan(model.blocks, budget=0.05, mode="embedded", min_bytes=0, **options)
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


def test_drain_lets_go_of_copied_tensors_after_the_hooks_are_off():
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0, budget=3 * 64 * 256 * 4) as ctx:
        h = x
        for _ in range(6):
            h = torch.tanh(h * 1.5)  # saves one fresh 64 KiB tensor each: 3 go, then the hooks come off
        st = ctx.stats
        assert st.offloaded == 3 and st.stored_bytes < st.offloaded_bytes  # the last copy is not released yet
        ctx.drain(0)  # waits for the copies, then lets go of them
        assert st.stored_bytes == st.offloaded_bytes
    h.sum().backward()


def test_a_plan_through_stormd_trains_bit_exact(daemon, monkeypatch):
    """The same fixed plan as above, its offloaded blocks stored by a real stormd process."""
    fix_plan(monkeypatch, 3, {4})
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=0.5, mode="daemon", socket=daemon.endpoint, min_bytes=0)
    for _ in range(3):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert "stormd" in ctx.backend_name
    t = planner.trace
    assert ctx.stats.offloaded_bytes == t.offloaded_before[3] and ctx.stats.prefetch_hits == ctx.stats.offloaded
    planner.close()


# --- measured peaks correct the plan (the CUDA allocator's peak, scripted here) ---------

def test_a_margin_holds_plans_that_offload_to_less():
    t = trace(fwd_ms=20.0, gbps=50.0)  # the link is free: offloading 3 blocks is the plan
    budget = t.total_bytes - 250 * MiB
    assert choose(t, budget).offloaded == 3
    p = choose(t, budget, offload_margin=150 * MiB)  # offloading plans were measured 150 MiB over
    assert p.fits and (p.offloaded == 0 or p.predicted_peak + 150 * MiB <= budget)
    assert p.offloaded == 0 or p.offloaded > 3  # the 3-block plan no longer fits
    assert choose(t, budget, offload_margin=10**12).offloaded == 0  # recomputing is not held to it


class ScriptedMemory:
    """Stands in for the CUDA caching allocator's step peak: the trace's predicted saves plus
    `besides`, and for plans that offload `extra` more than they predict."""

    besides, extra = 40 * MiB, 70 * MiB
    kept_extra = 0  # what a kept block's backward holds beyond a recomputed one's
    planner = None

    def __init__(self, device):
        self.available, self.starts = True, 0

    def start(self) -> None:
        self.starts += 1

    def peak(self) -> int:
        pl = ScriptedMemory.planner
        if pl.plan is None:  # the compute traces: every block recomputed, without the hand-over in the second
            every = set(range(len(pl.trace.blocks)))
            return (self.besides + predicted_peak(pl.trace, 0, every, 0)
                    + self.kept_extra * (pl._phase == "trace-compute-kept"))
        p = pl.plan
        return (self.besides + predicted_peak(pl.trace, p.offloaded, p.recomputed, p.in_flight_bytes,
                                              kept_extra=self.kept_extra) + (self.extra if p.offloaded else 0))


def no_form_trial(monkeypatch) -> None:
    """For tests that follow the steps before it: the recompute form's trial, which comes last
    (test_the_faster_recompute_form_is_kept), would add its steps."""
    monkeypatch.setattr(storm.Planner, "_other_form", lambda self, plan: None)


def scripted_planner(monkeypatch, **kw):
    """A planner on the CPU GPT whose steps' peaks ScriptedMemory reports, and whose choice is
    fixed: offload the first 2 blocks unless offloading plans carry a margin, then recompute 4."""
    from storm import planner as planner_module

    def fixed(trace, budget, held_bytes=None, prefetch_bytes=None, offload_margin=0, grads=False, codec=None,
              offload=None, kept_extra=0):
        if offload_margin <= 0:
            return planner_module.Plan(2, frozenset(), trace.offloaded_before[2], 1 << 30, 0,
                                       predicted_peak(trace, 2, set(), 0), 0.0, True)
        rec = frozenset(range(4))
        return planner_module.Plan(0, rec, 0, 0, 0, predicted_peak(trace, 0, rec, 0), 1.0, True)

    monkeypatch.setattr(planner_module, "choose", fixed)
    monkeypatch.setattr(planner_module, "_PeakMemory", ScriptedMemory)
    no_form_trial(monkeypatch)
    # these tests follow the peak: a host check set off by a loaded CPU's pack times would plan again
    monkeypatch.setattr(planner_module, "HOST_CHECK_TOLERANCE", float("inf"))
    model, idx = gpt()
    planner = storm.plan(model.blocks, mode="embedded", min_bytes=0, **kw)
    ScriptedMemory.planner = planner
    return model, idx, planner


def test_a_step_measured_over_its_target_plans_again_with_a_margin(monkeypatch):
    model, idx, planner = scripted_planner(monkeypatch, budget=0.9)
    ref = grads_of(copy.deepcopy(model), idx)
    for _ in range(3):
        got = grads_of(model, idx, planner.step())
    assert planner.besides == ScriptedMemory.besides  # from the compute trace
    assert planner._measured is not None  # read as backward ended, before anything between steps
    first = planner.plan
    assert first.offloaded == 2
    assert not planner.settled  # reading the first plan's measured step finds it over its target ...
    assert planner.measured_peak == planner.besides + planner._step_peak(first) + ScriptedMemory.extra
    # ... by `extra`: offloading plans get a margin, and the next plan recomputes
    assert planner._margins[True] >= ScriptedMemory.extra and planner._margins[False] == 0
    ctx = planner.step()
    assert planner.plan.offloaded == 0 and planner.plan.recomputed == frozenset(range(4))
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == set(range(4))
    got = grads_of(model, idx, ctx)
    assert planner.settled  # measured within its target: no more measuring
    assert planner.measured_peak <= planner.target
    assert planner._memory.starts == 3  # the compute trace and the two planned steps measured, no more
    grads_of(model, idx, planner.step())
    assert planner._memory.starts == 3 and planner.settled
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert "measured: step peak" in planner.explain() and "after 2 measured steps" in planner.explain()
    planner.close()


def test_peak_is_the_target_and_the_besides_come_off_it(monkeypatch):
    monkeypatch.setattr(ScriptedMemory, "extra", 0)
    model, idx, planner = scripted_planner(monkeypatch, peak="60MiB")
    for _ in range(4):  # with peak=, the compute trace runs twice, with and without the hand-over
        grads_of(model, idx, planner.step())
    assert planner._saved_budget() == 60 * MiB - ScriptedMemory.besides
    assert planner.target == 60 * MiB
    assert not planner.settled  # until a second offloading step's host time is read
    assert not planner._checking and planner.plan.offloaded == 2  # within the target at the first measure
    grads_of(model, idx, planner.step())
    assert planner.settled
    assert "peak 60.0 MiB above the step's start" in planner.explain()
    planner.close()


def test_kept_blocks_backward_is_planned_with_what_it_holds_more(monkeypatch):
    """Autograd keeps a kept block's saves until each node that saved them ends, where Recompute
    hands a recomputed block's over as the node takes them (W1 on the H100: a plan that kept
    blocks 0 and 1 went 18 MiB over its cap without counting it). The second compute trace,
    without the hand-over, measures the difference, and plans count it at kept blocks'
    backward: at a peak where the plan that leaves it out would go over, the planner takes one
    that does not, and its steps stay within the target."""
    from storm import planner as planner_module

    monkeypatch.setattr(planner_module, "_PeakMemory", ScriptedMemory)
    monkeypatch.setattr(ScriptedMemory, "extra", 0)
    no_form_trial(monkeypatch)
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    options = {"mode": "embedded", "min_bytes": 0, "pool_size": "64KiB"}  # plans offload almost nothing
    probe = ScriptedMemory.planner = storm.plan(model.blocks, peak="1GiB", **options)
    for _ in range(3):
        grads_of(model, idx, probe.step())
    t = probe.trace
    probe.close()
    extra = t.blocks[0].saved_bytes // 2

    def over(b: int) -> bool:  # the plan that leaves the extra out goes over b with it
        blind = choose(t, b, grads=True)
        return predicted_peak(t, blind.offloaded, blind.recomputed, blind.in_flight_bytes, kept_extra=extra) > b

    budget = next(b for b in range(t.total_bytes, 0, -MiB // 8)
                  if over(b) and choose(t, b, grads=True, kept_extra=extra).fits)
    blind = choose(t, budget, grads=True)
    monkeypatch.setattr(ScriptedMemory, "kept_extra", extra)
    planner = ScriptedMemory.planner = storm.plan(model.blocks, peak=budget + ScriptedMemory.besides, **options)
    for _ in range(5):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.kept_extra == extra and planner.besides == ScriptedMemory.besides
    assert planner.plan == choose(planner.trace, budget, grads=True, kept_extra=extra) != blind
    assert planner.settled and planner._checks == 1 and planner.measured_peak <= planner.target
    assert f"and {extra / MiB:.1f} more while a kept block's backward runs" in planner.explain()
    planner.close()


def test_a_step_that_stays_over_after_the_last_correction_is_kept_with_a_warning(monkeypatch, caplog):
    model, idx, planner = scripted_planner(monkeypatch, budget=0.9)
    traced = ScriptedMemory.peak
    # every measured planned step is far over, whatever it does
    monkeypatch.setattr(ScriptedMemory, "peak", lambda self: traced(self) + (10**12 if planner.plan else 0))
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(8):
            grads_of(model, idx, planner.step())
    assert planner.settled and planner._checks == 4
    assert any("after 4 corrections; keeping this plan" in r.getMessage() for r in caplog.records)
    planner.close()


def test_peak_needs_cuda():
    model, _ = gpt()
    with pytest.raises(ValueError, match="peak= is measured with the CUDA caching allocator"):
        storm.plan(model.blocks, peak="1GiB")


def pack_clock(monkeypatch) -> FakeClock:
    """A FakeClock that times the training thread's packs (OffloadStats.pack_s) in place of the
    host's: a test moves it where a pack is to take time."""
    clock = FakeClock()
    monkeypatch.setattr(session_mod, "time", SimpleNamespace(perf_counter=clock.host))
    return clock


def test_one_slow_first_offload_does_not_make_offloading_look_slow(monkeypatch):
    """A process's first offload also sets up the pinned pool (seconds for a large one on a
    GPU host): the host time per tensor is the median block's, not the step's mean. Here each
    put takes 10 us on the packs' clock, the first 0.5 s more."""
    from storm import transfer

    put, calls, clock = transfer.Mover.put, [], pack_clock(monkeypatch)

    def first_put_slow(self, req):
        calls.append(req)
        clock.now += 1e-5 + 0.5 * (len(calls) == 1)
        return put(self, req)

    monkeypatch.setattr(transfer.Mover, "put", first_put_slow)
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())
    planner.step()  # reads the offload trace
    t = planner.trace
    assert t.host_ms_per_tensor == pytest.approx(2e3 * 1e-5)  # pack and unpack, as the trace counts them
    assert 2e3 * 0.5 / len(calls) > 10 * t.host_ms_per_tensor  # what the step's mean would have said
    planner.close()


class FirstCallSlow(torch.nn.Module):
    """A block that takes 1 ms a call on ``clock``, and a process's first call without autograd
    300 ms more, as a GPU's does where it loads kernels that grad-mode steps never used."""

    loaded = False  # per process, as loaded kernels are

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.lin, self.clock = torch.nn.Linear(64, 64), clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += 0.001
        if not torch.is_grad_enabled() and not FirstCallSlow.loaded:
            FirstCallSlow.loaded = True
            self.clock.now += 0.3
        return torch.nn.functional.gelu(self.lin(x))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_compute_trace_charges_each_block_its_recompute(monkeypatch, reentrant):
    """What recomputing a block costs is timed on its recompute in backward, with autograd as in
    training: block 0 is not charged for a process's first call without autograd (W1's block 0
    on a lent H100 once looked that much dearer), and no extra call of it pays that beforehand.
    A compute trace whose forward paid that call is repeated once, so the forward's totals (the
    host's lead, forward's slack) are those of later steps too."""
    monkeypatch.setattr(FirstCallSlow, "loaded", False)
    clock = FakeClock(first_calls_load=True)
    blocks = torch.nn.ModuleList(FirstCallSlow(clock) for _ in range(6))
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
    assert FirstCallSlow.loaded == reentrant  # the reentrant form's forward runs without autograd
    assert [b.forward_ms for b in t.blocks] == pytest.approx([1.0] * 6)
    assert t.forward_device_ms == pytest.approx(6.0) and t.forward_host_ms == pytest.approx(6.0)
    assert t.lead_ms == pytest.approx([0.0] * 7)
    planner.close()


def fix_plan_by_host_cost(monkeypatch, dearer_than_ms: float) -> list[float]:
    """The planner offloads blocks 0-1 while the trace's host time per tensor is at most
    ``dearer_than_ms``, else recomputes them; returns the host times it was asked with."""
    from storm import planner as planner_module

    seen = []

    def by_host_cost(trace, budget, held_bytes=None, prefetch_bytes=None, offload_margin=0, grads=False, codec=None,
                     offload=None, kept_extra=0):
        seen.append(trace.host_ms_per_tensor)
        if trace.host_ms_per_tensor <= dearer_than_ms:
            return planner_module.Plan(2, frozenset(), trace.offloaded_before[2], 1 << 30, 0, 1 << 40, 0.0, True)
        return planner_module.Plan(0, frozenset({0, 1}), 0, 0, 0, 1 << 40, 1.0, True)

    monkeypatch.setattr(planner_module, "choose", by_host_cost)
    no_form_trial(monkeypatch)
    return seen


@pytest.mark.parametrize("slow_ms", [0.0, 20.0])
def test_a_planned_steps_dearer_packs_replace_the_traced_host_time(monkeypatch, slow_ms):
    """The trace's host time per offloaded tensor is the offload trace's median block's; a
    planned step's packs can cost more (on a lent H100 with W1's block 0 offloaded, 205 us
    against 75). The second planned step that offloads is read: slower packs (here each put takes
    ``slow_ms`` on the packs' clock once the trace is done) become the trace's and the planner plans again,
    here to recompute instead; faster ones (here against a trace set to 5 ms a tensor) change
    nothing. Gradients stay bit-exact."""
    from storm import transfer

    seen = fix_plan_by_host_cost(monkeypatch, dearer_than_ms=10.0)
    put, clock = transfer.Mover.put, pack_clock(monkeypatch)

    def put_slower(self, req):
        clock.now += slow_ms / 1e3
        return put(self, req)

    model, idx, ref, planner = traced_gpt_planner()
    monkeypatch.setattr(transfer.Mover, "put", put_slower)
    assert planner.trace.host_ms_per_tensor == 0.0  # the packs' clock stood still in the trace
    if not slow_ms:
        planner.trace.host_ms_per_tensor = 5.0  # far over what packs take here
    traced_ms = planner.trace.host_ms_per_tensor
    offloading = []
    for step in range(4):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        offloading.append(ctx.stats.offloaded > 0)
        # not settled before the second offloading step has been read
        assert planner.settled == (step >= 1)
    if slow_ms:
        assert offloading == [True, True, False, False]
        assert planner.traced_host_ms_per_tensor == traced_ms
        assert planner.trace.host_ms_per_tensor == pytest.approx(2 * slow_ms)  # pack and unpack, as the trace counts
        assert seen[-1] == planner.trace.host_ms_per_tensor and planner.plan.offloaded == 0
        assert f"(measured in a planned step; traced {traced_ms * 1e3:.0f})" in planner.explain()
    else:
        assert offloading == [True] * 4 and planner.traced_host_ms_per_tensor is None
        assert planner.trace.host_ms_per_tensor == traced_ms and set(seen) == {traced_ms}  # never planned again
    planner.close()


@pytest.mark.parametrize("slow, kept", [("offload", "recompute"), ("recompute", "offload")])
def test_the_plan_and_the_best_of_the_other_kind_are_tried_and_the_faster_kept(monkeypatch, slow, kept):
    """The model's costs are approximate; where the best plan that offloads and the best that
    does not both fit, the planner runs them in alternation, TRIAL_STEPS steps each, times
    forward and backward, and keeps the faster: here offloading blocks 0-1 (the model's choice)
    against recomputing them, with ``slow`` made 20 ms a call slower on the planner's clock.
    Every step's gradients are those of no offload, bit for bit."""
    from storm import planner as planner_module
    from storm import transfer

    def by_kind(trace, budget, held_bytes=None, prefetch_bytes=None, offload_margin=0, grads=False, codec=None,
                offload=None, kept_extra=0):
        if offload is False:
            return planner_module.Plan(0, frozenset({0, 1}), 0, 0, 0, 1 << 40, 5.0, True)
        return planner_module.Plan(2, frozenset(), trace.offloaded_before[2], 1 << 30, 0, 1 << 40, 1.0, True)

    monkeypatch.setattr(planner_module, "choose", by_kind)
    no_form_trial(monkeypatch)
    clock = FakeClock()
    cls, name = (transfer.Mover, "put") if slow == "offload" else (Recompute, "__call__")
    call = getattr(cls, name)

    def slower(*args, **kwargs):
        clock.now += 0.02
        return call(*args, **kwargs)

    model, idx, ref, planner = traced_gpt_planner(clock)
    monkeypatch.setattr(cls, name, slower)
    offloading = []
    for step in range(planner_module.HOST_CHECK_STEP + 2 * planner_module.TRIAL_STEPS + 2):
        assert planner.settled == (len(offloading) >= planner_module.HOST_CHECK_STEP + 2 * planner_module.TRIAL_STEPS)
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        offloading.append(ctx.stats.offloaded > 0)
    trial = planner.trial
    # the model's plan until its host time is read, then both in turn, then the faster
    assert offloading == [True] * 2 + [True, False] * planner_module.TRIAL_STEPS + [kept == "offload"] * 2
    assert all(len(ms) == planner_module.TRIAL_STEPS for ms in trial.ms)
    assert trial.median(0 if slow == "recompute" else 1) < trial.median(1 if slow == "recompute" else 0)
    assert abs(trial.gain_ms) >= 20.0  # at least one slower call a step, by the clock alone
    assert (planner.plan.offloaded > 0) == (kept == "offload") and trial.kept is planner.plan
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == set(planner.plan.recomputed)
    text = planner.explain()
    assert "tried in alternation" in text
    assert f"kept {'offload 2 blocks' if kept == 'offload' else 'recompute 2 blocks'}" in text
    planner.close()


def recompute_two(trace, budget, held_bytes=None, prefetch_bytes=None, offload_margin=0, grads=False, codec=None,
                  offload=None, kept_extra=0):
    """choose() for the form trials' tests: recompute blocks 0 and 1, and no plan that offloads
    (none of the other kind: the form's trial comes at once)."""
    from storm import planner as planner_module

    return None if offload else planner_module.Plan(0, frozenset({0, 1}), 0, 0, 0, 1 << 40, 1.0, True)


@pytest.mark.parametrize("slow", ["reentrant", "non-reentrant"])
def test_the_faster_recompute_form_is_kept(monkeypatch, slow):
    """A plan that recomputes in the reentrant form runs in alternation with the same plan
    recomputing by torch's non-reentrant checkpoint (cheaper on the GPU where blocks end in
    work nothing saves, dearer on the host), and the faster is kept; here the ``slow`` form's
    blocks each take 100 ms more on the planner's clock (a sleep instead was outweighed by a
    loaded machine's noise). Every step's gradients are those of no offload, bit for bit."""
    from storm import planner as planner_module

    monkeypatch.setattr(planner_module, "choose", recompute_two)
    clock = FakeClock()
    call = Recompute.__call__

    def slower(self, *a, **k):
        if self.reentrant == (slow == "reentrant"):
            clock.now += 0.1
        return call(self, *a, **k)

    model, idx, ref, planner = traced_gpt_planner(clock)
    monkeypatch.setattr(Recompute, "__call__", slower)
    forms = []
    for step in range(2 * planner_module.TRIAL_STEPS + 2):
        assert planner.settled == (step >= 2 * planner_module.TRIAL_STEPS)
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        forms.append({model.blocks[i].forward.reentrant for i in (0, 1)})
    kept = slow == "non-reentrant"
    assert forms == [{True}, {False}] * planner_module.TRIAL_STEPS + [{kept}] * 2, planner.explain()
    assert planner.plan.reentrant == kept and planner.plan.recomputed == frozenset({0, 1})
    text = planner.explain()
    assert f"kept recompute 2 blocks{'' if kept else ' non-reentrant'}" in text
    assert ("reentrant form (storm.recompute)" if kept else "non-reentrant checkpoint, faster here") in text
    planner.close()


def timed_form_trial(monkeypatch, ms) -> tuple[list[bool], storm.Planner]:
    """A planner on the CPU GPT whose plan recomputes blocks 0 and 1, run through its form trial
    (and 2 steps more) with the trial's step times given: ``ms(k, reentrant)`` for its k-th
    step. Returns the form of each step and the planner."""
    from storm import planner as planner_module

    monkeypatch.setattr(planner_module, "choose", recompute_two)
    clock, timed = FakeClock(), []
    model, idx, ref, planner = traced_gpt_planner(clock)

    def given(start, end):  # a trial step's, read as the next step starts with its plan still in force
        if planner._trial is None:  # the compute trace's, read at the first planned step
            return FakeClock.elapsed_ms(clock, start, end)
        timed.append(ms(len(timed), planner.plan.reentrant))
        return timed[-1]

    clock.elapsed_ms = given
    forms = []
    while not planner.settled or len(forms) < len(timed) + 2:
        assert len(forms) <= 2 * planner_module.TRIAL_MAX_STEPS + 2, planner.explain()
        ctx = planner.step()
        forms.append(planner.plan.reentrant)
        grads_of(model, idx, ctx)
    return forms, planner


@pytest.mark.parametrize("apart, close", [(0.01, True), (0.05, False)])
def test_a_trial_whose_plans_are_close_runs_more_steps_before_it_decides(monkeypatch, apart, close):
    """Plans within TRIAL_CLOSE of each other are within a lent GPU's step-to-step noise: the
    trial then runs each plan up to TRIAL_MAX_STEPS steps before it keeps the faster; farther
    apart, TRIAL_STEPS decide. Here the non-reentrant form's steps take ``apart`` less."""
    from storm import planner as planner_module

    forms, planner = timed_form_trial(monkeypatch, lambda k, reentrant: 100.0 if reentrant else 100.0 * (1 - apart))
    steps = planner_module.TRIAL_MAX_STEPS if close else planner_module.TRIAL_STEPS
    assert planner_module.TRIAL_STEPS < planner_module.TRIAL_MAX_STEPS
    assert forms == [True, False] * steps + [False] * 2
    assert [len(ms) for ms in planner.trial.ms] == [steps, steps]
    assert f"median of {steps}" in planner.explain()
    planner.close()


def test_a_slow_stretch_of_the_host_does_not_decide_a_trial(monkeypatch):
    """The host slows by 40 ms a step from the trial's sixth step on, so the reentrant form's
    median step (100 ms) is under the non-reentrant one's (137); but each non-reentrant step
    took 3 ms less than the reentrant step before it, but for the one where the slowdown began,
    and that form is kept: the median of those differences decides."""
    from storm import planner as planner_module

    forms, planner = timed_form_trial(monkeypatch,
                                      lambda k, reentrant: (100.0 if reentrant else 97.0) + 40.0 * (k >= 5))
    assert planner_module.TRIAL_STEPS == 5  # the slowdown's start, above, is placed for it
    assert planner.trial.median(0) < planner.trial.median(1)
    assert planner.trial.gain_ms == pytest.approx(3.0)
    assert forms[-2:] == [False, False] and not planner.plan.reentrant
    assert "the second 3.00 ms faster in the median of 5 pairs" in planner.explain()
    planner.close()


def test_no_form_trial_where_the_user_asked_for_the_non_reentrant_form():
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.05, mode="embedded", min_bytes=0, reentrant=False)
    for _ in range(3):
        grads_of(model, idx, planner.step())
    assert planner.plan.recomputed and not planner.plan.reentrant
    assert planner.settled and not planner.trials
    planner.close()


def test_no_trial_where_the_other_kind_does_not_fit():
    t = trace(fwd_ms=1.0, gbps=50.0)
    assert choose(t, 0, offload=False).fits is False  # nothing fits a budget of 0 without offloading
    assert choose(t, t.total_bytes, offload=True).offloaded > 0
    assert choose(t, t.total_bytes, offload=False).offloaded == 0
    t.store_bytes = 0  # the store took nothing: no plan offloads
    assert choose(t, t.total_bytes, offload=True) is None


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


@pytest.mark.parametrize("budget", [0.3, 0.02])
def test_a_hugging_face_llama_with_its_cache_on_trains_bit_exact(budget, caplog):
    """LlamaForCausalLM as a new user would plan it (use_cache on, its config's default): every
    parameter's gradient in every step, traced and planned, is that of no offload, bit for bit;
    recomputed layers run without the cache, with a warning. 0.02 recomputes every layer."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4)
    assert config.use_cache
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 128, (2, 16))

    def grads(m, ctx=None) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            loss = m(idx, labels=idx).loss
        loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    want = grads(ref)
    _warn_cache_off.cache_clear()  # warned once a process: maybe by an earlier test
    planner = storm.plan(model.model.layers, budget=budget, mode="embedded", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for step in range(5):
            got = grads(model, planner.step())
            differ = [n for (n, _), a, b in zip(model.named_parameters(), want, got) if not same_bits(a, b)]
            assert not differ, f"step {step} ({planner.explain()}): gradients differ in {differ}"
    if budget < 0.1:
        assert planner.plan.recomputed == frozenset(range(4))
    assert any("LlamaDecoderLayer is recomputed" in r.getMessage() for r in caplog.records)
    planner.close()
