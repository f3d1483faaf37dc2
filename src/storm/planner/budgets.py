"""The blocks' own selective recompute as one of the plan's actions: STORM compiles each block
(inductor) and chooses its partitioner's ``activation_memory_budget`` together with the plan.

The planner's own recompute is a whole block's forward. torch's partitioner, at a budget b < 1,
recomputes inside the block instead: of what its min-cut saves, the cheapest to recompute by its
runtime (a knapsack), with the block's matrix products kept. On blocks compiled one by one that
frees gigabytes for a percent of the step, where recomputing whole blocks pays their forward in
full; no op-by-op rule in eager mode chooses as well (docs/planner.md, "Selective recompute").

How the budget is chosen, from measurements: from 1.0 (no selective recompute) down the ladder,
the planner traces the blocks compiled at each budget (the offload and compute traces, as any
trace) and makes the plan for it. A budget's cost is the blocks' forward and backward measured at
it by the compute trace, block by block (torch's recompute inside the blocks runs in their
backward), plus the plan's predicted cost over them. The descent stops at a budget whose plan
fits by the budget alone (nothing offloaded or recomputed: a lower budget only recomputes more)
or at the ladder's end. The budget of least cost whose plan fits (none fitting: the one whose plan
is predicted least over its target) is kept, with its trace; its costs are one step's times, so
each other budget whose plan fits and whose cost is within TRIAL_BAND of the least's is tried
against the plan kept in alternation (trial.Trial, the plans' own steps timed), cheapest first,
and the faster kept each time.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from .model import Plan
from .records import Trace
from .state import TraceState

LADDER = (0.9, 0.7, 0.5, 0.3, 0.1)  # the budgets tried below 1.0, in the order tried
# budgets whose traced cost is within this fraction of the least's are tried against its plan in
# alternation: one step's times each, they are as far apart as that from step to step and process to process
TRIAL_BAND = 0.15
# torch.compile's keyword arguments a compile_blocks dict may give (the function compiled is the block's forward)
COMPILE_KEYS = ("mode", "options", "dynamic", "fullgraph")


class Compiler(Protocol):
    """What compiles the blocks at a budget: a Planner's ``compiler`` (tests give a fake)."""

    def forwards(self, budget: float) -> list[Callable[..., Any]]:
        """Each block's forward compiled with its partitioner at ``budget`` (1.0: no selective
        recompute), made once per budget."""
        ...


class BlockCompiler:
    """Compiles each block's forward with inductor and ``storm.partitioner(memory_budget=b,
    budget=0)`` (torch's min-cut at that budget, nothing offloaded by the graph), one partitioner
    per budget shared by every block: torch.compile keeps a compiled graph for a backend equal to
    the one it was compiled for, so blocks of one class share a graph per budget, where a
    partitioner made per block would compile each block again, up to dynamo's recompile limit."""

    def __init__(self, blocks: Sequence[nn.Module], options: dict[str, Any]):
        from ..graph import partitioner  # ImportError where torch has no custom partitioners

        self._partitioner = partitioner
        self.blocks, self.options = list(blocks), options
        self._made: dict[float, list[Callable[..., Any]]] = {}

    def forwards(self, budget: float) -> list[Callable[..., Any]]:
        if budget not in self._made:
            inductor = {**self.options.get("options", {}),
                        "custom_partitioner_fn": self._partitioner(memory_budget=budget, budget=0)}
            kwargs = {**self.options, "options": inductor}
            self._made[budget] = [torch.compile(type(b).forward.__get__(b), backend="inductor", **kwargs)
                                  for b in self.blocks]
        return self._made[budget]


def compile_options(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    """``compile_blocks`` as given to storm.plan: None (False: the blocks run as they are), else the
    torch.compile keyword arguments each block's forward is compiled with."""
    if value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict) or any(k not in COMPILE_KEYS for k in value):
        raise ValueError(f"compile_blocks must be True, False or a dict of torch.compile's keyword arguments "
                         f"among {', '.join(COMPILE_KEYS)} (the backend is inductor, whose partitioner takes the "
                         f"budget); got {value!r}")
    if "custom_partitioner_fn" in (value.get("options") or {}):
        raise ValueError("compile_blocks' options give a custom_partitioner_fn: the planner compiles the blocks with "
                         "its own (storm.partitioner at the budget it chooses); leave it out")
    return {k: v for k, v in value.items() if not (k == "options" and v is None)}


