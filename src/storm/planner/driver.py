"""The ``Planner``: a driver that runs the traced steps, makes the plan, measures and corrects
it, and tries it against an alternative, one step at a time. Each step's work is its phase's
(phases.py: an object whose end, once the step has run, returns the next phase); what one trace
has taught and decided is a TraceState (state.py), which tracing again replaces. What the
phases do is in their own modules (trace, model, measure, trial, wiring, explain);
docs/planner.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from ..compiled import compiled
from ..hooks import Offload
from . import explain as explaining
from .budgets import LADDER, BlockCompiler, BudgetSearch, Compiler, compile_options, ladder_option
from .held import moments, without_backward_extras
from .measure import HOST_CHECK_TOLERANCE, MAX_CHECKS, CudaPeakMemory, PeakMemory, checks_for, frames_of, near_slack
from .model import Plan, Scenario, choose, full_offloads
from .options import plan_options
from .phases import Measure, Phase, StepPhase, Try, after_checks, measure_full
from .state import Readings, TraceState
from .trace import Frames
from .traced import TraceOffload
from .trial import Clock, Trial
from .wiring import BlockHooks, Inputs, device_of

log = logging.getLogger("storm")

MiB = 1 << 20
# steps in a row whose inputs were smaller than the traced step's, left unread, before the planner
# traces again from the next step's: a trace made for one batch longer than any other would
# otherwise wait for a step as long, and every step meanwhile run as its phase's (an offload trace)
SMALLER_RUN = 16
Chooser = Callable[[Scenario], "Plan | None"]  # model.choose's signature


class Planner(Readings):
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
    peak memory; the CUDA allocator's), ``chooser`` (the plan for a model.Scenario:
    model.choose), ``frames_of`` (what a frame codec would frame: measure.frames_of),
    ``host_check_tolerance`` (how much dearer a planned step's packs must be to plan with them)
    and ``form_trial`` (whether a plan's recompute form is tried against the other).

    ``compile_blocks`` (True, or a dict of torch.compile's keyword arguments): the planner compiles
    each block's forward with inductor itself, and chooses the activation_memory_budget of the
    blocks' partitioner (torch's selective recompute inside them) with the plan, from 1.0 down
    ``block_budgets`` (budgets.py); ``compiler`` compiles them instead, as tests give one. The
    blocks run their class's forward again once the planner is closed.

    Each step is its phase's (phases.py), which works through what phases.Driver names: the
    planner's parts (``hooks``, ``memory``, ``clock``, ...), ``state`` (what this trace has taught
    and decided: a TraceState) and its planning (make_plan(), apply(), other_form(), step_peak())."""

    def __init__(self, blocks: Iterable[nn.Module], budget: int | float | str | None = None, *,
                 peak: int | str | None = None, reentrant: bool = True, clock: Clock | None = None,
                 memory: PeakMemory | None = None, chooser: Chooser = choose, frames_of: Frames = frames_of,
                 host_check_tolerance: float = HOST_CHECK_TOLERANCE, form_trial: bool = True,
                 model: nn.Module | None = None, compile_blocks: bool | dict[str, Any] = False,
                 block_budgets: Sequence[float] = LADDER, compiler: Compiler | None = None,
                 **offload_options: Any):
        if isinstance(blocks, nn.Module) and not hasattr(type(blocks), "__iter__"):
            raise TypeError(f"storm.plan takes the model's repeated blocks in the order its forward runs them "
                            f"(such as model.layers), not a {type(blocks).__name__} that holds them; or "
                            f"storm.enable(model, budget=...) finds them in the model")
        self.blocks = list(blocks)
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise TypeError("storm.plan needs the model's blocks: a non-empty list (or ModuleList) of modules")
        self.budget, self.peak, self.options = plan_options(budget, peak, reentrant, clock, offload_options)
        compiling, ladder = compile_options(compile_blocks), ladder_option(block_budgets)
        if compiler is None and compiling is not None:
            compiler = BlockCompiler(self.blocks, compiling)
        self.compiler = compiler
        # The reentrant form runs a block's forward without autograd: a compiled block then runs its
        # inference graph, whose kernels need not match the training graph's bit for bit (on CUDA they
        # did not), while the recompute in backward runs the training graph. torch's non-reentrant
        # checkpoint runs the training graph both times, so compiled blocks are recomputed that way.
        self.compiled = compiler is not None or any(compiled(b) for b in self.blocks)
        self.model = model
        self.reentrant = reentrant and not self.compiled
        self.memory = memory or CudaPeakMemory(device_of(self.blocks))
        self.clock = clock or Clock(device_of(self.blocks))  # what the traces and trials are timed by
        if self.peak is not None and not self.memory.available:
            raise ValueError("storm.plan's peak= is measured with the CUDA caching allocator and these blocks are "
                             "not on a CUDA device; give budget= (the bytes saved activations may take)")
        self._chooser, self.frames_of, self._form_trial = chooser, frames_of, form_trial
        self.host_check_tolerance = host_check_tolerance
        self.hooks = BlockHooks(self.blocks, self.reentrant)
        self.state = TraceState()
        # the blocks' partitioner budget where the planner compiles them: the one traced now, the
        # descent that chooses it (budgets.py); None where the blocks run as they were given
        self.block_budget: float | None = None
        self.search: BudgetSearch | None = None
        if compiler is not None:
            self.search = BudgetSearch(ladder)
            self._use_budget(1.0, self.state)
        self._phase: StepPhase = TraceOffload()  # the next step's, or the one running now
        self._begun: StepPhase | None = None     # the phase of the last step begun, until its end reads it
        self._ctx: Offload | None = None  # the step running now, or the last begun (a trace's too)
        self._backward_ended = False  # the last step begun ran its backward through the blocks to its end
        self.replans = 0
        self.traced_again = False  # a compute trace that paid first calls was repeated (ComputeTrace)

    @property
    def trying(self) -> Trial | None:
        """The trial running now, or the one the next step begins (no step timed yet); None in any
        phase but ``try``."""
        phase = self._phase
        return phase.trial if isinstance(phase, Try) and not self.state.stale else None

    @property
    def phase(self) -> Phase:
        """What the next step does, as far as the steps read so far tell (``settled`` reads the last)."""
        return Phase.TRACE_OFFLOAD if self.state.stale else self._phase.kind

    @property
    def settled(self) -> bool:
        """True once a plan is in force that no further step will measure or change (until the
        inputs' shapes change). Reading it after a step's backward finishes reading that step;
        read while a step runs (between its forward and its backward), it tells the phase that step
        runs in, and leaves the step to be read whole."""
        if not (self._begun is not None and self._ctx is not None and _entered(self._ctx)
                and not self._backward_ended):
            self._finish_last_step()
        return self.phase is Phase.SETTLED

    # --- each step ----------------------------------------------------------

    def step(self) -> Offload:
        """The storm.offload context of the next step, with the plan (or the trace) applied."""
        self._finish_last_step()
        self.hooks.remove_end_hooks()  # the last step's, where it never ran a backward
        self.hooks.new_step()
        if self.state.stale:
            # a trace made for inputs no smaller than those that outgrew the last (a step of smaller
            # ones is read by none of its phases): steps padded to their batch's longest sequence
            # are planned for the longest
            self.state, self._phase = TraceState(signature=self.state.outgrown), TraceOffload()
            self.replans += 1
            if self.search is not None:  # the budgets' costs were the old inputs': the descent again
                self.search = BudgetSearch(self.search.ladder[1:])
                self._use_budget(1.0, self.state)
        # a phase whose begin raised began no step: nothing of it is read, and the next step begins it again
        self._begun = self._ctx = None
        ctx = self._phase.begin(self)
        self._begun, self._ctx, self._backward_ended = self._phase, ctx, False
        self.hooks.at_backward_end(self._ended)
        return ctx

    def _ended(self) -> None:
        self._backward_ended = True

    def _finish_last_step(self) -> None:
        """Read the last step begun, where not yet: its phase's end gives the next step's. A step
        begun but never entered (a batch skipped after step()) ran nothing to read: the next step
        begins the same phase again. So does, outside the settled plan (which holds for it), a step
        unlike the traced one that its plan still holds for (wiring.Inputs): block 0's inputs
        smaller, or a block left out; and a forward that no backward followed (an evaluation with
        grad enabled, a batch skipped after its forward) unlike the traced one, or before any trace:
        no step to plan for. After SMALLER_RUN such smaller steps in a row (the traced inputs do not
        come again: one batch longer than any other), the next step traces again. A step with a
        backward whose block 0 took larger or other inputs, or one that ran the blocks in more or
        fewer forwards than the traced one, makes the trace stale: the next step traces again,
        which ``settled`` and ``phase`` say as soon as it is read."""
        if self._begun is not None:
            begun, self._begun = self._begun, None
            state = self.state
            inputs = self.hooks.compare_step(self.trace.forwards if self.trace else 0, state.signature)
            # blocks run and no backward after them (a step that ran none is the offload trace's to tell:
            # blocks inside a region compiled before the planner hooked them)
            no_step = (not self._backward_ended and max(self.hooks.calls) > 0
                       and (inputs is Inputs.OTHER or self.trace is None))
            if self._ctx is not None and not _entered(self._ctx):
                begun.abandon()
                self._phase = begun
            elif (inputs is Inputs.SMALLER or no_step) and begun.kind is not Phase.SETTLED:
                begun.abandon()  # not read: the next step begins the same phase again
                self._phase = begun
                if inputs is Inputs.SMALLER:
                    state.smaller_steps += 1
                    state.smaller_run += 1
                    if state.smaller_run >= SMALLER_RUN:
                        log.info("storm.plan: %d steps in a row took smaller inputs than the traced step; tracing "
                                 "again from the next step's", state.smaller_run)
                        state.stale = True
            else:
                state.smaller_run = 0
                if inputs is Inputs.OTHER and self.trace is not None and self._backward_ended:
                    state.stale, state.outgrown = True, tuple(self.hooks.inputs)
                self._phase = begun.end(self)
        forwards = max(self.hooks.calls)  # this step's, until the next begins (hooks.new_step); not block 0's
        if self.trace is not None and forwards and forwards != self.trace.forwards:  # alone: LayerDrop may drop it
            self.state.stale = True

    # --- planning -------------------------------------------------------------

    @property
    def saved_budget(self) -> int:
        """What plans are held to: with ``peak``, the peak less the besides, for saves and
        parameter gradients together; with ``budget``, the budget, for saves alone."""
        if self.peak is not None:
            assert self.besides is not None  # peak= is measured: the compute trace measured them
            return max(0, self.peak - self.besides)
        if isinstance(self.budget, int):
            return self.budget
        assert self.budget is not None and self.trace is not None
        # where the planner compiles the blocks, of what a step saves with none recomputed inside (budget 1.0)
        traced = self.search.tried[0].state.trace if self.search is not None and self.search.tried else self.trace
        assert traced is not None
        return int(self.budget * traced.total_bytes)

    def step_peak(self, plan: Plan) -> int:
        """The plan's saves and parameter gradients on the device at its predicted peak, with what
        a kept block's backward and backward's start hold beyond the besides."""
        return max(self._held(plan))

    def _held(self, plan: Plan) -> list[int]:
        """held.moments of ``plan``'s step: its saves and parameter gradients at each moment."""
        assert self.trace is not None
        return moments(self.trace, plan.offloaded, plan.recomputed, plan.in_flight_bytes, grads=True,
                       kept_extra=self.kept_extra, inputs_offloaded=plan.inputs_offloaded,
                       start_extra=self.start_extra, prefetch=plan.prefetch_bytes)

    def peak_moments(self, plan: Plan | None = None) -> list[tuple[int, int | None]] | None:
        """Per moment of ``plan``'s step (the plan in force by default; held.moments' layout:
        each block's backward, then backward's start), what the cost model predicts the step
        holds there above its start (the besides included) and what its first measured step
        held (None where it did not read that moment): where a prediction missed, and by how
        much. None before the compute trace, or where no step of the plan was measured so."""
        plan = plan or self.plan
        measured = plan and self.state.measured_moments.get(plan.shape)
        if plan is None or measured is None or self.besides is None or self.trace is None:
            return None
        return [(self.besides + h, m) for h, m in zip(self._held(plan), measured)]

    def traced_moments(self) -> list[tuple[int, int | None]] | None:
        """The same of the compute trace's step (every block recomputed, nothing offloaded),
        whose peak the besides were taken from, predicted without the blocks' backward_extra
        (which its moments set, making each exact): its largest moment predicts as measured,
        the others show how far one figure of besides stands for every block's backward."""
        measured, trace = self.state.traced_moments, self.trace
        if measured is None or trace is None or self.besides is None:
            return None
        held = moments(without_backward_extras(trace), 0, set(range(len(trace.blocks))), 0, grads=True,
                       start_extra=self.start_extra)
        return [(self.besides + h, m) for h, m in zip(held, measured)]

    @property
    def target(self) -> int | None:
        """The step peak (bytes above the step's start) a planned step is measured against:
        ``peak``; with ``budget``, the besides plus the plan's predicted saves and gradients at
        its peak, with its saves counted at the budget (what of the budget they leave unused added,
        what they take beyond it taken off: one target for every plan). None before the compute trace
        and where peaks cannot be measured (not CUDA)."""
        return None if self.plan is None else self.target_of(self.plan)

    def target_of(self, plan: Plan) -> int | None:
        """The target (Planner.target) a step of ``plan`` is measured against."""
        if self.besides is None:
            return None
        if self.peak is not None:
            return self.peak
        return self.besides + self.step_peak(plan) + self.saved_budget - plan.predicted_peak

    def scenario(self) -> Scenario:
        """What plans are chosen for now: the saved budget less the margin every plan leaves (and
        plans that offload, their own margin more), the user's storm.offload options, and with
        ``peak`` parameter gradients and backward's start counted."""
        state, grads = self.state, self.peak is not None
        assert state.trace is not None
        return Scenario(state.trace, self.saved_budget - state.margins[False],
                        held_bytes=self.options.get("max_held_bytes"),
                        prefetch_bytes=self.options.get("prefetch_bytes"),
                        offload_margin=state.margins[True] - state.margins[False], grads=grads,
                        codec=self.options.get("codec"), kept_extra=self.kept_extra,
                        start_extra=self.start_extra if grads else 0,
                        measured={shape: p.measured_over for shape, p in state.measured.items()})

    def _choose(self, scenario: Scenario) -> Plan | None:
        plan = self._chooser(scenario)
        return plan and dataclasses.replace(plan, reentrant=self.reentrant, block_budget=self.block_budget)

    def make_plan(self) -> StepPhase:
        """The plan in force (``_plan_in_force``) and the phase that follows; where the planner
        compiles the blocks, the descent over their partitioner's budgets first (budgets.py): the
        next budget's offload trace, and once it ends, the plan of the budget kept, from its trace."""
        search = self.search
        if search is None or search.done:
            return self._plan_in_force()
        # during the descent each budget's plan is only weighed (as chosen, nothing put in force, no
        # step measured): the budget kept puts its own in force once the descent ends
        scenario = self.scenario()
        plan = self.state.plan = self._choose(scenario)
        assert plan is not None  # choose() has a plan of either kind
        following = search.read(self.state, plan, scenario.budget)
        if following is not None:
            self._use_budget(following, TraceState(signature=self.state.signature))
            return TraceOffload()
        # the traced costs are one step's each: the budgets of costs near the least are tried against
        # its plan in alternation (trial.Trial), the first now, the others as each trial ends (next_trial)
        best, contender = search.best, search.next_contender()
        if best.budget != self.block_budget:
            self._use_budget(best.budget, best.state)
        return self._plan_in_force(contender and contender.state.plan)

    def _use_budget(self, budget: float, state: TraceState) -> None:
        """The blocks compiled at ``budget`` from the next step, with what ``state`` traced of them."""
        assert self.compiler is not None
        self.hooks.use_forwards(self.compiler.forwards(budget))
        self.block_budget, self.state = budget, state

    def _plan_in_force(self, alternative: Plan | None = None) -> StepPhase:
        """Put the plan of least predicted cost that fits in force (a measured plan fits by its
        measured peak; where none fits, the one of least peak, measured or predicted, once full
        offload has been measured beside them: phases.measure_full);
        the phase that follows: its first step measured where it can be (Measure), else what
        follows that (phases.after_checks). The model's costs are approximate (offloading's host
        time most): where a plan of the other kind fits too, it is the alternative both are tried
        in alternation with once this one's peak is settled, else the same plan in the other
        recompute form (other_form). Against a plan that offloads nothing, one that offloads only
        recomputed blocks' inputs is no such plan: it recomputes as a plan that fits without
        offloading can, and adds the copies. An ``alternative`` given (another budget's plan) is the one
        tried."""
        scenario, state = self.scenario(), self.state
        plan = self._choose(scenario)
        assert plan is not None  # choose() has a plan of either kind
        plan = state.measured.get(plan.shape, plan)  # as measured (a chooser= of a user's may not have looked)
        # each plan is measured once, while checks are left (measure.checks_for): where none fits,
        # the plans of least peak are so measured in turn (each measured one ranks by its measure),
        # and the least measured kept once no check is left
        to_measure = (self.target_of(plan) is not None and state.checks < checks_for(plan.fits)
                      and plan.shape not in state.measured)
        self.state.plan = plan
        if not plan.fits and not to_measure:  # a full offload that fits, else the least measured
            kept = state.kept_full()
            measuring = measure_full(self) if kept is None else None
            if measuring is not None:
                return measuring
            plan = self.state.plan = kept or state.least_measured() or plan
            if not plan.fits:
                budget = scenario.budget / MiB
                held = "saved activations" if self.peak is None else "saves and gradients, from peak=,"
                if plan.measured_over is None:
                    log.warning("storm.plan: no plan keeps the %s under %.1f MiB; the lowest predicted is %.1f MiB",
                                held, budget, plan.predicted_peak / MiB)
                else:
                    log.warning("storm.plan: no plan keeps the %s under %.1f MiB; of the %d measured, the one of "
                                "least measured peak is kept, %.1f MiB over its target", held, budget,
                                len(state.measured), plan.measured_over / MiB)
        if plan.fits and alternative is None and not self.trials:
            other = self._choose(dataclasses.replace(scenario, offload=not plan.offloads))
            if other is not None and other.fits and other.offloads != plan.offloads \
                    and (other.offloaded or plan.offloads):
                alternative = other
        if alternative is None:
            alternative = self.other_form(plan)
        self.apply(plan)
        return Measure(alternative) if to_measure else after_checks(self, alternative)

    def near_plan(self, measured: Plan, peak: int) -> Plan | None:
        """With peak=, once the plan in force (``measured``) measured ``peak`` within the target: the
        plan of least predicted cost that is predicted over the target by no more than the model
        predicted that plan over its measure (measure.near_slack), to be measured too, fits=False
        until it is; None where the model was not long, where it is that plan or one measured
        already, where no such plan costs less (or as little and offloads nothing where
        ``measured`` offloads), where the measured checks are spent, and where a
        step went over its prediction (a margin: the model is short here, not long). At a cap as
        tight as a plan's own peak (no offload's), a model a MiB long would otherwise never measure
        the plan that fits, and a slower one would stay."""
        state = self.state
        if self.peak is None or state.checks >= MAX_CHECKS or any(state.margins.values()) or measured.full:
            return None
        assert state.besides is not None  # peak= is measured: the compute trace measured them
        slack = near_slack(self.peak, state.besides + self.step_peak(measured) - peak)
        if not slack:
            return None
        scenario = self.scenario()
        near = self._choose(dataclasses.replace(scenario, budget=scenario.budget + slack))
        if near is None or not near.fits or near.shape == measured.shape or near.shape in state.measured:
            return None
        # cheaper, or as cheap by the model and offloading nothing where the measured plan offloads
        if (near.predicted_cost_ms, near.offloads) >= (measured.predicted_cost_ms, measured.offloads):
            return None
        return dataclasses.replace(near, fits=False)

    def full_offload(self) -> Plan | None:
        """The next full-offload plan to measure (model.full_offloads: every block recomputed, then
        none, then none raw) where no plan of the blocks measured within peak=; None with budget=
        (offloading every block fits any budget of saves the store takes) or once each has run
        since the last trace."""
        if self.peak is None:
            return None
        tried = self.state.full_tried
        plan = next((p for p in full_offloads(self.scenario()) if p.shape not in tried), None)
        return plan and dataclasses.replace(plan, reentrant=self.reentrant, block_budget=self.block_budget)

    def next_trial(self, plan: Plan) -> Plan | None:
        """What a trial just decided for ``plan`` is tried against next: the plan of the next budget of
        the blocks' partitioner left to try (budgets.BudgetSearch.contenders), else ``plan`` in the
        other recompute form (other_form)."""
        contender = self.search.next_contender() if self.search is not None else None
        return contender.state.plan if contender is not None else self.other_form(plan)

    def other_form(self, plan: Plan) -> Plan | None:
        """``plan`` with its blocks recomputed by torch's non-reentrant checkpoint, to be tried
        once per trace beside the reentrant form (not a full offload's: its room would profile
        again for the other form's saves, inside the trial's timed steps). Neither is faster
        everywhere: the reentrant form
        costs the host less, the non-reentrant one stops each recompute at the block's last saved
        tensor and skips what follows (a transformer block's last matmul and residual add), which
        a GPU-bound step gains from (docs/planner.md, "Recompute forms")."""
        tried = any(t.forms for t in self.trials)
        if not self._form_trial or tried or not plan.fits or not plan.recomputed or not plan.reentrant or plan.full:
            return None
        return dataclasses.replace(plan, reentrant=False)

    def apply(self, plan: Plan) -> None:
        """Put ``plan`` in force from the next step: its recomputed blocks and its hooks, and where it
        was made for another budget of the blocks' partitioner, the blocks compiled at that budget
        and what its trace taught (a trial of two budgets: phases.Try)."""
        if self.search is not None and plan.block_budget not in (None, self.block_budget):
            self._use_budget(plan.block_budget, self.search.state_of(plan.block_budget))
        state = self.state
        assert state.trace is not None
        state.plan = plan
        self.hooks.apply(plan, state.trace, self.peak is not None, lambda: self._ctx)

    def explain(self) -> str:
        """Per block what was measured and what the plan does with it, and the predicted totals."""
        return explaining.explain(self)

    def close(self) -> None:
        """Read the last step where it ran, so that explain() tells what it decided (a trial's last
        step, say: training often ends as the plan settles), then restore the blocks' own forwards
        and remove STORM's hooks from them."""
        try:
            if self._ctx is not None and _entered(self._ctx):
                self._finish_last_step()
        finally:  # the model's own forwards come back whatever reading the last step raised
            self.hooks.close()  # a step begun but never run leaves its hook waiting: that goes too
            self._begun = None


def _entered(ctx: Offload) -> bool:
    """Whether a step's context was entered: a step begun but never run has nothing to read."""
    try:
        ctx.stats  # raises before the context is entered
    except RuntimeError:
        return False
    return True


def plan(blocks: Iterable[nn.Module], budget: int | float | str | None = None, *, peak: int | str | None = None,
         reentrant: bool = True, clock: Clock | None = None, model: nn.Module | None = None,
         compile_blocks: bool | dict[str, Any] = False, block_budgets: Sequence[float] = LADDER,
         **offload_options: Any) -> Planner:
    """A Planner (see its docstring, and docs/planner.md)."""
    return Planner(blocks, budget, peak=peak, reentrant=reentrant, clock=clock, model=model,
                   compile_blocks=compile_blocks, block_budgets=block_budgets, **offload_options)
