"""Timed A/B trials: two plans run in alternation and the faster is kept, because the cost
model's costs are approximate (offloading's host time most); and the ``Clock`` they, and the
traced steps, are timed by. docs/planner.md ("Trials") explains the rule.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from .model import Plan

MiB = 1 << 20
# Steps of each of the two plans tried in alternation. A lent GPU's host has bursts that slow a
# few steps in a row, enough to reverse a three-step comparison of plans a few percent apart; so
# five steps each, compared by the median of the differences of steps run one after the other,
# which a slow stretch of the host moves less than it moves either plan's own median
TRIAL_STEPS = 5
# plans closer than this fraction are within a step's noise: then up to TRIAL_MAX_STEPS each decide
TRIAL_CLOSE = 0.02
TRIAL_MAX_STEPS = 9


class Clock:
    """Where storm.plan's timings come from: marks on the compute stream (CUDA events) or the
    host clock (CPU), and the host clock. A Planner takes another (``clock=``) so that tests
    decide its trials by the timings they give, never by how fast a loaded machine ran."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @property
    def first_calls_load(self) -> bool:
        """Whether a block's first call may take far longer than its next ones: a GPU loads kernels
        then, and a compute trace that paid that is repeated. On the host clock a loaded machine's
        noise would look the same, and there is nothing to load."""
        return self.cuda

    def host(self) -> float:
        """The host's time, in seconds."""
        return time.perf_counter()

    def mark(self) -> Any:
        if not self.cuda:
            return self.host()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


@dataclasses.dataclass
class Trial:
    """The plan chosen and an alternative (the best fitting plan of the other kind, offloading or
    not, or the same plan in the other recompute form), tried in alternation: step times per
    plan, and which was kept."""

    plans: tuple[Plan, Plan]
    ms: tuple[list[float], list[float]] = dataclasses.field(default_factory=lambda: ([], []))
    turn: int = 0
    over: int | None = None  # the alternative's measured peak, where it went over its target
    alternative_over: int | None = None  # bytes the alternative's step read here went over (under) its target
    alternative_read: bool = False  # a step of the alternative had its peak read (its first with a backward)
    kept: Plan | None = None

    def next_plan(self) -> Plan:
        return self.plans[self.turn % 2]

    def median(self, i: int) -> float:
        return statistics.median(self.ms[i]) if self.ms[i] else float("inf")

    @property
    def gain_ms(self) -> float:
        """How much less the alternative's step took than the chosen plan's step before it, in
        the median over such pairs."""
        return statistics.median(a - b for a, b in zip(*self.ms)) if all(self.ms) else 0.0

    @property
    def decided(self) -> bool:
        """Both plans have TRIAL_STEPS steps and differ by more than TRIAL_CLOSE of the chosen
        plan's median step, or both have TRIAL_MAX_STEPS."""
        steps = min(map(len, self.ms))
        if steps < TRIAL_STEPS:
            return False
        return abs(self.gain_ms) > TRIAL_CLOSE * self.median(0) or steps >= TRIAL_MAX_STEPS

    @property
    def forms(self) -> bool:
        """Whether this trial is of the two recompute forms (else of plans that offload or not)."""
        return self.plans[0].reentrant != self.plans[1].reentrant

    def describe(self) -> str:
        """The trial in words: while it runs, what is tried; once decided, the two plans' median
        steps and which was kept, faster by how much in the median of the pairs of steps run one
        after the other (what decides, where the medians may say otherwise)."""
        names = ([_form_name(p) for p in self.plans] if self.forms else [plan_name(p) for p in self.plans])
        if self.plans[0].block_budget != self.plans[1].block_budget:  # a trial of two budgets (planner/budgets.py)
            names = [f"{n} at budget {p.block_budget:g}" for n, p in zip(names, self.plans)]
        what = f"{names[0]} against {names[1]}" + (f" to {plan_name(self.plans[0])}" if self.forms else "")
        if self.over is not None:
            return (f"tried {what}: {names[1]} peaked at {self.over / MiB:.1f} MiB in its first step, over its "
                    f"target; kept {names[0]}")
        n = min(map(len, self.ms))
        if self.kept is None:
            run = sum(map(len, self.ms))
            return (f"trying {what} in alternation, {TRIAL_STEPS} steps each (up to {TRIAL_MAX_STEPS} while they "
                    f"are close), forward and backward timed, the faster to be kept ({run} step{'s' * (run != 1)} "
                    f"timed so far)")
        tried = (f"tried {what} in alternation, {n} steps each, forward and backward timed: median step "
                 f"{_ms(self.median(0))} against {_ms(self.median(1))} ms")
        over = self.plans[0].measured_over
        if self.kept is self.plans[1] and over is not None and over > 0:  # phases.Try.decide: kept whatever the times
            return (f"{tried}; kept {names[1]}: {names[0]} measured {over / MiB:.1f} MiB over its target, "
                    f"{names[1]} within its own")
        if self.gain_ms == 0:
            return f"{tried}; kept {names[0]}: neither was faster in the median of the {n} pairs of steps"
        kept = self.plans.index(self.kept)
        gain = self.gain_ms if kept else -self.gain_ms  # how much less the kept plan's steps took
        text = (f"{tried}; kept {names[kept]}, {_ms(abs(gain))} ms a step {'faster' if gain > 0 else 'slower'} "
                f"in the median of the {n} pairs of steps run one after the other")
        if self.median(kept) > self.median(1 - kept):
            text += (" (its median step is the longer: the pairs decide, which a slow stretch of the host moves "
                     "less)")
        return text


def _form_name(p: Plan) -> str:
    return "the reentrant form" if p.reentrant else "torch's non-reentrant checkpoint"


def _ms(ms: float) -> str:
    """A step's time: to 0.1 ms, finer below 1 ms."""
    return f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def plan_name(p: Plan) -> str:
    """A plan in a few words: "offload 2 and recompute 3 blocks", "recompute 4 blocks (2 with
    their inputs offloaded)", "keep every block"."""
    parts = ([f"offload {p.offloaded}"] if p.offloaded else []) + ([f"recompute {len(p.recomputed)}"]
                                                                    if p.recomputed else [])
    form = "" if p.reentrant or not p.recomputed else " non-reentrant"
    form += f" ({p.inputs_offloaded} with their inputs offloaded)" if p.inputs_offloaded else ""
    return " and ".join(parts) + " blocks" + form if parts else "keep every block"