def ladder_option(budgets: Sequence[float]) -> tuple[float, ...]:
    """``block_budgets`` as given: fractions in (0, 1), tried from the largest down."""
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1]
    if bad or isinstance(budgets, (str, bytes)):
        raise ValueError(f"block_budgets must be fractions in (0, 1) (torch's activation_memory_budget for the "
                         f"blocks' partitioner; 1.0, no selective recompute, is always tried), got {budgets!r}")
    return tuple(sorted(set(float(b) for b in budgets), reverse=True))


@dataclasses.dataclass
class Tried:
    """One budget, traced, and the plan made for it."""

    budget: float
    state: TraceState
    cost_ms: float  # the blocks' forward and backward at it, measured, plus the plan's predicted cost
    over: int       # the plan's predicted peak over what it is held to (<= 0: it fits)
    fits: bool

    @property
    def key(self) -> tuple:
        """Ranks budgets: a plan that fits first, then the least cost (the least over where none fits)."""
        return (0, self.cost_ms) if self.fits else (1, self.over, self.cost_ms)


def cost_of(trace: Trace, plan: Plan) -> float | None:
    """The step's blocks at this trace's budget under ``plan``: their forward and backward as the
    compute trace measured them, each block's median times the blocks (one step's times: a block
    whose step the host or the allocator slowed counts as its like blocks), plus the plan's predicted
    cost; None where the blocks' backward was not measured one by one."""
    if not all(b.backward_ms for b in trace.blocks):
        return None
    n = len(trace.blocks)
    return n * (statistics.median(b.forward_ms for b in trace.blocks)
                + statistics.median(b.backward_ms for b in trace.blocks)) + plan.predicted_cost_ms


class BudgetSearch:
    """The descent over ``ladder`` (module docstring): ``read`` each budget's plan as it is made;
    it says which budget to trace next, or None once the one to keep is known (``best``)."""

    def __init__(self, ladder: Sequence[float]):
        self.ladder = (1.0, *ladder)
        self.tried: list[Tried] = []
        self.done = False
        # once done: the budgets whose plans fit and whose traced cost is within TRIAL_BAND of the
        # least's, cheapest first, each to be tried in alternation against the plan kept (trial.Trial)
        self.contenders: list[Tried] = []
        self.unweighed = False  # the first budget's blocks were not timed one by one: none weighed (cost_of)

    @property
    def best(self) -> Tried:
        """The budget to keep, of those tried (Tried.key)."""
        return min(self.tried, key=lambda t: t.key)

    def next_contender(self) -> Tried | None:
        """The next budget to try against the plan kept (``contenders``), taken off them; None once none is left."""
        return self.contenders.pop(0) if self.contenders else None

    def state_of(self, budget: float) -> TraceState:
        """What the trace at ``budget`` taught and decided."""
        return next(t.state for t in self.tried if t.budget == budget)

    def read(self, state: TraceState, plan: Plan, held_to: int) -> float | None:
        """The plan made at the budget traced now, held to ``held_to`` bytes: the next budget to
        trace, or None (``done``) where the descent ends here."""
        assert state.trace is not None and not self.done
        budget = self.ladder[len(self.tried)]
        cost = cost_of(state.trace, plan)
        if cost is None:  # nothing to weigh this budget by: the descent ends with the budgets weighed before
            if not self.tried:  # none: the blocks stay at 1.0
                self.tried.append(Tried(budget, state, 0.0, plan.predicted_peak - held_to, plan.fits))
                self.unweighed = True
            self._end()
            return None
        self.tried.append(Tried(budget, state, cost, plan.predicted_peak - held_to, plan.fits))
        alone = plan.fits and not plan.recomputed and not plan.offloads
        if alone or len(self.tried) == len(self.ladder):
            self._end()
            return None
        return self.ladder[len(self.tried)]

    def _end(self) -> None:
        self.done = True
        best = self.best
        self.contenders = sorted((t for t in self.tried if t is not best and t.fits and t.state.plan is not None
                                  and not t.state.plan.full and t.cost_ms <= (1 + TRIAL_BAND) * best.cost_ms),
                                 key=lambda t: t.key) if best.fits else []
