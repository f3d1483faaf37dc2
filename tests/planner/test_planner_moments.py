"""The planner's step peaks read moment by moment (measure.StepPeak): at backward's start and at
each block's backward, so that a plan's prediction can be held to its measure where it misses."""

from __future__ import annotations

import copy

import pytest
import torch
from test_planner_measure import scripted_planner

import storm
from planner_fakes import MiB, ScriptedMemory, gpt, grads_of
from storm.planner import moments
from storm.planner.measure import StepPeak
from storm.planner.wiring import BlockHooks


class Counting:
    """A PeakMemory whose reads are 1, 2, 3, ... MiB in turn: which read went to which moment."""

    available = True

    def __init__(self) -> None:
        self.reads = 0

    def start(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def peak(self) -> int:
        self.reads += 1
        return self.reads * MiB


@pytest.mark.parametrize("recomputed", [set(), {1, 2}], ids=["kept", "two recomputed"])
def test_a_steps_peak_is_read_at_each_blocks_backward_last_block_first(recomputed):
    model, idx = gpt()
    hooks = BlockHooks(list(model.blocks), reentrant=True)
    hooks.recompute(recomputed)  # rebuilt in backward, their forwards run again: no moment of theirs
    memory = Counting()
    peak = StepPeak(memory, hooks)
    grads_of(model, idx)
    n = len(model.blocks)
    # forward and the head's backward first; then each block's backward, from the last to the first
    assert memory.reads == n + 1
    assert peak.moments == [(n + 1 - i) * MiB for i in range(n)] + [MiB]
    assert peak.parts == (MiB, (n + 1) * MiB) and peak.measured == (n + 1) * MiB
    hooks.close()


def test_a_step_whose_peak_alone_is_wanted_is_read_twice_as_before_and_has_no_moments():
    model, idx = gpt()
    hooks = BlockHooks(list(model.blocks), reentrant=True)
    memory = Counting()
    peak = StepPeak(memory, hooks, each_block=False)  # a trial's timed step: no read at every block
    grads_of(model, idx)
    assert memory.reads == 2 and peak.parts == (MiB, 2 * MiB) and peak.measured == 2 * MiB
    assert peak.moments is None
    hooks.close()


def test_blocks_listed_otherwise_than_they_run_split_the_step_where_backward_reaches_the_last_listed():
    model, idx = gpt()
    hooks = BlockHooks(list(model.blocks)[::-1], reentrant=True)  # the last listed runs first, its backward last
    memory = Counting()
    peak = StepPeak(memory, hooks)
    grads_of(model, idx)
    n = len(model.blocks)
    # backward's start runs on until the last listed block: no moment for the blocks reached before it
    assert memory.reads == 2 and peak.parts == (MiB, 2 * MiB)
    assert peak.moments == [None] * (n - 1) + [2 * MiB, MiB]
    hooks.close()


def test_a_step_of_two_forwards_has_its_parts_and_no_moments():
    model, idx = gpt()
    hooks = BlockHooks(list(model.blocks), reentrant=True)
    memory = Counting()
    peak = StepPeak(memory, hooks)
    model.zero_grad(set_to_none=True)
    (model.loss(idx[:, :-1], idx[:, 1:]) + model.loss(idx[:, 1:], idx[:, :-1])).backward()
    n = len(model.blocks)
    # the second forward's backward runs first and reaches each block once; the first's goes to block 0's
    assert peak.parts == (MiB, (n + 1) * MiB) and peak.moments is None
    hooks.close()


class OneBlockHoldsMore(ScriptedMemory):
    """Block ``block``'s backward holds ``more`` than the model predicts; every other moment as predicted."""

    def __init__(self, block: int, more: int) -> None:
        super().__init__(extra=0)
        self.block, self.more = block, more

    def peak(self) -> int:
        return super().peak() + self.more * (self.at == self.block and self.planner.plan is not None)


def test_a_plans_moments_show_where_its_prediction_missed():
    memory = OneBlockHoldsMore(block=1, more=64 * MiB)
    model, idx, planner, _ = scripted_planner(memory, peak="1GiB")  # the plan fits: it stays in force
    for _ in range(5):  # the traces (the second compute trace: peak=), the plan's measured step, its host check
        grads_of(model, idx, planner.step())
    assert planner.settled
    at = planner.peak_moments()
    assert at is not None and len(at) == len(model.blocks) + 1
    assert [measured - predicted for predicted, measured in at] == [64 * MiB * (i == 1) for i in range(len(at))]
    traced = planner.traced_moments()  # the compute trace's: the besides came from its largest moment
    assert traced is not None and max(m for _, m in traced) == max(p for p, _ in traced)
    text = planner.explain()
    assert "measured to peak at block 1's backward" in text, text
    planner.close()


class OneBlockHoldsLess(ScriptedMemory):
    """Block ``block``'s backward holds ``less`` than the others' besides, in every step (as T5's
    blocks other than each list's first hold less than it)."""

    def __init__(self, block: int, less: int) -> None:
        super().__init__(extra=0)
        self.block, self.less = block, less

    def peak(self) -> int:
        return super().peak() - self.less * (self.at == self.block)


def test_a_block_whose_backward_held_less_in_the_compute_trace_is_predicted_so_in_every_plan():
    memory = OneBlockHoldsLess(block=1, less=30 * MiB)
    model, idx, planner, _ = scripted_planner(memory, peak="1GiB")
    for _ in range(5):
        grads_of(model, idx, planner.step())
    assert planner.settled
    assert [b.backward_extra for b in planner.trace.blocks] == [-30 * MiB * (i == 1) for i in range(len(model.blocks))]
    at = planner.peak_moments()  # the plan's, offloading two blocks: every moment as measured
    assert at is not None and all(predicted == measured for predicted, measured in at), at
    traced = planner.traced_moments()  # the compute trace's, predicted with one figure of besides: 30 MiB high at 1
    assert traced is not None and [p - m for p, m in traced] == [30 * MiB * (i == 1) for i in range(len(traced))]
    assert "(-30.0 to +0.0 MiB by block, as each block's backward measured)" in planner.explain()
    planner.close()


@pytest.mark.gpu
def test_on_cuda_the_moments_are_read_block_by_block_and_the_compute_trace_predicts_each_as_measured():
    """On CUDA, with peak= at half of no offload's: the compute trace's moments are read one by one
    and each block's backward_extra makes every moment of that step predicted as measured; the
    plan's first measured step reads a moment at every block and backward's start, the largest
    its measured peak; every step's gradients are those without STORM."""
    from storm.examples.models import GPT

    torch.manual_seed(0)
    model = GPT(seq_len=256, d_model=256, n_heads=4, n_layers=8).cuda()
    idx = torch.randint(0, 256, (8, 257), device="cuda")
    reference = copy.deepcopy(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads_of(reference, idx)
    peak = (torch.cuda.max_memory_allocated() - base) // 2
    handle = storm.enable(model, peak=peak, mode="embedded", min_bytes=1 << 16, pool_size="1GiB")
    planner = handle.planner
    try:
        for step in range(40):
            assert all(torch.equal(g, w) for g, w in zip(grads_of(model, idx), grads_of(reference, idx))), step
        assert planner.settled, handle.explain()
        traced, every = planner.traced_moments(), set(range(len(model.blocks)))
        assert traced is not None and all(m is not None for _, m in traced), traced
        with_extras = moments(planner.trace, 0, every, 0, grads=True, start_extra=planner.start_extra)
        assert [planner.besides + h for h in with_extras] == [m for _, m in traced], handle.explain()
        shape = next(iter(planner.state.measured_moments))  # the first plan measured
        plan = planner.state.measured[shape]
        at = planner.peak_moments(plan)
        assert at is not None and all(m is not None for _, m in at), at
        assert max(m for _, m in at) == planner.target + plan.measured_over, handle.explain()
    finally:
        handle.disable()
