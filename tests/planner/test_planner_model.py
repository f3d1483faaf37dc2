"""The cost model as pure functions of a Trace: choose(), predicted_peak(), moments() and
Offloading.of() on small made-up traces, no model run."""

from __future__ import annotations

import dataclasses

import pytest

from planner_fakes import MiB, framed, shared_inputs, trace
from storm.planner import BlockTrace, Offloading, Scenario, Trace, choose, kept_bytes, moments, predicted_peak
from storm.planner.model import _plans


def test_a_budget_above_the_step_changes_nothing():
    t = trace()
    p = choose(Scenario(t, t.total_bytes))
    assert (p.offloaded, p.recomputed, p.offload_budget, p.predicted_cost_ms, p.fits) == (0, frozenset(), 0, 0.0, True)
    assert p.predicted_peak == t.total_bytes


def test_a_slow_link_recomputes_instead_of_offloading():
    t = trace(gbps=0.5)  # 100 MiB takes ~210 ms each way; recomputing a block costs 1 ms
    budget = t.total_bytes - 350 * MiB
    p = choose(Scenario(t, budget))
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
        p = choose(Scenario(t, budget, grads=True, kept_extra=extra))
        assert p.fits and p.offloaded == 0
        for j in p.recomputed:
            assert predicted_peak(t, 0, p.recomputed - {j}, 0, kept_extra=extra) > budget, \
                (budget, sorted(p.recomputed), j)
        first = next(k for k in range(n + 1) if predicted_peak(t, 0, set(range(k)), 0, kept_extra=extra) <= budget)
        assert len(p.recomputed) <= first, (budget, sorted(p.recomputed), first)


def test_only_a_kept_blocks_backward_holds_the_kept_extra():
    t = trace(n=4, gbps=0.5)  # a slow link: plans recompute
    every, extra = set(range(4)), 5 * MiB

    def added(offloaded: int, recomputed: set[int]) -> list[int]:  # per block's backward, then backward's start
        return [a - b for a, b in zip(moments(t, offloaded, recomputed, 0, grads=True, kept_extra=extra),
                                      moments(t, offloaded, recomputed, 0, grads=True))]

    assert added(0, set()) == [extra] * 4 + [0]
    assert added(0, {1, 2}) == [extra, 0, 0, extra, 0]
    assert added(0, every) == [0] * 5  # handed over
    assert added(2, {3}) == [0, 0, extra, 0, 0]  # fetched ones are handed over too
    # a budget that recomputing blocks 0-2 meets exactly, but not with block 3's kept extra:
    # recomputing block 3 too removes it there
    budget = predicted_peak(t, 0, {0, 1, 2}, 0)
    assert choose(Scenario(t, budget)).recomputed == {0, 1, 2}
    assert predicted_peak(t, 0, {0, 1, 2}, 0, kept_extra=extra) > budget
    assert choose(Scenario(t, budget, kept_extra=extra)).recomputed == every


def test_the_cheapest_blocks_per_byte_are_recomputed_first():
    t = trace(gbps=0.5)
    t.blocks[5].forward_ms = 0.1
    t.blocks[2].forward_ms = 0.2
    assert choose(Scenario(t, t.total_bytes - 20 * MiB)).recomputed == frozenset({5})
    assert choose(Scenario(t, t.total_bytes - 150 * MiB)).recomputed == frozenset({5, 2})


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
    p = choose(Scenario(t, budget, grads=True))
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
        p = choose(Scenario(t, budget, grads=True))
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
    p = choose(Scenario(t, budget))
    assert p.fits and p.recomputed == frozenset() and p.offloaded == 3
    assert p.offload_budget == t.offloaded_before[3]  # storm.offload(budget=) stops at block 3's first save
    assert p.predicted_cost_ms == 0.0
    # the link drains everything during forward, so nothing offloaded is left at the peak, and
    # backward frees kept blocks before it needs the offloaded ones: no prefetch window either
    assert p.predicted_peak == t.total_bytes - t.before_bytes - 300 * MiB and p.prefetch_bytes == 0
    assert p.max_held_bytes == 100 * MiB  # a block's copy takes 2 ms of the next block's 20: no stall


