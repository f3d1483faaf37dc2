"""storm.plan compiling the blocks itself (``compile_blocks``) and choosing their partitioner's
activation_memory_budget with the plan (storm/planner/budgets.py). The decisions are tested with a
fake compiler whose budgets below 1 recompute each block's MLP inside it (a reentrant checkpoint:
fewer saves, the same bits) and whose blocks move a FakeClock by the times a test gives; one test
compiles with inductor for real."""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import storm
from planner_fakes import FakeClock, grads_of, trace
from storm.examples.models import GPT, same_bits
from storm.planner import Plan
from storm.planner.budgets import BudgetSearch, Tried, compile_options, cost_of, ladder_option

FORWARD_MS, BACKWARD_MS = 1.0, 2.0  # each block's, at every budget; a budget below 1 adds its inner recompute


class Tick(torch.autograd.Function):
    """Moves ``clock`` by ``forward_ms`` in forward and ``backward_ms`` in backward: a block's times."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: FakeClock, forward_ms: float, backward_ms: float) -> torch.Tensor:
        clock.now += forward_ms / 1e3
        ctx.clock, ctx.backward_ms = clock, backward_ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.clock.now += ctx.backward_ms / 1e3
        return grad, None, None, None


class FakeCompiler:
    """budgets.Compiler for the GPT's blocks: at a budget below 1 each block recomputes its MLP
    inside (saving its input alone), which costs ``inner_ms`` more of its backward; ``as_if``: every
    budget compiles as that one."""

    def __init__(self, blocks: nn.ModuleList, clock: FakeClock, inner_ms: float, as_if: float | None = None):
        self.blocks, self.clock, self.inner_ms, self.as_if = blocks, clock, inner_ms, as_if
        self.used: list[float] = []  # the budgets asked for, in order, each time it changed

    def forwards(self, budget: float) -> list[Callable[..., Any]]:
        if not self.used or self.used[-1] != budget:
            self.used.append(budget)
        budget = budget if self.as_if is None else self.as_if

        def forward_of(block: nn.Module) -> Callable[..., Any]:
            def forward(x: torch.Tensor) -> torch.Tensor:
                x = Tick.apply(x, self.clock, FORWARD_MS, BACKWARD_MS + (self.inner_ms if budget < 1 else 0.0))
                if budget >= 1:
                    return type(block).forward(block, x)
                x = x + block.attn(block.ln1(x))
                return x + checkpoint(lambda y: block.mlp(block.ln2(y)), x, use_reentrant=True)
            return forward
        return [forward_of(b) for b in self.blocks]


def gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(seq_len=64, d_model=64, n_heads=4, n_layers=6, dropout=0.0), torch.randint(0, 256, (8, 65))


def traced_bytes(budget: float) -> int:
    """What a step of the GPT saves with its blocks compiled at ``budget``, as the planner traced it."""
    model, idx = gpt()
    clock = FakeClock()
    planner = storm.Planner(model.blocks, budget=1 << 40, mode="embedded", min_bytes=0, clock=clock,
                            compiler=FakeCompiler(model.blocks, clock, 0.0, as_if=budget), block_budgets=())
    for _ in range(2):
        grads_of(model, idx, planner.step())
    assert planner.trace is not None
    return planner.trace.total_bytes


def between() -> int:
    """A budget of saves that the blocks fit with their MLPs recomputed inside, and not without."""
    kept, inner = traced_bytes(1.0), traced_bytes(0.5)
    assert inner < kept
    return (inner + kept) // 2


def run_planner(inner_ms: float, budgets: tuple[float, ...] = (0.5,), steps: int = 40, fraction: bool = False
                ) -> tuple[storm.Planner, FakeCompiler]:
    """The planner over the GPT at ``between()`` (``fraction``: given as that fraction of a step's saves
    at 1.0), every step's gradients checked bit for bit."""
    budget: int | float = between()
    if fraction:
        budget = budget / traced_bytes(1.0)
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    clock = FakeClock()
    compiler = FakeCompiler(model.blocks, clock, inner_ms)
    planner = storm.Planner(model.blocks, budget=budget, mode="embedded", min_bytes=0, clock=clock,
                            compiler=compiler, block_budgets=budgets)
    for step in range(steps):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
    return planner, compiler


