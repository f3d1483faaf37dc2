"""What the planner knows and has decided since it began its last trace: the trace, what a step
holds besides its saves, the plan, the margins its measured steps left, the host check's count,
the trials decided. One object, so that tracing again (block 0's inputs grew) starts from a
new one rather than resetting each field, and what a later phase adds (say, per-plan measured
peaks) is forgotten with the rest. ``Readings``: the Planner's properties that read it.
"""

from __future__ import annotations

import dataclasses

from .measure import HOST_CHECK_STEP
from .model import Plan
from .records import Trace
from .trial import Trial


@dataclasses.dataclass
class TraceState:
    """One trace's course, from its offload trace until it no longer holds (``stale``)."""

    trace: Trace | None = None  # the offload trace's, filled in by the compute trace; None until traced
    # block 0's inputs' shapes and dtypes in each forward of the offload trace (wiring.input_signature);
    # before it, those of the step that made the last trace stale, which the offload trace is no smaller than
    signature: tuple = ()
    plan: Plan | None = None    # the plan in force (in a trial, the last step's); None until planned
    # what a step holds besides its saves (activations' gradients, temporaries) at a recomputed or
    # offloaded block's backward, measured on CUDA in the compute trace; None before it (or off CUDA)
    besides: int | None = None
    start_extra: int = 0  # and what backward's start holds beyond that (start_extra in held.moments)
    kept_besides: int | None = None  # the same where each block's saves stay to their nodes' ends
    # measured peak beyond predicted, for plans that (do not) offload
    margins: dict[bool, int] = dataclasses.field(default_factory=lambda: {False: 0, True: 0})
    checks: int = 0                    # planned steps measured against their target
    measured_peak: int | None = None   # the last measured planned step's peak above its start
    offloading_steps: int = 0          # planned steps that offloaded, counted towards the host check
    traced_host_ms_per_tensor: float | None = None  # the trace's, where a planned step measured more
    traced_frame_host_ms_per_tensor: float | None = None  # likewise, what a frame adds
    trials: list[Trial] = dataclasses.field(default_factory=list)  # decided, in order
    # per Plan.shape, the plan measured (in the planner's recompute form), its step's peak over its
    # target in its measured_over, in the order measured
    measured: dict[tuple, Plan] = dataclasses.field(default_factory=dict)
    # per Plan.shape measured, its first measured step's peak at each moment (measure.StepPeak.moments);
    # and the compute trace's: where the cost model's prediction missed, moment by moment
    measured_moments: dict[tuple, list[int | None]] = dataclasses.field(default_factory=dict)
    traced_moments: list[int | None] | None = None
    full_tried: set[tuple] = dataclasses.field(default_factory=set)  # Plan.shape of full offloads run, read or not
    stale: bool = False  # the last step ran unlike the traced one: the next step traces again
    outgrown: tuple = ()  # where block 0's larger inputs made it stale, those: the next trace's signature
    smaller_steps: int = 0  # steps of smaller inputs than traced, which no phase but the settled plan's read
    smaller_run: int = 0  # of them, those since the last step read (driver.SMALLER_RUN)

    @property
    def kept_extra(self) -> int:
        """What a kept block's backward holds beyond a recomputed one's (Planner.kept_extra)."""
        if self.besides is None or self.kept_besides is None:
            return 0
        return max(0, self.kept_besides - self.besides)

    def record(self, plan: Plan, over: int) -> Plan:
        """A step of ``plan`` went ``over`` bytes over its target (negative: under): the plan as
        measured, which fits and ranks by that from now on. A plan measured before keeps its first
        measure (a trial's alternative may be one)."""
        return self.measured.setdefault(plan.shape, dataclasses.replace(plan, fits=over <= 0, measured_over=over))

    def least_measured(self) -> Plan | None:
        """Of the plans measured, the one whose step went least over its target (the first
        measured on ties); None before any."""
        return min(self.measured.values(), key=lambda p: p.measured_over, default=None)

    def kept_full(self) -> Plan | None:
        """Of the full-offload plans measured within their target, the one of least predicted cost
        (model.full_offloads: choose() never weighs them, so the plans of the blocks it picks
        cannot stand for them); None where none is."""
        fitting = [p for p in self.measured.values() if p.full and p.fits]
        return min(fitting, key=lambda p: p.predicted_cost_ms, default=None)

    def host_check_due(self) -> bool:
        """A planned step that offloads is yet to have its packs' host time read (phases.Checked);
        not after a trial, whose step times decided."""
        return (self.plan is not None and self.plan.offloads and self.traced_host_ms_per_tensor is None
                and self.offloading_steps < HOST_CHECK_STEP and not self.trials)

    def count_host_step(self) -> bool:
        """A planned step has run: where the host check is due, it counts towards it. Whether it is
        the step to read (the HOST_CHECK_STEP-th: the first warms up)."""
        if not self.host_check_due():
            return False
        self.offloading_steps += 1
        return self.offloading_steps == HOST_CHECK_STEP