def test_a_busy_link_costs_a_stall_or_memory():
    t = trace(fwd_ms=1.0, gbps=50.0)  # 100 MiB per 1 ms block against 2 ms to copy it
    slow = Offloading.of(t, 8, 100 * MiB)[0]
    fast = Offloading.of(t, 8, None)[-1]
    assert fast.held == slow.sent == fast.sent == t.total_bytes - t.after_bytes  # the loss's saves: none early
    assert slow.cost_ms > 5 and slow.leftover <= 100 * MiB  # forward waits for the link
    assert fast.leftover > 300 * MiB  # forward does not wait; the bytes stay on the device meanwhile
    nothing = choose(Scenario(t, 10**12, held_bytes=64 * MiB, prefetch_bytes=32 * MiB))
    assert nothing.offloaded == 0 and nothing.predicted_peak == t.total_bytes  # no window counted: nothing to fetch
    p = choose(Scenario(t, 300 * MiB, held_bytes=64 * MiB, prefetch_bytes=32 * MiB))
    assert (p.max_held_bytes, p.prefetch_bytes) == (64 * MiB, 32 * MiB)  # the user's options are kept


def test_host_time_per_tensor_counts_when_the_compute_stream_does_not_hide_it():
    t = trace(fwd_ms=20.0, gbps=50.0, host_ms=50.0, tensors=5)  # 250 ms per offloaded block: recompute wins
    p = choose(Scenario(t, t.total_bytes - 250 * MiB))
    assert p.offloaded == 0 and p.recomputed
    # the GPU ends forward far behind the host, but the host is not ahead while it launches the
    # first blocks (as at a step's start): their packs (half of each tensor's time) still cost
    t.forward_device_ms = t.forward_host_ms + 10_000
    t.lead_ms = [0.0] * (len(t.blocks) + 1)
    p = choose(Scenario(t, t.total_bytes - 250 * MiB))
    assert p.offloaded == 0 and p.recomputed
    assert Offloading.of(t, 3, None)[0].host_ms == pytest.approx(3 * 5 * 50.0 / 2)  # the packs; unpacks hidden
    t.lead_ms = [0.0] + [10_000.0] * len(t.blocks)  # far ahead from block 1 on: host time is free
    p = choose(Scenario(t, t.total_bytes - 250 * MiB))
    assert p.offloaded == 3 and not p.recomputed


def test_an_unreachable_budget_gets_the_least_peak_plan_and_says_so():
    t = trace()
    p = choose(Scenario(t, 0))
    assert not p.fits
    every = set(range(len(t.blocks)))
    assert p.predicted_peak <= predicted_peak(t, 0, every, 0)  # no worse than recomputing all
    assert p.predicted_peak <= min(o.leftover for o in Offloading.of(t, len(t.blocks), None)) + 100 * MiB


def test_a_link_bound_step_offloads_compressed():
    # 100 MiB per 1 ms block over 50 GB/s, host time hidden by the GPU: the link decides. Every
    # block is called with 60 MiB that another block is called with too: a recomputed block keeps
    # them, its inputs offloaded or not, so plans must offload saves
    t = shared_inputs(framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1), each_its_own=True)
    t.forward_device_ms = t.forward_host_ms + 50
    t.lead_ms = [0.0] + [50.0] * len(t.blocks)
    budget = 300 * MiB
    p, raw = choose(Scenario(t, budget)), choose(Scenario(t, budget, codec="raw"))
    assert p.compressed and p.fits and p.offloaded > 0
    assert raw.fits and raw.offloaded > 0 and not raw.compressed
    assert p.predicted_cost_ms < raw.predicted_cost_ms
    assert choose(Scenario(t, budget, codec="ancf_exp")) == p  # the user's frame codec: the same choice, made alone
    off_raw, off_compressed = (Offloading.of(t, p.offloaded, p.max_held_bytes, c)[0] for c in (False, True))
    assert off_compressed.link_ms < off_raw.link_ms
    # the peak counts one block's frames beside what is in flight
    assert off_compressed.frames == t.blocks[0].frame_bytes and off_raw.frames == 0
    assert p.in_flight_bytes >= off_compressed.frames


def test_the_codecs_device_time_can_make_raw_the_cheaper():
    # the link-bound step above, with a codec whose kernels take 30 ms per GiB framed (encode and
    # decode): they share the GPU with the step's, so they count in full
    t = shared_inputs(framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1), each_its_own=True)
    t.forward_device_ms = t.forward_host_ms + 50
    t.lead_ms = [0.0] + [50.0] * len(t.blocks)
    budget = 300 * MiB
    assert choose(Scenario(t, budget, inputs_offloaded=False)).compressed
    t.frame_device_ms_per_GiB = 30.0
    p = choose(Scenario(t, budget, inputs_offloaded=False))
    forced = choose(Scenario(t, budget, codec="ancf_exp", inputs_offloaded=False))
    assert p.fits and p.offloaded > 0 and not p.compressed
    assert forced.compressed and forced.predicted_cost_ms > p.predicted_cost_ms
    off = Offloading.of(t, forced.offloaded, forced.max_held_bytes, True)[0]
    assert off.codec_ms == pytest.approx(forced.offloaded * 100 / 1024 * 30.0)
    assert off.cost_ms == pytest.approx(off.host_ms + off.link_ms + off.codec_ms)
    assert Offloading.of(t, forced.offloaded, forced.max_held_bytes, False)[0].codec_ms == 0.0