@pytest.mark.parametrize("fraction", [False, True], ids=["bytes", "fraction"])
def test_a_cheap_recompute_inside_the_blocks_is_kept_over_recomputing_whole_blocks(fraction):
    """A budget given as a fraction is of what a step saves at 1.0, whatever budget is traced: of the
    saves at 0.5, it would hold the plan there to less and recompute whole blocks too."""
    planner, _ = run_planner(inner_ms=0.1, fraction=fraction)
    assert planner.settled and planner.block_budget == 0.5
    assert planner.plan is not None and not planner.plan.recomputed and not planner.plan.offloads
    assert planner.search is not None and [t.budget for t in planner.search.tried] == [1.0, 0.5]
    assert planner.trials[0].plans[1].block_budget == 1.0  # traced within TRIAL_BAND: tried in alternation
    at_one = planner.search.tried[0]
    # what 0.5 was weighed against: whole blocks recomputed
    assert at_one.fits and at_one.state.plan is not None and at_one.state.plan.recomputed
    assert "activation_memory_budget 0.5" in planner.explain()
    # each block's backward, its recompute left out, as the compute trace timed it block by block
    assert planner.trace is not None
    assert [b.backward_ms for b in planner.trace.blocks] == pytest.approx([BACKWARD_MS + 0.1] * 6)


def test_a_dear_recompute_inside_the_blocks_loses_to_recomputing_whole_blocks():
    """Each block's inner recompute costs 5 ms, a whole block's forward 1 ms: the plan at 1.0 is kept,
    from the trace made at 1.0 (the blocks compiled at it again); 0.5's traced cost is beyond
    TRIAL_BAND of 1.0's, so no step of it is tried."""
    planner, compiler = run_planner(inner_ms=5.0)
    assert planner.settled and planner.block_budget == 1.0
    assert planner.plan is not None and planner.plan.recomputed
    assert compiler.used == [1.0, 0.5, 1.0]
    assert planner.search is not None and planner.trace is planner.search.tried[0].state.trace
    assert all(t.plans[0].block_budget == t.plans[1].block_budget for t in planner.trials)


def test_a_budget_whose_traced_cost_is_near_is_tried_in_alternation_and_the_faster_kept():
    """0.5's inner recompute costs 0.5 ms a block: 21 ms traced against 1.0's 20, within TRIAL_BAND:
    tried, and 1.0's plan kept by its steps' times."""
    planner, compiler = run_planner(inner_ms=0.5)
    assert planner.settled and planner.block_budget == 1.0
    trial = planner.trials[0]
    assert [p.block_budget for p in trial.plans] == [1.0, 0.5] and trial.kept is trial.plans[0]
    assert "at budget 0.5" in trial.describe() and "at budget 0.5" in planner.explain()
    assert compiler.used[-1] == 1.0


def test_the_budgets_tried_in_alternation_are_those_near_the_least_cheapest_first():
    search = BudgetSearch((0.9, 0.5, 0.1))
    costs = {1.0: 3.0, 0.9: 2.0, 0.5: 2.5, 0.1: 2.25}  # each block's backward; forward 1 ms, 8 blocks
    recomputes = Plan(offloaded=0, recomputed=frozenset({0}), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                      predicted_peak=0, predicted_cost_ms=0.0, fits=True)
    following: float | None = 1.0
    while following is not None:
        t = trace(n=8, fwd_ms=1.0)
        for b in t.blocks:
            b.backward_ms = costs[following]
        state = storm.planner.state.TraceState(trace=t, plan=recomputes)
        following = search.read(state, recomputes, held_to=1)
    # traced 32, 24, 28, 26 ms: 0.9 kept, then 0.1 (26 <= 1.15 * 24) and 0.5 (28 > 27.6 is not)
    assert search.best.budget == 0.9
    assert [t.budget for t in search.contenders] == [0.1]
    assert search.next_contender().budget == 0.1 and search.next_contender() is None  # type: ignore[union-attr]


