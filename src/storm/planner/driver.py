"""The ``Planner``: a driver that runs the traced steps, makes the plan, measures and corrects
it, and tries it against an alternative, one step at a time, in the phases ``Phase`` names.
What each phase does is in its own module (trace, model, measure, trial, wiring, explain);
docs/planner.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from typing import Any, Callable, Iterable

from torch import nn

from ..compiled import compiled
from ..hooks import Offload
from . import explain as explaining
from .measure import (
    HOST_CHECK_STEP,
    HOST_CHECK_TOLERANCE,
    MAX_CHECKS,
    CudaPeakMemory,
    PeakMemory,
    dearer_packs,
    frames_of,
    packs_ms_per_tensor,
    widened_margin,
)
from .model import Plan, Trace, choose, moments, predicted_peak
from .options import plan_options
from .trace import ComputeTrace, Frames, OffloadTrace
from .trial import Clock, Trial
from .wiring import BlockHooks, device_of

log = logging.getLogger("storm")

MiB = 1 << 20
Chooser = Callable[..., "Plan | None"]  # model.choose's signature


class Phase(enum.Enum):
    """What the planner's next step does."""

    TRACE_OFFLOAD = "trace-offload"            # everything offloaded, raw (trace.OffloadTrace)
    TRACE_COMPUTE = "trace-compute"            # every block recomputed, nothing offloaded (trace.ComputeTrace)
    TRACE_COMPUTE_KEPT = "trace-compute-kept"  # again without the hand-over: kept_extra (peak=, reentrant form)
    MEASURE = "measure"        # the plan, its peak measured against the target (CUDA): a margin where over
    CHECK_HOST = "check-host"  # the plan, offloading: its packs' host time is yet to be read
    TRY = "try"                # the plan or its alternative, in alternation (trial.Trial)
    SETTLED = "settled"        # the plan, that no step will measure or change until the inputs' shapes do