def test_a_host_bound_step_offloads_raw():
    # 200 tensors a block, frames that save 1 MiB of its 100 and cost 150 us each, nothing hidden
    # (the blocks' inputs shared, as above, and no plan offloads them: plans must offload saves)
    t = shared_inputs(framed(trace(inputs=60 * MiB, host_ms=0.02, tensors=200), per_block=200, frame_ms=0.15,
                             saved_by_frames=MiB), each_its_own=True)
    budget = 300 * MiB
    p = choose(Scenario(t, budget, inputs_offloaded=False))
    assert p.fits and p.offloaded > 0 and not p.compressed
    # the user's frame codec is respected, at its cost
    forced = choose(Scenario(t, budget, codec="ancf_exp", inputs_offloaded=False))
    assert forced.compressed and forced.predicted_cost_ms > p.predicted_cost_ms
    off_raw, off_compressed = (Offloading.of(t, forced.offloaded, forced.max_held_bytes, c)[0] for c in (False, True))
    assert off_compressed.host_ms - off_raw.host_ms == pytest.approx(forced.offloaded * 200 * 0.15)


@pytest.mark.parametrize("codec", [None, "ancf_exp", "auto"])
def test_nothing_frameable_is_never_compressed(codec):
    t = trace(inputs=60 * MiB, gbps=1.0)  # a slow link: frames would pay, if anything could be framed
    t.frame_host_ms_per_tensor = 0.0
    for budget in (0, 150 * MiB, 300 * MiB, 600 * MiB, t.total_bytes):
        p = choose(Scenario(t, budget, codec=codec))
        assert not p.compressed and p == choose(Scenario(t, budget, codec="raw"))


def test_a_margin_holds_plans_that_offload_to_less():
    t = trace(fwd_ms=20.0, gbps=50.0)  # the link is free: offloading 3 blocks is the plan
    budget = t.total_bytes - 250 * MiB
    assert choose(Scenario(t, budget)).offloaded == 3
    p = choose(Scenario(t, budget, offload_margin=150 * MiB))  # offloading plans were measured 150 MiB over
    assert p.fits and (p.offloaded == 0 or p.predicted_peak + 150 * MiB <= budget)
    assert p.offloaded == 0 or p.offloaded > 3  # the 3-block plan no longer fits
    assert choose(Scenario(t, budget, offload_margin=10**12)).offloaded == 0  # recomputing is not held to it


def test_no_trial_where_the_other_kind_does_not_fit():
    t = trace(fwd_ms=1.0, gbps=50.0)
    assert choose(Scenario(t, 0, offload=False)).fits is False  # nothing fits a budget of 0 without offloading
    assert choose(Scenario(t, t.total_bytes, offload=True)).offloaded > 0
    assert choose(Scenario(t, t.total_bytes, offload=False)).offloaded == 0
    t.store_bytes = 0  # the store took nothing: no plan offloads
    assert choose(Scenario(t, t.total_bytes, offload=True)) is None


def test_a_block_recomputed_with_its_inputs_offloaded_keeps_nothing_until_its_backward():
    """Blocks 0-1 recomputed with their inputs offloaded: each keeps nothing from forward to its
    backward, where it holds its rebuilt saves and its fetched inputs; the saves before the blocks
    go too. Recomputed (checkpointing), they keep their inputs and the saves before them stay."""
    t = trace(n=4, saved=100 * MiB, inputs=10 * MiB)
    checkpointing = moments(t, 0, {0, 1}, 0, grads=False)
    offloaded = moments(t, 0, {0, 1}, 0, grads=False, inputs_offloaded=2)
    assert checkpointing == [MiB + 100 * MiB, MiB + 10 * MiB + 100 * MiB, MiB + 20 * MiB + 100 * MiB,
                             MiB + 20 * MiB + 200 * MiB, MiB + 20 * MiB + 200 * MiB + 2 * MiB]
    assert offloaded == [110 * MiB, 110 * MiB, 100 * MiB, 200 * MiB, 200 * MiB + 2 * MiB]
    # inputs other blocks are called with too stay, and are not fetched: one storage for all
    # blocks is kept once, from block 0's backward (the last to use it) back to backward's start
    shared_inputs(t)
    assert moments(t, 0, {0, 1}, 0, grads=False, inputs_offloaded=2) == [110 * MiB, 110 * MiB, 110 * MiB,
                                                                    210 * MiB, 212 * MiB]
    assert kept_bytes(t, 0, {0, 1}, inputs_offloaded=2) == [10 * MiB, 0, 100 * MiB, 100 * MiB]
    # a storage of each block's own, listed as shared but used by that block alone: blocks 0-1's are
    # offloaded once (shared_staying, as the step does) and fetched for their backward, as inputs are
    shared_inputs(t, each_its_own=True)
    assert moments(t, 0, {0, 1}, 0, grads=False, inputs_offloaded=2) == [110 * MiB, 110 * MiB, 100 * MiB,
                                                                    200 * MiB, 202 * MiB]
    assert kept_bytes(t, 0, {0, 1}, inputs_offloaded=2) == [0, 0, 100 * MiB, 100 * MiB]