class Readings:
    """What the Planner's TraceState (``state``) holds, read as the Planner's own: explain(), the
    phases and the benchmarks read these of the trace in force."""

    state: TraceState

    @property
    def trace(self) -> Trace | None:
        """The traced steps' Trace; None until the offload trace has been read (again, after
        block 0's inputs grew)."""
        return self.state.trace

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        self.state.trace = trace

    @property
    def plan(self) -> Plan | None:
        """The plan in force (in a trial, the last step's); None until planned."""
        return self.state.plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self.state.plan = plan

    @property
    def besides(self) -> int | None:
        """What a step holds besides its saves (activations' gradients, temporaries) at a
        recomputed or offloaded block's backward, measured on CUDA in the compute trace; None
        before it."""
        return self.state.besides

    @property
    def start_extra(self) -> int:
        """What backward's start holds beyond the besides (start_extra in held.moments)."""
        return self.state.start_extra

    @property
    def kept_extra(self) -> int:
        """What a kept block's backward holds beyond a recomputed one's: autograd keeps a kept
        block's saves until each node that saved them ends, beside the node's temporaries (a bias
        gradient's reduction buffer, say), where Recompute hands them over and they go as the node
        takes them. Measured with peak= in the reentrant form (the second compute trace, without
        the hand-over); else 0."""
        return self.state.kept_extra

    @property
    def margins(self) -> dict[bool, int]:
        """Bytes that plans which offload (True) or not (False) leave below the budget, from measured steps."""
        return dict(self.state.margins)

    @property
    def checks(self) -> int:
        """Planned steps measured since the last trace."""
        return self.state.checks

    @property
    def measured_peak(self) -> int | None:
        """The last measured planned step's peak above its start, since the last trace."""
        return self.state.measured_peak

    @property
    def traced_host_ms_per_tensor(self) -> float | None:
        """The trace's host time per offloaded tensor, where a planned step measured more."""
        return self.state.traced_host_ms_per_tensor

    @property
    def traced_frame_host_ms_per_tensor(self) -> float | None:
        """The trace's host time a frame adds to a tensor's, where a planned step measured more."""
        return self.state.traced_frame_host_ms_per_tensor

    @property
    def measured_plans(self) -> int:
        """Plans whose step was measured against its target since the last trace."""
        return len(self.state.measured)

    @property
    def smaller_steps(self) -> int:
        """Steps since the last trace began whose block 0 took smaller inputs than the traced step's,
        or that left a block out (wiring.Inputs): each ran as the step before it did, and only the
        settled plan's were read."""
        return self.state.smaller_steps

    @property
    def trials(self) -> list[Trial]:
        """This trace's trials, decided, in order."""
        return self.state.trials

    @property
    def trial(self) -> Trial | None:
        """The last trial decided since the last trace."""
        return self.trials[-1] if self.trials else None
