"""The planner's traced steps as phases (phases.py tells how phases work): the offload trace
(TraceOffload) and the compute traces (TraceCompute), which fill the TraceState's trace and the
besides the plans are measured by, then make the plan. What each step records is trace.py's.
"""

from __future__ import annotations

from ..hooks import Offload
from .held import moments, without_backward_extras
from .measure import StepPeak
from .phases import Driver, Phase, StepPhase
from .records import Trace
from .trace import ComputeTrace, OffloadTrace


class TraceOffload(StepPhase):
    """Everything offloaded, raw: what each block saves (trace.OffloadTrace). Again where the
    step did not run every block once per forward."""

    kind = Phase.TRACE_OFFLOAD

    def begin(self, planner: Driver) -> Offload:
        self.tracer = OffloadTrace(planner.hooks, planner.options, planner.frames_of, planner.model)
        return self.tracer.ctx

    def end(self, planner: Driver) -> StepPhase:
        trace = self.tracer.collect()
        if trace is None:
            return self
        planner.state.trace, planner.state.signature = trace, tuple(planner.hooks.inputs)
        return TraceCompute(hand_over=True)

    def abandon(self) -> None:
        self.tracer.release()


class TraceCompute(StepPhase):
    """Every block recomputed, nothing offloaded: what recomputing each costs (trace.ComputeTrace)
    and what a step holds besides its saves (CUDA). With peak=, where the reentrant form is the
    planner's, a second one without the hand-over (``hand_over`` False) measures what a kept
    block's backward holds beyond them (Planner.kept_extra). Then the plan."""

    def __init__(self, hand_over: bool):
        self.hand_over = hand_over
        self.kind = Phase.TRACE_COMPUTE if hand_over else Phase.TRACE_COMPUTE_KEPT

    def begin(self, planner: Driver) -> Offload:
        self.tracer = ComputeTrace(planner.hooks, planner.clock, planner.options, self.hand_over)
        self.peak = StepPeak(planner.memory, planner.hooks)
        return self.tracer.ctx

    def end(self, planner: Driver) -> StepPhase:
        state = planner.state
        assert state.trace is not None  # the offload trace's
        if not self.tracer.collect(state.trace, may_repeat=not planner.traced_again):
            planner.traced_again |= self.tracer.first_calls
            return self
        if state.stale:  # block 0 took other inputs than the offload trace's: the planner traces again
            return self
        measured = self.peak.measured is not None
        if not measured and planner.memory.available:
            return self  # no backward reached the blocks (a batch skipped after forward): the target needs it
        if measured:  # what the model leaves out: activations' gradients, temporaries
            # every block recomputed, as this step ran, from the saves alone: the blocks' backward_extra
            # (which the first of these steps sets) is what is measured against it, in either step
            trace = without_backward_extras(state.trace)
            held = moments(trace, 0, set(range(len(trace.blocks))), 0, grads=True)
            besides, start_extra = self.besides(held)
            if self.hand_over:
                state.besides, state.start_extra = besides, start_extra
                state.traced_moments = self.peak.moments
                self.backward_extras(state.trace, held, besides)
            else:
                state.kept_besides = besides
        if self.hand_over and planner.reentrant and planner.peak is not None and measured:
            return TraceCompute(hand_over=False)
        return planner.make_plan()

    def abandon(self) -> None:
        self.tracer.release()  # else the next trace's timing wraps this one's, which times on for good

    def besides(self, held: list[int]) -> tuple[int, int]:
        """From the step's measured peak (every block recomputed; ``held``, the model's moments of
        it): what a block's backward holds besides the model's moments, and what backward's start
        holds beyond that. A language
        model's loss and head hold the logits' gradients there, which can outweigh any block's
        temporaries: one figure for the whole step would put them at every block's backward,
        where offloading recomputed blocks' inputs (which lowers only backward's start) would
        seem to gain nothing."""
        peak = self.peak
        assert peak.measured is not None
        if peak.parts is None:  # backward never reached the blocks' hook: one figure
            return max(0, peak.measured - max(held)), 0
        start, blocks = peak.parts
        besides = max(0, blocks - max(held[:-1]))
        return besides, start - held[-1] - besides

    def backward_extras(self, trace: Trace, held: list[int], besides: int) -> None:
        """Each block's backward_extra: what its backward held, measured at its own moment, beyond
        the model's moment (``held``, from the saves alone) and the besides (one figure, from the
        step's largest moment): the blocks' backwards differ where the blocks do. Each stays 0
        where the moments were not read one by one (a step of several forwards, a memory= without
        restart())."""
        measured = self.peak.moments
        if measured is None:
            return
        for b, at, peak in zip(trace.blocks, held, measured):
            if peak is not None:
                b.backward_extra = peak - at - besides