def test_the_descent_stops_at_the_first_budget_whose_plan_fits_by_itself():
    planner, compiler = run_planner(inner_ms=0.1, budgets=(0.3, 0.7, 0.5))
    assert planner.settled and planner.block_budget == 0.7
    assert planner.search is not None and [t.budget for t in planner.search.tried] == [1.0, 0.7]


def test_larger_inputs_make_the_planner_descend_again():
    budget = between()
    model, idx = gpt()
    clock = FakeClock()
    compiler = FakeCompiler(model.blocks, clock, 0.1)
    planner = storm.Planner(model.blocks, budget=budget, mode="embedded", min_bytes=0, clock=clock,
                            compiler=compiler, block_budgets=(0.5,))
    for _ in range(40):
        grads_of(model, idx, planner.step())
    assert planner.settled and planner.block_budget == 0.5
    first = planner.search
    larger = torch.randint(0, 256, (12, 65))
    for _ in range(40):
        grads_of(model, larger, planner.step())
    assert planner.replans == 1 and planner.search is not first
    assert planner.search is not None and [t.budget for t in planner.search.tried] == [1.0, 0.5]
    assert planner.settled and planner.block_budget == 0.5  # the larger step's saves fit at 0.5 as well


def test_close_gives_the_blocks_their_own_forward_back():
    planner, _ = run_planner(inner_ms=0.1, steps=4)
    planner.close()
    assert all("forward" not in vars(b) for b in planner.blocks)


def test_a_budgets_cost_counts_each_block_as_its_like_blocks():
    """One step's times: a block the host or the allocator slowed in that step counts as the median."""
    t = trace(n=4, fwd_ms=1.0)
    for b, ms in zip(t.blocks, (2.0, 2.0, 2.0, 40.0)):
        b.backward_ms = ms
    plan = Plan(offloaded=0, recomputed=frozenset(), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                predicted_peak=0, predicted_cost_ms=0.5, fits=True)
    assert cost_of(t, plan) == pytest.approx(4 * (1.0 + 2.0) + 0.5)
    t.blocks[0].backward_ms = 0.0  # not measured
    assert cost_of(t, plan) is None


def test_a_budget_whose_blocks_were_not_timed_one_by_one_is_not_weighed():
    """Where the compute trace has no block's backward (a step of several forwards), a budget's
    cost is unknown: not zero. The descent ends with the budgets weighed before it, and where the
    first is unweighed the blocks stay at 1.0 and explain() says why."""
    recomputes = Plan(offloaded=0, recomputed=frozenset({0}), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                      predicted_peak=0, predicted_cost_ms=0.0, fits=True)

    def state(timed: bool) -> storm.planner.state.TraceState:
        t = trace(n=4, fwd_ms=1.0)
        for b in t.blocks:
            b.backward_ms = 2.0 if timed else 0.0
        return storm.planner.state.TraceState(trace=t, plan=recomputes)

    search = BudgetSearch((0.5, 0.1))
    assert search.read(state(True), recomputes, held_to=1) == 0.5
    assert search.read(state(False), recomputes, held_to=1) is None
    assert search.done and [t.budget for t in search.tried] == [1.0] and search.best.budget == 1.0
    assert not search.unweighed
    search = BudgetSearch((0.5, 0.1))
    assert search.read(state(False), recomputes, held_to=1) is None
    assert search.unweighed and search.best.budget == 1.0