def test_where_the_last_blocks_inputs_are_offloaded_the_early_saves_after_the_blocks_go_too():
    """The saves after the blocks (after_bytes) that come before the largest of them (a language
    model's final norm, before the log-softmax of its logits that the loss's backward takes at
    once) leave the device once no block keeps anything, its saves or its inputs offloaded:
    backward's start no longer holds them, the link carries them, and the step offloads all it
    saves up to there (budget None, which wiring.py limits after the last block). One block short
    of that, they stay."""
    t = trace(n=4, saved=100 * MiB, inputs=10 * MiB)
    t.after_bytes, t.after_early_bytes = 50 * MiB, 20 * MiB
    every = moments(t, 0, set(range(4)), 0, grads=False, inputs_offloaded=4)
    but_last = moments(t, 0, set(range(4)), 0, grads=False, inputs_offloaded=3)
    assert every[-1] == 30 * MiB and but_last[-1] == 10 * MiB + 50 * MiB
    assert moments(t, 1, set(range(1, 4)), 0, grads=False, inputs_offloaded=3)[-1] == 30 * MiB
    assert moments(t, 4, set(), 0, grads=False)[-1] == 30 * MiB
    assert Offloading.of(t, 0, None, m=4)[-1].sent == MiB + 4 * 10 * MiB + 20 * MiB
    assert Offloading.of(t, 0, None, m=3)[-1].sent == MiB + 3 * 10 * MiB
    assert Offloading.of(t, 4, None)[-1].sent == MiB + 4 * 100 * MiB + 20 * MiB
    for m, budget in ((4, None), (3, t.offloaded_before[0] + 3 * 10 * MiB)):
        assert {p.offload_budget for p, _ in _plans(Scenario(t, t.total_bytes, codec="raw"), 0, m)} == {budget}


@pytest.mark.parametrize("early", [0, MiB])
def test_the_prefetch_window_counts_at_each_blocks_backward_and_not_at_backwards_start(early):
    """Prefetch waits for backward's first unpack of an offloaded save, and backward's start
    peaks before it, also where the head's early saves were offloaded (every block offloaded, or
    recomputed with its inputs offloaded, and such saves there). The zoo measured that: its rows of
    such plans peaked at backward's start one window under the model that counted it there."""
    t = trace(n=4, saved=100 * MiB, inputs=10 * MiB)
    t.after_early_bytes = early
    window = 30 * MiB
    for k, m in ((0, 4), (2, 0), (1, 2), (4, 0), (1, 3)):
        plain = moments(t, k, set(range(k, k + m)), 0, grads=False, inputs_offloaded=m)
        fetching = moments(t, k, set(range(k, k + m)), window, grads=False, inputs_offloaded=m, prefetch=window)
        assert fetching[:-1] == [h + window for h in plain[:-1]]
        assert fetching[-1] == plain[-1], (k, m)


def test_offloading_inputs_costs_their_link_bytes_and_host_time():
    t = trace(n=4, saved=100 * MiB, inputs=10 * MiB, gbps=0.01, host_ms=2.0)  # a link too slow to hide anything
    for b in t.blocks:
        b.input_tensors = 3
    off = Offloading.of(t, 1, None, m=2)[-1]
    assert off.sent == MiB + 100 * MiB + 2 * 10 * MiB
    assert off.host_ms == pytest.approx((5 + 2 * 3) * 2.0)  # nothing hides it: no lead, no slack
    assert off.link_ms == pytest.approx(Offloading.of(t, 1, None)[-1].link_ms * off.sent / (101 * MiB), rel=0.01)


