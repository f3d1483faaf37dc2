"""The planner's phases, one object each: ``begin(planner)`` sets up a step and returns its
storm.offload context; ``end(planner)``, once the step has run, reads it and returns the phase of
the next step (itself, to run again). A phase holds what its step needs to be read (a tracer,
clock marks, a peak being measured); what outlives the step is the planner's TraceState.

    TraceOffload -> TraceCompute -> [TraceCompute without the hand-over: peak=, reentrant form]
        -> the plan (Planner.make_plan) -> Measure -> CheckHost -> Try -> Settled

each step of which is taken only where it has something to do (a plan that cannot fit is not
measured, one that offloads nothing has no host check, a trial needs an alternative); a step over
its target or with dearer packs makes the plan again, and a trial decided may start the form
trial. Steps unlike the traced one make the Planner trace again from a new TraceState.
The two traces' phases are in traced.py, the others here.
docs/planner.md tells what each phase measures and why.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import logging
from typing import Any, Protocol

from torch import nn

from ..hooks import Offload
from .measure import PeakMemory, StepPeak, checks_for, host_from_packs, widened_margin
from .model import Plan, full_codec
from .records import Trace
from .state import TraceState
from .trace import Frames, PlanStep
from .trial import Clock, Trial
from .wiring import BlockHooks

log = logging.getLogger("storm")

MiB = 1 << 20


class Phase(enum.Enum):
    """What the planner's next step does: each phase object's ``kind``."""

    TRACE_OFFLOAD = "trace-offload"            # everything offloaded, raw (trace.OffloadTrace)
    TRACE_COMPUTE = "trace-compute"            # every block recomputed, nothing offloaded (trace.ComputeTrace)
    TRACE_COMPUTE_KEPT = "trace-compute-kept"  # again without the hand-over: kept_extra (peak=, reentrant form)
    MEASURE = "measure"        # the plan, its peak measured against the target (CUDA): a margin where over
    MEASURE_NEAR = "measure-near"  # a cheaper plan predicted a little over it (Planner.near_plan), measured
    MEASURE_FULL = "measure-full"  # full offload, its peak measured once its room has settled (MeasureFull)
    CHECK_HOST = "check-host"  # the plan, offloading: its packs' host time is yet to be read
    TRY = "try"                # the plan or its alternative, in alternation (trial.Trial)
    SETTLED = "settled"        # the plan, that no step will measure or change until larger inputs come


class Driver(Protocol):
    """What the phases work with: driver.Planner's parts, this trace's state, and its planning
    (driver.py imports this module, not the other way round)."""

    hooks: BlockHooks
    memory: PeakMemory
    clock: Clock
    options: dict[str, Any]
    frames_of: Frames
    model: nn.Module | None
    reentrant: bool
    peak: int | None
    host_check_tolerance: float
    traced_again: bool  # a compute trace that paid first calls was repeated: once a planner
    state: TraceState

    @property
    def plan(self) -> Plan | None: ...

    @property
    def trace(self) -> Trace | None: ...

    @property
    def target(self) -> int | None: ...

    def make_plan(self) -> StepPhase: ...

    def apply(self, plan: Plan) -> None: ...

    def other_form(self, plan: Plan) -> Plan | None: ...

    def next_trial(self, plan: Plan) -> Plan | None: ...

    def step_peak(self, plan: Plan) -> int: ...

    def full_offload(self) -> Plan | None: ...

    def near_plan(self, measured: Plan, peak: int) -> Plan | None: ...


class StepPhase(abc.ABC):
    """A phase: what a step does, and what the step read decides next."""

    kind: Phase

    @abc.abstractmethod
    def begin(self, planner: Driver) -> Offload:
        """Set the step up; its storm.offload context."""

    def end(self, planner: Driver) -> StepPhase:
        """Read the step just begun (run or not); the next step's phase."""
        return self

    def abandon(self) -> None:  # noqa: B027 - most phases set nothing on the model to undo
        """The step begun was never entered (a batch skipped after step()): undo what begin() set
        on the model, since the next step begins this phase again."""


class Settled(StepPhase):
    """The plan, that no step measures, tries or changes until block 0's inputs grow (or change
    otherwise: driver.Planner._finish_last_step)."""

    kind = Phase.SETTLED

    def begin(self, planner: Driver) -> Offload:
        return plan_context(planner)