def test_steps_of_two_forwards_keep_the_blocks_at_one_and_explain_says_why():
    model, idx = gpt()
    clock = FakeClock()
    planner = storm.Planner(model.blocks, budget=2 * between(), mode="embedded", min_bytes=0, clock=clock,
                            compiler=FakeCompiler(model.blocks, clock, 0.1), block_budgets=(0.5,))
    for _ in range(12):
        model.zero_grad(set_to_none=True)
        with planner.step():
            loss = model(idx[:, :-1]).float().mean() + model(idx[:, 1:]).float().mean()
        loss.backward()
    assert planner.search is not None and planner.search.unweighed and planner.block_budget == 1.0
    assert "no budget below 1 weighed" in planner.explain()


def test_the_descent_puts_no_budgets_plan_in_force_but_the_one_kept(caplog):
    """Each budget's plan is weighed, not put in force: where nothing fits, the warning that no plan
    does comes once, for the budget kept, not once per budget traced."""
    model, idx = gpt()
    clock = FakeClock()
    planner = storm.Planner(model.blocks, budget=2, mode="embedded", min_bytes=0, clock=clock,
                            compiler=FakeCompiler(model.blocks, clock, 0.1), block_budgets=(0.7, 0.5))
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(7):
            grads_of(model, idx, planner.step())
    assert planner.search is not None and [t.budget for t in planner.search.tried] == [1.0, 0.7, 0.5]
    assert sum("no plan keeps" in r.getMessage() for r in caplog.records) == 1


def test_budgets_are_ranked_by_fitting_then_cost_then_how_far_over():
    search = BudgetSearch((0.5, 0.1))
    state = storm.planner.state.TraceState()
    search.tried = [Tried(1.0, state, 10.0, 100, False), Tried(0.5, state, 30.0, -1, True),
                    Tried(0.1, state, 20.0, -5, True)]
    assert search.best.budget == 0.1
    search.tried = [Tried(1.0, state, 10.0, 100, False), Tried(0.5, state, 30.0, 50, False)]
    assert search.best.budget == 0.5


@pytest.mark.parametrize("value, named", [
    ({"backend": "eager"}, "mode, options, dynamic, fullgraph"),
    ({"options": {"custom_partitioner_fn": object()}}, "custom_partitioner_fn"),
    ("yes", "True, False or a dict"),
])
def test_compile_blocks_refuses_what_it_cannot_compile_with(value, named):
    with pytest.raises(ValueError, match=named):
        compile_options(value)


@pytest.mark.parametrize("value", [(1.0,), (0.0,), (True,), "0.5", (0.5, -0.1)])
def test_block_budgets_are_fractions_below_one(value):
    with pytest.raises(ValueError, match=r"fractions in \(0, 1\)"):
        ladder_option(value)


def test_block_budgets_are_tried_from_the_largest_down():
    assert ladder_option([0.1, 0.5, 0.5, 0.3]) == (0.5, 0.3, 0.1)


def test_compile_blocks_is_refused_for_blocks_compiled_already():
    model, _ = gpt()
    model.blocks[0].compile()
    with pytest.raises(ValueError, match="compiled already"):
        storm.Planner(model.blocks, budget=0.5, compile_blocks=True)


def test_enable_without_a_plan_refuses_the_planners_compile_options():
    model, _ = gpt()
    with pytest.raises(TypeError, match="compile_blocks= is for a plan"):
        storm.enable(model, compile_blocks=True)
    with pytest.raises(ValueError, match="compile_blocks must be"):
        storm.enabled.check_options(budget=0.5, compile_blocks={"backend": "eager"})


class TickingClock(FakeClock):
    """Each mark a millisecond after the last: every block's forward and backward read alike at
    every budget, so that what a plan adds decides."""

    def mark(self) -> float:
        self.now += 1e-3
        return self.now