def test_below_checkpointings_peak_the_plan_recomputes_blocks_with_their_inputs_offloaded():
    """Below what recomputing every block keeps, the three other options fit only by offloading
    most saves over a slow link; recomputing with the inputs offloaded moves a third of the bytes
    per block and fits for less."""
    t = trace(n=8, saved=100 * MiB, inputs=30 * MiB, gbps=1.0)
    budget = predicted_peak(t, 0, set(range(8)), 0, grads=False) - 60 * MiB
    old, p = choose(Scenario(t, budget, inputs_offloaded=False)), choose(Scenario(t, budget))
    assert old.fits and not old.inputs_offloaded and old.offloaded > 0
    assert p.fits and p.inputs_offloaded > 0 and p.predicted_peak <= budget
    assert p.predicted_cost_ms < old.predicted_cost_ms
    assert set(range(p.offloaded, p.offloaded + p.inputs_offloaded)) <= p.recomputed
    assert p.predicted_peak == predicted_peak(t, p.offloaded, p.recomputed, p.in_flight_bytes, grads=False,
                                              inputs_offloaded=p.inputs_offloaded)
    # the step offloads the saves before block k + m: the inputs' bytes on top of block k's start
    assert p.offload_budget == t.offloaded_before[p.offloaded] + p.inputs_offloaded * 30 * MiB


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8, 1.0])
def test_inputs_are_never_offloaded_where_a_plan_of_the_other_options_is_as_cheap(fraction):
    """At budgets that checkpointing meets, the plan is the three options' whenever one of theirs
    costs no more; a plan with inputs offloaded only where it costs strictly less."""
    for gbps in (0.5, 5.0, 50.0):
        t = trace(n=8, saved=100 * MiB, inputs=30 * MiB, gbps=gbps, host_ms=0.05)
        budget = int(fraction * t.total_bytes)
        old, p = choose(Scenario(t, budget, inputs_offloaded=False)), choose(Scenario(t, budget))
        assert old.fits and p.fits
        assert p == old or (p.inputs_offloaded and p.predicted_cost_ms < old.predicted_cost_ms)


def test_a_measured_plan_fits_and_ranks_by_its_measure_not_its_prediction():
    t = trace()
    s = Scenario(t, 400 * MiB)
    cheapest = choose(s)
    assert cheapest.fits and cheapest.measured_over is None
    # measured over its target: the next cheapest that fits instead
    other = choose(dataclasses.replace(s, measured={cheapest.shape: 1}))
    assert other.fits and other.shape != cheapest.shape
    # where none is predicted to fit, the lowest predicted, measured under its target, fits
    tight = dataclasses.replace(s, budget=MiB)
    lowest = choose(tight)
    assert not lowest.fits
    measured = choose(dataclasses.replace(tight, measured={lowest.shape: -1}))
    assert measured.shape == lowest.shape and measured.fits and measured.measured_over == -1
    # and measured far over, another plan is the least peak
    assert choose(dataclasses.replace(tight, measured={lowest.shape: 1 << 40})).shape != lowest.shape


def test_recomputing_blocks_that_share_an_input_fits_where_a_set_of_them_does():
    """Four blocks of 100 MiB saves, each called with 10 MiB of its own and one 50 MiB storage
    they all share: recomputing blocks 0-2 peaks at 180 MiB, so a budget of 220 MiB fits without
    offloading. Keeping a block that shares an input adds its saves less its own inputs to the
    later moments, not less what it shares, which another block keeps."""
    blocks = [BlockTrace(100 * MiB, 10, 60 * MiB, 1.0, input_tensors=1, shared_inputs={0: 50 * MiB})
              for _ in range(4)]
    t = Trace(blocks, lead_ms=[0.0] * 5, d2h_GBps=50, h2d_GBps=50, forward_host_ms=1, forward_device_ms=1)
    assert predicted_peak(t, 0, {0, 1, 2}, 0, grads=False) == 180 * MiB
    p = choose(Scenario(t, 220 * MiB, offload=False, grads=False))
    assert p.fits and p.predicted_peak <= 220 * MiB and p.offloaded == 0


def test_a_blocks_backward_extra_counts_at_its_own_moment_with_peak_and_not_in_a_budget_of_saves():
    t = trace()
    heavier = dataclasses.replace(t, blocks=[dataclasses.replace(b, backward_extra=5 * MiB * (i == 1))
                                             for i, b in enumerate(t.blocks)])
    for grads in (True, False):
        before, after = (moments(x, 1, {2}, 0, grads=grads) for x in (t, heavier))
        assert [a - b for a, b in zip(after, before)] == [5 * MiB * (i == 1 and grads) for i in range(len(before))]