class Checked(StepPhase):
    """A step of the plan that is read: its packs' host time, where it is the planned step
    HOST_CHECK_STEP that offloads (TraceState.count_host_step): per raw tensor, or what a frame
    adds, dearer than the trace's (measure.host_from_packs), it becomes the trace's and the plan
    is made again; once per trace.
    ``alternative``: the plan to try against this one once its steps are read (Try)."""

    dearer = False  # the host check found dearer packs: kept while read() goes on with this phase

    def __init__(self, alternative: Plan | None):
        self.alternative = alternative

    def begin(self, planner: Driver) -> Offload:
        self.ctx = plan_context(planner)
        return self.ctx

    def end(self, planner: Driver) -> StepPhase:
        # counted as it ends: a step begun and never entered timed no pack. The host time first,
        # so that a plan made again from this step's peak is made once, with it. A step whose
        # reading goes on in the next (read() returns this phase) keeps what the check found: the
        # check runs once per trace, and the plan must still be made again with it
        self.dearer = bool(planner.state.count_host_step() and self.check_host(planner)) or self.dearer
        replanned = self.read(planner)
        if replanned is None and self.dearer:
            replanned = planner.make_plan()
        return replanned or after_checks(planner, self.alternative)

    def read(self, planner: Driver) -> StepPhase | None:
        """What else the step measured; the phase of a plan made again, or None."""
        return None

    def check_host(self, planner: Driver) -> bool:
        """The step's packs' host time against the trace's, per raw tensor and what a frame adds
        (measure.host_from_packs): each that is dearer becomes the trace's (True: the plan is to
        be made again with them)."""
        state, trace = planner.state, planner.state.trace
        assert trace is not None
        if state.stale:
            return False
        host, frame = host_from_packs(trace, self.ctx.stats, planner.host_check_tolerance)
        if host is not None:
            log.info("storm.plan: a planned step took %.0f us of host time per offloaded tensor against %.0f "
                     "traced; planning with it", host * 1e3, trace.host_ms_per_tensor * 1e3)
            state.traced_host_ms_per_tensor = trace.host_ms_per_tensor
            trace.host_ms_per_tensor = host
        if frame is not None:
            log.info("storm.plan: a planned step's frames took %.0f us more host time per tensor against %.0f "
                     "measured apart; planning with it", frame * 1e3, trace.frame_host_ms_per_tensor * 1e3)
            state.traced_frame_host_ms_per_tensor = trace.frame_host_ms_per_tensor
            trace.frame_host_ms_per_tensor = frame
        return host is not None or frame is not None


class CheckHost(Checked):
    """The plan, offloading, until its packs' host time has been read."""

    kind = Phase.CHECK_HOST


class Measure(Checked):
    """The first step of a plan not measured before, its peak measured against the target (CUDA)
    and kept (TraceState.measured: the plan ranks by it from then on). Over the target, where
    the plan was predicted to fit, what the step took beyond the prediction becomes the margin of
    plans of its kind (measure.widened_margin); either way the plan is made again, up to
    measure.checks_for steps, after which the plan of least measured peak stays. Within its
    target, with peak=, a cheaper plan predicted a little over it is measured next (``near``:
    Planner.near_plan), and the plan is made again from both measures."""

    def __init__(self, alternative: Plan | None, near: bool = False):
        super().__init__(alternative)
        self.near = near  # the plan measured is one predicted over its target (Planner.near_plan)
        self.kind = Phase.MEASURE_NEAR if near else Phase.MEASURE

    def begin(self, planner: Driver) -> Offload:
        ctx = super().begin(planner)
        self.peak = StepPeak(planner.memory, planner.hooks)
        return ctx

    unread = 0  # steps of this plan whose peak was not read (no backward reached the blocks)

    def read(self, planner: Driver) -> StepPhase | None:
        state = planner.state
        measured, target = self.peak.measured, planner.target
        if measured is None and target is not None and not state.stale and self.unread < UNREAD_STEPS:
            self.unread += 1  # a batch skipped after its forward: the next step is measured instead
            return self
        state.checks += 1
        state.measured_peak = measured
        plan = state.plan
        # None: no backward. A step unlike the traced one measured another step than planned
        if measured is None or target is None or state.stale:  # a plan predicted over it, unread, is not kept
            return planner.make_plan() if self.near and not state.stale else None
        assert plan is not None and state.besides is not None  # a target needs both
        over = measured - target
        state.plan = state.record(plan, over)  # the plan in force, as measured (the same steps: its hooks stay)
        if self.peak.moments is not None:
            state.measured_moments.setdefault(plan.shape, self.peak.moments)
        if over <= 0:
            near = planner.near_plan(plan, measured)
            if near is not None:
                log.info("storm.plan: a planned step peaked %.1f MiB under its target of %.1f MiB; measuring a "
                         "cheaper plan predicted %.1f MiB over it", -over / MiB, target / MiB,
                         (state.besides + planner.step_peak(near) - target) / MiB)
                planner.apply(near)
                return Measure(None, near=True)
            return planner.make_plan() if self.near else None
        # a near plan was predicted over (fits False): it searches no further and sets no margin
        if state.checks >= checks_for(plan.fits):
            full = measure_full(planner)
            if full is not None:
                return full
            kept = state.least_measured()
            assert kept is not None
            log.warning("storm.plan: a planned step peaked %.1f MiB over its target of %.1f MiB after %d "
                        "measured steps; keeping the plan of least measured peak, %.1f MiB over", over / MiB,
                        target / MiB, state.checks, max(0, kept.measured_over) / MiB)
            if kept.shape != plan.shape:
                planner.apply(kept)
                if self.alternative is not None and self.alternative.shape == plan.shape:
                    self.alternative = planner.other_form(kept)  # this plan's other form: the kept one's instead
            return None
        if plan.fits:  # predicted to: what the step took beyond its prediction: a margin for plans of its kind
            beyond = measured - state.besides - planner.step_peak(plan)
            state.margins[plan.offloads] = widened_margin(state.margins[plan.offloads], beyond, target)
        return planner.make_plan()