@pytest.mark.slow  # inductor compiles the blocks at two budgets
def test_blocks_compiled_by_the_planner_with_inductor_keep_the_budget_that_fits_bit_exact():
    """The real compiler: at 0.5 inductor's partitioner recomputes inside the blocks and they save
    less; the planner keeps 0.5, whose plan needs nothing more, and every step's gradients equal
    those of the same blocks compiled at 0.5 by storm.partitioner without the planner, bit for bit;
    no step compiles once the plan is settled."""
    torch._dynamo.reset()
    model, idx = gpt()
    ref_model = copy.deepcopy(model)
    at_half = storm.partitioner(memory_budget=0.5, budget=0)
    for i, b in enumerate(ref_model.blocks):
        ref_model.blocks[i] = torch.compile(b, options={"custom_partitioner_fn": at_half})
    ref = grads_of(ref_model, idx)
    probe_model = copy.deepcopy(model)
    probe = storm.Planner(probe_model.blocks, budget=2, mode="embedded", min_bytes=0, clock=TickingClock(),
                          compile_blocks=True, block_budgets=(0.5,))
    for _ in range(6):  # nothing fits: both budgets traced (the first offload trace twice: first calls)
        grads_of(probe_model, idx, probe.step())
    assert probe.search is not None and [t.budget for t in probe.search.tried] == [1.0, 0.5]
    kept, inner = (t.state.trace.total_bytes for t in probe.search.tried)  # type: ignore[union-attr]
    assert inner < kept
    probe.close()

    planner = storm.plan(model.blocks, budget=(kept + inner) // 2, mode="embedded", min_bytes=0,
                         clock=TickingClock(), compile_blocks=True, block_budgets=(0.5,))
    graphs = []
    for step in range(30):  # two budgets traced, then tried against each other in alternation
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
        graphs.append(counters["stats"]["unique_graphs"])
    assert planner.settled and planner.block_budget == 0.5
    assert graphs[-1] == graphs[-4]


@pytest.mark.gpu
def test_blocks_compiled_by_the_planner_on_cuda_settle_within_peak_bit_exact():
    """On CUDA with peak=: the planner traces both budgets, settles, and every step's gradients
    equal those of the same blocks compiled at the budget that step ran (storm.partitioner without
    the planner) bit for bit; the settled steps peak within the target."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(seq_len=256, d_model=256, n_heads=4, n_layers=8, dropout=0.0).cuda()  # test_gpu.py's planner model
    idx = torch.randint(0, 256, (8, 257), device="cuda")

    def grads(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        m.loss(idx[:, :-1], idx[:, 1:]).backward()
        return [p.grad.clone() for p in m.parameters()]

    refs, no_offload_peak = {}, 0
    for budget in (1.0, 0.5):
        ref_model = copy.deepcopy(model)
        at = storm.partitioner(memory_budget=budget, budget=0)
        for i, b in enumerate(ref_model.blocks):
            ref_model.blocks[i] = torch.compile(b, options={"custom_partitioner_fn": at})
        grads(ref_model)  # compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        refs[budget] = grads(ref_model)
        no_offload_peak = max(no_offload_peak, torch.cuda.max_memory_allocated() - base)
        del ref_model
    planner = storm.plan(model.blocks, peak=int(0.6 * no_offload_peak), mode="embedded", min_bytes=0,
                         pool_size="512MiB", compile_blocks=True, block_budgets=(0.5,))
    peaks = []
    for step in range(60):
        settled = planner.settled
        ctx = planner.step()
        budget = planner.block_budget
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx:
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        peak = torch.cuda.max_memory_allocated() - base  # before the gradients' copies below
        got = [p.grad.clone() for p in model.parameters()]
        assert all(same_bits(a, b) for a, b in zip(refs[budget], got)), f"step {step} at {budget}"
        if settled:
            peaks.append(peak)
        if len(peaks) >= 3:
            break
    assert planner.search is not None and [t.budget for t in planner.search.tried] == [1.0, 0.5], planner.explain()
    assert peaks and max(peaks) <= 1.02 * planner.target, (peaks, planner.explain())
    planner.close()