class Planner:
    """Keeps the tensors saved in ``blocks`` (the model's repeated layers, run in this order)
    under ``budget`` (bytes such as "8GiB", or a fraction in (0, 1] of a step's offloadable
    bytes), or keeps the step's peak GPU memory above its start under ``peak`` (bytes; CUDA),
    planning from traced steps. Each step: ``with planner.step(): ...``. ``reentrant``: how
    blocks are recomputed (Recompute); False for training that calls torch.autograd.grad or
    backward(inputs=...). ``clock``: what steps and blocks are timed by (Clock: the compute
    stream's, else the host's). ``model``: the model the blocks are in, by whose module names
    explain() says what saved the step's tensors outside the blocks (storm.enable passes it;
    without it, only their bytes). Other options go to storm.offload.

    What the planner measures and decides by can be given, as tests do: ``memory`` (a step's
    peak memory; the CUDA allocator's), ``chooser`` (the plan for a trace: model.choose),
    ``frames_of`` (what a frame codec would frame: measure.frames_of), ``host_check_tolerance``
    (how much dearer a planned step's packs must be to plan with them) and ``form_trial``
    (whether a plan's recompute form is tried against the other)."""

    def __init__(self, blocks: Iterable[nn.Module], budget: int | float | str | None = None, *,
                 peak: int | str | None = None, reentrant: bool = True, clock: Clock | None = None,
                 memory: PeakMemory | None = None, chooser: Chooser = choose, frames_of: Frames = frames_of,
                 host_check_tolerance: float = HOST_CHECK_TOLERANCE, form_trial: bool = True,
                 model: nn.Module | None = None, **offload_options: Any):
        if isinstance(blocks, nn.Module) and not hasattr(type(blocks), "__iter__"):
            raise TypeError(f"storm.plan takes the model's repeated blocks in the order its forward runs them "
                            f"(such as model.layers), not a {type(blocks).__name__} that holds them; or "
                            f"storm.enable(model, budget=...) finds them in the model")
        self.blocks = list(blocks)
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise TypeError("storm.plan needs the model's blocks: a non-empty list (or ModuleList) of modules")
        self.budget, self.peak, self.options = plan_options(budget, peak, reentrant, clock, offload_options)
        # The reentrant form runs a block's forward without autograd: a compiled block then runs its
        # inference graph, whose kernels need not match the training graph's bit for bit (on CUDA they
        # did not), while the recompute in backward runs the training graph. torch's non-reentrant
        # checkpoint runs the training graph both times, so compiled blocks are recomputed that way.
        self.compiled = any(compiled(b) for b in self.blocks)
        self.model = model
        self.reentrant = reentrant and not self.compiled
        self._memory = memory or CudaPeakMemory(device_of(self.blocks))
        self.clock = clock or Clock(device_of(self.blocks))  # what the traces and trials are timed by
        if self.peak is not None and not self._memory.available:
            raise ValueError("storm.plan's peak= is measured with the CUDA caching allocator and these blocks are "
                             "not on a CUDA device; give budget= (the bytes saved activations may take)")
        self._chooser, self._frames_of, self._form_trial = chooser, frames_of, form_trial
        self._host_check_tolerance = host_check_tolerance
        self._hooks = BlockHooks(self.blocks, self.reentrant)
        self.trace: Trace | None = None
        self.plan: Plan | None = None
        # what a step holds besides its saves (activations' gradients, temporaries) at a recomputed
        # or offloaded block's backward, measured on CUDA in the compute trace; None before it
        self.besides: int | None = None
        self.start_extra = 0  # and what backward's start holds beyond that (start_extra in model.moments)
        self._kept_besides: int | None = None  # the same where each block's saves stay to their nodes' ends
        self.measured_peak: int | None = None  # the last measured planned step's peak above its start
        self._margins = {False: 0, True: 0}    # measured peak beyond predicted, for plans that (do not) offload
        self.checks = 0                        # planned steps measured since the last trace
        self._checking = False                 # the next planned step is measured
        self._tracing: Phase | None = Phase.TRACE_OFFLOAD  # the traced step next; None once planned
        self._pending: Callable[[], None] | None = None  # finishes reading the last step
        self._signature: tuple = ()  # block 0's inputs' shapes and dtypes in each forward of the offload trace
        self._stale = False                    # block 0 was called with others: the next step traces again
        self._ctx: Offload | None = None  # the step running now, or the last begun (a trace's too)
        self._measured: int | None = None  # the measured step's peak, read as its backward ended
        # and apart: until backward reached the blocks (forward, the loss's and the head's backward),
        # and from there; None where backward never reached them
        self._measured_parts: tuple[int, int] | None = None
        self._offloading_steps = 0         # planned steps that offloaded, since the last trace
        self.traced_host_ms_per_tensor: float | None = None  # the trace's, where a planned step measured more
        self._alternative: Plan | None = None  # the best fitting plan of the other kind (offloading or not)
        self._trial: Trial | None = None       # the plan and the alternative, tried in alternation
        self.trials: list[Trial] = []          # this trace's trials, decided, in order
        self.replans = 0
        self._traced_again = False  # a compute trace that paid first calls was repeated (ComputeTrace)

    @property
    def margins(self) -> dict[bool, int]:
        """Bytes that plans which offload (True) or not (False) leave below the budget, from measured steps."""
        return dict(self._margins)

    @property
    def trial(self) -> Trial | None:
        """The last trial decided since the last trace."""
        return self.trials[-1] if self.trials else None

    @property
    def trying(self) -> Trial | None:
        """The trial running now, or the one the next step begins (no step timed yet); None in any
        phase but ``try``."""
        if self.phase is not Phase.TRY:
            return None
        if self._trial is not None:
            return self._trial
        if self.plan is None or self._alternative is None:
            return None
        return Trial((self.plan, self._alternative))

    @property
    def kept_extra(self) -> int:
        """What a kept block's backward holds beyond a recomputed one's: autograd keeps a kept
        block's saves until each node that saved them ends, beside the node's temporaries (a bias
        gradient's reduction buffer, say), where Recompute hands them over and they go as the node
        takes them. Measured with peak= in the reentrant form (the second compute trace, without
        the hand-over); else 0."""
        if self.besides is None or self._kept_besides is None:
            return 0
        return max(0, self._kept_besides - self.besides)

    @property
    def phase(self) -> Phase:
        """What the next step does, as far as the steps read so far tell (``settled`` reads the last)."""
        if self._stale:
            return Phase.TRACE_OFFLOAD
        if self._tracing is not None:
            return self._tracing
        if self._trial is not None:
            return Phase.TRY
        if self._checking:
            return Phase.MEASURE
        if self._host_check_due():
            return Phase.CHECK_HOST
        return Phase.TRY if self._alternative is not None else Phase.SETTLED

    @property
    def settled(self) -> bool:
        """True once a plan is in force that no further step will measure or change (until the
        inputs' shapes change). Reading it between steps finishes reading the last step."""
        self._finish_last_step()
        return self.phase is Phase.SETTLED

    def _host_check_due(self) -> bool:
        """A planned step that offloads is yet to be read (_check_host); not after a trial, whose
        step times decided."""
        return (self.plan is not None and self.plan.offloads and self.traced_host_ms_per_tensor is None
                and self._offloading_steps < HOST_CHECK_STEP and self.trial is None)

    # --- each step ----------------------------------------------------------

    def step(self) -> Offload:
        """The storm.offload context of the next step, with the plan (or the trace) applied."""
        self._finish_last_step()
        self._hooks.remove_end_hooks()  # the last step's, where it never ran a backward
        forwards = self._hooks.calls[0]
        if self.trace is not None and forwards and forwards != self.trace.forwards:
            self._stale = True  # the last step ran the blocks more or fewer times than the traced one
        self._hooks.new_step()
        if self._stale:
            self._stale, self._tracing, self.plan = False, Phase.TRACE_OFFLOAD, None
            self._margins, self.checks, self._checking = {False: 0, True: 0}, 0, False
            self.besides, self._kept_besides, self.start_extra = None, None, 0
            self._offloading_steps, self.traced_host_ms_per_tensor = 0, None
            self._alternative, self._trial, self.trials = None, None, []
            self.replans += 1
        if self._tracing is Phase.TRACE_OFFLOAD:
            return self._trace_offload()
        if self._tracing is not None:
            return self._trace_compute(hand_over=self._tracing is Phase.TRACE_COMPUTE)
        if self._trial is None and self._alternative is not None and not self._checking \
                and not self._host_check_due():
            self._trial, self._alternative = Trial((self.plan, self._alternative)), None
        if self._trial is not None and self._trial.next_plan() is not self.plan:
            self._apply(self._trial.next_plan())
        p = self.plan
        # where frames were weighed, the plan says which (a daemon's codec setting could frame a raw
        # plan's tensors); a codec of the user's comes first, as choose() knew
        framing = p.compressed or any(b.framed for b in self.trace.blocks)
        codec = {"codec": "ancf_exp" if p.compressed else "raw"} if framing else {}
        ctx = Offload(**{"max_held_bytes": p.max_held_bytes, "prefetch_bytes": p.prefetch_bytes, **codec,
                         **self.options}, budget=p.offload_budget)
        self._ctx = ctx
        after: list[Callable[[], None]] = []
        if self._checking:
            self._measure_this_step()
            after.append(self._check)
        if self._host_check_due() and self._trial is None:
            self._offloading_steps += 1
            if self._offloading_steps == HOST_CHECK_STEP:
                after.append(functools.partial(self._check_host, ctx))
        if self._trial is not None:
            after.append(self._time_trial_step())
        if after:
            def finish() -> None:
                for f in after:
                    f()
            self._pending = finish
        return ctx

    def _finish_last_step(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _trace_offload(self) -> Offload:
        tracer = OffloadTrace(self._hooks, self.options, self._frames_of, self.model)
        self._ctx = tracer.ctx

        def collect() -> None:
            trace = tracer.collect()
            self._signature = tracer.signature
            if trace is not None:
                self.trace, self._tracing = trace, Phase.TRACE_COMPUTE

        self._pending = collect
        return tracer.ctx

    def _trace_compute(self, hand_over: bool) -> Offload:
        """The compute trace and what a step holds besides its saves; with peak=, where the
        reentrant form is the planner's, a second one without the hand-over (kept_extra)."""
        tracer = ComputeTrace(self._hooks, self.clock, self.options, hand_over)
        self._ctx = tracer.ctx
        self._measure_this_step()

        def collect() -> None:
            if not tracer.collect(self.trace, may_repeat=not self._traced_again):
                self._traced_again |= tracer.first_calls
                return
            if self._measured is not None:  # what the model leaves out: activations' gradients, temporaries
                besides, start_extra = self._besides()
                if hand_over:
                    self.besides, self.start_extra = besides, start_extra
                else:
                    self._kept_besides = besides
            if hand_over and self.reentrant and self.peak is not None and self._measured is not None:
                self._tracing = Phase.TRACE_COMPUTE_KEPT
            else:
                self._make_plan()

        self._pending = collect
        return tracer.ctx

    def _besides(self) -> tuple[int, int]:
        """From the compute trace just measured (every block recomputed): what a block's backward
        holds besides the model's moments, and what backward's start holds beyond that. A language
        model's loss and head hold the logits' gradients there, which can outweigh any block's
        temporaries: one figure for the whole step would put them at every block's backward,
        where offloading recomputed blocks' inputs (which lowers only backward's start) would
        seem to gain nothing."""
        held = moments(self.trace, 0, set(range(len(self.blocks))), 0, grads=True)
        if self._measured_parts is None:  # backward never reached the blocks' hook: one figure
            return max(0, self._measured - max(held)), 0
        start, blocks = self._measured_parts
        besides = max(0, blocks - max(held[:-1]))
        return besides, start - held[-1] - besides

    # --- measuring a planned step -------------------------------------------

    def _measure_this_step(self) -> None:
        """Reset the peak statistics now and read them as backward reaches the blocks and when
        this step's backward ends (before the optimizer and whatever else the caller does between
        steps)."""
        self._measured, self._measured_parts = None, None
        if not self._memory.available:
            return
        self._memory.start()
        start: list[int | None] = []
        restart = getattr(self._memory, "restart", None)  # a memory= of a user's without it: one figure

        def reached() -> None:
            start.append(self._memory.peak())
            restart()

        def read() -> None:
            blocks = self._memory.peak()
            if start and start[0] is not None and blocks is not None:
                self._measured_parts = (start[0], blocks)
                self._measured = max(start[0], blocks)
            else:
                self._measured = blocks

        self._hooks.at_backward_end(read, reached if restart is not None else None)

    def _check(self) -> None:
        """After a measured planned step: over the target, what the step took beyond the plan's
        prediction becomes the margin of plans of its kind (measure.widened_margin), and the
        next step plans again."""
        self.checks += 1
        self.measured_peak = self._measured
        target = self.target
        if self.measured_peak is None or self.measured_peak <= target or self._stale:  # None: no backward
            self._checking = False
            return
        if self.checks >= MAX_CHECKS:
            self._checking = False
            log.warning("storm.plan: a planned step peaked %.1f MiB over its target of %.1f MiB after %d "
                        "corrections; keeping this plan", (self.measured_peak - target) / MiB, target / MiB,
                        self.checks)
            return
        beyond = self.measured_peak - self.besides - self._step_peak(self.plan)
        kind = self.plan.offloads
        self._margins[kind] = widened_margin(self._margins[kind], beyond, target)
        self._make_plan()

    def _check_host(self, ctx: Offload) -> None:
        """After a planned step that offloaded: where its packs took more host time per tensor
        than the offload trace's (measure.dearer_packs), that becomes the trace's, and the next
        step plans again; once per trace."""
        measured = packs_ms_per_tensor(ctx.stats)
        if measured is None or self.plan is None or self._stale:
            return
        if not dearer_packs(measured, self.trace.host_ms_per_tensor, self._host_check_tolerance):
            return
        log.info("storm.plan: a planned step took %.0f us of host time per offloaded tensor against %.0f traced; "
                 "planning with it", measured * 1e3, self.trace.host_ms_per_tensor * 1e3)
        self.traced_host_ms_per_tensor = self.trace.host_ms_per_tensor
        self.trace.host_ms_per_tensor = measured
        self._make_plan()

    # --- trials ---------------------------------------------------------------

    def _time_trial_step(self) -> Callable[[], None]:
        """Time this trial step, forward and backward on the compute stream (host-bound gaps
        included; CPU: the host clock); the first step of the alternative is measured against its
        target too. Returns what reads it after the step, and decides the trial once it can
        (Trial.decided)."""
        trial, clock = self._trial, self.clock
        turn, marks = trial.turn, [clock.mark()]
        self._hooks.at_backward_end(lambda: marks.append(clock.mark()))
        measured = turn == 1 and self._memory.available
        if measured:
            self._measure_this_step()

        def read() -> None:
            trial.turn += 1
            if len(marks) < 2 or self._stale or self._trial is not trial:  # no backward, or traced again
                return
            trial.ms[turn % 2].append(clock.elapsed_ms(*marks))
            if measured and self._measured is not None and self._measured > self.target:
                trial.over = self._measured
                self._decide_trial()
            elif trial.decided:
                self._decide_trial()

        return read

    def _decide_trial(self) -> None:
        """Keep the plan of the two whose steps took less (the alternative only if it stayed within
        its target)."""
        trial, self._trial = self._trial, None
        self.trials.append(trial)
        keep = trial.plans[1] if trial.over is None and trial.gain_ms > 0 else trial.plans[0]
        trial.kept = keep
        if keep is not self.plan:
            self._apply(keep)
        log.info("storm.plan: %s", trial.describe())
        self._alternative = self._other_form(keep)

    def _other_form(self, plan: Plan) -> Plan | None:
        """``plan`` with its blocks recomputed by torch's non-reentrant checkpoint, to be tried
        once per trace beside the reentrant form. Neither is faster everywhere: the reentrant form
        costs the host less, the non-reentrant one stops each recompute at the block's last saved
        tensor and skips what follows (a transformer block's last matmul and residual add), which
        a GPU-bound step gains from (docs/planner.md, "Recompute forms")."""
        tried = any(t.forms for t in (*self.trials, self._trial) if t)
        if not self._form_trial or tried or not plan.fits or not plan.recomputed or not plan.reentrant:
            return None
        return dataclasses.replace(plan, reentrant=False)

    # --- planning -------------------------------------------------------------

    @property
    def saved_budget(self) -> int:
        """What plans are held to: with ``peak``, the peak less the besides, for saves and
        parameter gradients together; with ``budget``, the budget, for saves alone."""
        if self.peak is not None:
            return max(0, self.peak - self.besides)
        return self.budget if isinstance(self.budget, int) else int(self.budget * self.trace.total_bytes)

    def _step_peak(self, plan: Plan) -> int:
        """The plan's saves and parameter gradients on the device at its predicted peak, with what
        a kept block's backward and backward's start hold beyond the besides."""
        return predicted_peak(self.trace, plan.offloaded, plan.recomputed, plan.in_flight_bytes,
                              kept_extra=self.kept_extra, inputs_offloaded=plan.inputs_offloaded,
                              start_extra=self.start_extra, prefetch=plan.prefetch_bytes)

    @property
    def target(self) -> int | None:
        """The step peak (bytes above the step's start) a planned step is measured against:
        ``peak``; with ``budget``, the besides plus the plan's predicted saves and gradients at
        its peak plus what of the budget its saves leave unused. None before the compute trace
        and where peaks cannot be measured (not CUDA)."""
        if self.besides is None or self.plan is None:
            return None
        if self.peak is not None:
            return self.peak
        return self.besides + self._step_peak(self.plan) + max(0, self.saved_budget - self.plan.predicted_peak)

    def _plans_budget(self) -> int:
        """What choose() holds plans to: the saved budget, less the margin every plan leaves."""
        return self.saved_budget - self._margins[False]

    def _choose(self, offload: bool | None = None) -> Plan | None:
        plan = self._chooser(self.trace, self._plans_budget(), self.options.get("max_held_bytes"),
                             self.options.get("prefetch_bytes"), self._margins[True] - self._margins[False],
                             grads=self.peak is not None, codec=self.options.get("codec"), offload=offload,
                             kept_extra=self.kept_extra, start_extra=self.start_extra if self.peak is not None else 0)
        return plan and dataclasses.replace(plan, reentrant=self.reentrant)

    def _make_plan(self) -> None:
        """The plan of least predicted cost; where none fits, the one of least peak."""
        self.plan = self._choose()
        if not self.plan.fits:
            log.warning("storm.plan: no plan keeps the %s under %.1f MiB; the lowest predicted is %.1f MiB",
                        "saved activations" if self.peak is None else "saves and gradients, from peak=,",
                        self._plans_budget() / MiB, self.plan.predicted_peak / MiB)
        # a plan that cannot fit is not measured: no margin would make it
        self._checking = self.plan.fits and self.target is not None and self.checks < MAX_CHECKS
        # the model's costs are approximate (offloading's host time most): where a plan of the other
        # kind fits too, both are tried in alternation once this one's peak is settled. Against a
        # plan that offloads nothing, one that offloads only recomputed blocks' inputs is no such
        # plan: it recomputes as a plan that fits without offloading can, and adds the copies
        self._alternative = None
        if self.plan.fits and self.trial is None and self._trial is None:
            other = self._choose(offload=not self.plan.offloads)
            if other is not None and other.fits and other.offloads != self.plan.offloads \
                    and (other.offloaded or self.plan.offloads):
                self._alternative = other
        if self._alternative is None and self._trial is None:
            self._alternative = self._other_form(self.plan)
        self._apply(self.plan)
        self._tracing = None

    def _apply(self, plan: Plan) -> None:
        """Put ``plan`` in force from the next step: its recomputed blocks and its hooks."""
        self.plan = plan
        self._hooks.apply(plan, self.trace, self.peak is not None, self._trace_again, self._signature,
                          lambda: self._ctx)

    def _trace_again(self) -> None:
        """Block 0 was called with other input shapes than those traced: the trace no longer holds."""
        self._stale = True

    def explain(self) -> str:
        """Per block what was measured and what the plan does with it, and the predicted totals."""
        return explaining.explain(self)

    def close(self) -> None:
        """Read the last step where it ran, so that explain() tells what it decided (a trial's last
        step, say: training often ends as the plan settles), then restore the blocks' own forwards
        and remove STORM's hooks from them."""
        if self._ctx is not None and _entered(self._ctx):
            self._finish_last_step()
        self._hooks.close()  # a step begun but never run leaves its hook waiting: that goes too
        self._pending = None


def _entered(ctx: Offload) -> bool:
    """Whether a step's context was entered: a step begun but never run has nothing to read."""
    try:
        ctx.stats  # raises before the context is entered
    except RuntimeError:
        return False
    return True


def plan(blocks: Iterable[nn.Module], budget: int | float | str | None = None, *, peak: int | str | None = None,
         reentrant: bool = True, clock: Clock | None = None, model: nn.Module | None = None,
         **offload_options: Any) -> Planner:
    """A Planner (see its docstring, and docs/planner.md)."""
    return Planner(blocks, budget, peak=peak, reentrant=reentrant, clock=clock, model=model, **offload_options)