UNREAD_STEPS = 8  # a planned step to measure whose peak was not read: as many more are measured in its place
FULL_STEPS = 12  # a full offload's steps at most: its room's profile, a trial (rooms.MAX_TRIAL_STEPS), one kept


def measure_full(planner: Driver) -> StepPhase | None:
    """Where no plan fits and none is left to measure: the next full-offload plan put in force to
    be measured (MeasureFull); None where there is no target (off CUDA), with budget= or once
    each has run (Planner.full_offload)."""
    full = planner.full_offload() if planner.target is not None else None
    if full is None:
        return None
    log.info("storm.plan: no plan measured within its target of %.1f MiB in %d steps; measuring %s",
             (planner.target or 0) / MiB, planner.state.checks, full_offload_words(planner, full))
    planner.state.full_tried.add(full.shape)
    planner.apply(full)
    return MeasureFull()


def full_offload_words(planner: Driver, full: Plan) -> str:
    """A full-offload plan, as the log names it: which of model.full_offloads, and its codec."""
    codec = full_codec(planner.trace, planner.options.get("codec"), full.compressed) if planner.trace else None
    return "full offload" + " over every block recomputed" * bool(full.recomputed) + (f" ({codec})" if codec else "")


class MeasureFull(StepPhase):
    """A full-offload plan (model.full_offloads), where no plan of the blocks measured within
    its target. Its copy queue and prefetch window are paced by full offload's room, which a
    profiled step and a trial make and settle (rooms.py): its measure is the first step whose
    peak was read and that ran as the steps after it will (Offload.room_settled), within
    FULL_STEPS steps (else the last peak read, if any). Within its target it is kept; else the
    next one is measured, and after the last the plan of least measured peak stays, full
    offload among them: what a user who asked for less than any plan reaches gets is the least
    peak measured, whatever made it."""

    kind = Phase.MEASURE_FULL

    def __init__(self) -> None:
        self.steps = 0
        self.last: int | None = None  # the last step's peak that was read

    def begin(self, planner: Driver) -> Offload:
        self.peak = StepPeak(planner.memory, planner.hooks, each_block=False)  # its measure alone
        self.ctx = plan_context(planner)
        return self.ctx

    def end(self, planner: Driver) -> StepPhase:
        state, target = planner.state, planner.target
        if state.stale:
            return self  # the planner traces again
        self.steps += 1
        read = self.peak.measured
        self.last = read if read is not None else self.last
        if (read is None or not self.ctx.room_settled) and self.steps < FULL_STEPS:
            return self
        full = planner.plan
        assert full is not None
        if self.last is not None and target is not None:
            full = state.record(full, self.last - target)
            state.measured_peak = self.last
        if full.measured_over is None or full.measured_over > 0:
            following = measure_full(planner)
            if following is not None:
                return following
        kept = full if full.fits else state.least_measured()
        assert kept is not None  # the plans of the blocks measured before these
        planner.apply(kept)
        log.warning("storm.plan: %s peaked %s; keeping %s, %.1f MiB %s its target", full_offload_words(planner, full),
                    "unread" if self.last is None else f"{self.last / MiB:.1f} MiB",
                    "it" if kept is full else "the plan of least measured peak" + " (full offload)" * kept.full,
                    abs(kept.measured_over or 0) / MiB, "over" if (kept.measured_over or 0) > 0 else "under")
        return after_checks(planner, None)


class Try(StepPhase):
    """The plan and an alternative (of the other kind, offloading or not, or in the other
    recompute form) in alternation (trial.Trial), each step timed forward and backward on the
    compute stream (host-bound gaps included; CPU: the host clock), the alternative's first step
    measured against its target too; until the trial is decided."""

    kind = Phase.TRY

    def __init__(self, trial: Trial):
        self.trial = trial

    def begin(self, planner: Driver) -> Offload:
        plan = self.trial.next_plan()
        if plan is not planner.plan:
            planner.apply(plan)
        ctx = plan_context(planner)
        clock = planner.clock
        self.turn, self.marks = self.trial.turn, [clock.mark()]
        marks = self.marks
        planner.hooks.at_backward_end(lambda: marks.append(clock.mark()))
        # the alternative's steps until one has its peak read: a step without backward reads none
        measuring = plan is self.trial.plans[1] and not self.trial.alternative_read
        self.peak = StepPeak(planner.memory, planner.hooks, each_block=False) if measuring else None
        return ctx

    def end(self, planner: Driver) -> StepPhase:
        trial = self.trial
        state = planner.state
        # no backward, or a step unlike the traced one: untimed, so the same plan runs again and the
        # pairs compared (gain_ms) stay of steps run one after the other
        if len(self.marks) < 2 or state.stale:
            return self
        trial.turn += 1
        trial.ms[self.turn % 2].append(planner.clock.elapsed_ms(*self.marks))
        measured = self.peak.measured if self.peak is not None else None
        target = planner.target
        plan = trial.plans[1]  # the alternative: its first step whose peak was read is the one measured
        trial.alternative_read |= measured is not None
        if measured is not None and target is not None:
            trial.alternative_over = measured - target
            if plan.reentrant == planner.reentrant:
                state.record(plan, measured - target)  # in the form the planner measures: its plans rank by this too
        if measured is not None and target is not None and measured > target:
            trial.over = measured
            return self.decide(planner)
        return self.decide(planner) if trial.decided else self

    def decide(self, planner: Driver) -> StepPhase:
        """Keep the plan of the two whose steps took less, the alternative only if it was measured
        within its target (where there is one); the alternative so measured whatever the times
        where the plan measured over its own (the least measured kept where none fit); then the
        next budget's trial, or the form trial where it has not run yet (Planner.next_trial)."""
        trial = self.trial
        plan, alternative = trial.plans
        within = trial.over is None and (trial.alternative_read or planner.target is None)
        plan_over = plan.measured_over is not None and plan.measured_over > 0
        keep = alternative if within and (trial.gain_ms > 0 or plan_over) else plan
        over = trial.alternative_over if keep is alternative else None
        if over is not None:  # the alternative as its own step here measured it
            keep = dataclasses.replace(keep, fits=over <= 0, measured_over=over)
            trial.plans = (plan, keep)  # the trial's account of itself names the plan in force
        trial.kept = keep
        if keep is not planner.plan:
            planner.apply(keep)  # of another budget: its trace's state from here (Planner.apply)
        planner.state.trials.append(trial)
        if over is not None:
            target = planner.target_of(keep)
            if target is not None:
                planner.state.measured_peak = target + over
        log.info("storm.plan: %s", trial.describe())
        return after_checks(planner, planner.next_trial(keep))


def after_checks(planner: Driver, alternative: Plan | None) -> StepPhase:
    """What follows the plan in force once no step of it is to be measured: its packs' host time
    read where due, then its trial against ``alternative``, else settled."""
    if planner.state.host_check_due():
        return CheckHost(alternative)
    if alternative is not None:
        assert planner.plan is not None
        return Try(Trial((planner.plan, alternative)))
    return Settled()


def plan_context(planner: Driver) -> Offload:
    """The storm.offload context of a step of the plan in force: its offload budget, copy queue
    and prefetch window; where frames were weighed, the plan says which codec (a daemon's codec
    setting could frame a raw plan's tensors); a codec of the user's comes first, as choose() knew."""
    p, trace = planner.plan, planner.trace
    assert p is not None and trace is not None
    if p.full:  # storm.offload's own limits, which its room paces; frames as storm.enable(model) takes them
        full = full_codec(trace, planner.options.get("codec"), p.compressed)
        return Offload(**{**planner.options, **({"codec": full} if full else {})})
    framing = p.compressed or any(b.framed for b in trace.blocks)
    codec = {"codec": "auto" if p.compressed else "raw"} if framing else {}
    return PlanStep(**{"max_held_bytes": p.max_held_bytes, "prefetch_bytes": p.prefetch_bytes, **codec,
                       **planner.options}, budget=p.offload_budget)
