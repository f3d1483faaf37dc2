"""Timed trials on the CPU GPT, decided by a FakeClock's timings: the plan against the best of
the other kind, the two recompute forms, close plans running more steps, and a slow stretch of
the host that must not decide."""

from __future__ import annotations

from typing import Callable

import pytest

import storm
from planner_fakes import FakeClock, gpt, grads_of, recompute_two, traced_gpt_planner
from storm.examples.models import same_bits
from storm.planner import Phase, Plan, Scenario
from storm.planner.measure import HOST_CHECK_STEP
from storm.planner.trial import TRIAL_MAX_STEPS, TRIAL_STEPS
from storm.recompute import Recompute


def by_kind(peak: int) -> Callable[[Scenario], Plan]:
    """A choice of either kind, both predicted to fit at ``peak``: offload blocks 0-1 (cheaper by the
    model) or, without offloading, recompute them."""
    def choose(s: Scenario) -> Plan:
        if s.offload is False:
            return Plan(offloaded=0, recomputed=frozenset({0, 1}), offload_budget=0, max_held_bytes=0,
                        prefetch_bytes=0, predicted_peak=peak, predicted_cost_ms=5.0, fits=True)
        return Plan(offloaded=2, recomputed=frozenset(), offload_budget=s.trace.offloaded_before[2],
                    max_held_bytes=1 << 30, prefetch_bytes=0, predicted_peak=peak, predicted_cost_ms=1.0, fits=True)

    return choose


@pytest.mark.parametrize("slow, kept", [("offload", "recompute"), ("recompute", "offload")])
def test_the_plan_and_the_best_of_the_other_kind_are_tried_and_the_faster_kept(monkeypatch, slow, kept):
    """The model's costs are approximate; where the best plan that offloads and the best that
    does not both fit, the planner runs them in alternation, TRIAL_STEPS steps each, times
    forward and backward, and keeps the faster: here offloading blocks 0-1 (the model's choice)
    against recomputing them, with ``slow`` made 20 ms a call slower on the planner's clock.
    Every step's gradients are those of no offload, bit for bit."""
    from storm import mover

    clock = FakeClock()
    cls, name = (mover.Mover, "put") if slow == "offload" else (Recompute, "__call__")
    call = getattr(cls, name)

    def slower(*args, **kwargs):
        clock.now += 0.02
        return call(*args, **kwargs)

    model, idx, ref, planner = traced_gpt_planner(clock, chooser=by_kind(1 << 40), form_trial=False)
    monkeypatch.setattr(cls, name, slower)
    offloading = []
    for step in range(HOST_CHECK_STEP + 2 * TRIAL_STEPS + 2):
        assert planner.settled == (len(offloading) >= HOST_CHECK_STEP + 2 * TRIAL_STEPS)
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        offloading.append(ctx.stats.offloaded > 0)
    trial = planner.trial
    # the model's plan until its host time is read, then both in turn, then the faster
    assert offloading == [True] * 2 + [True, False] * TRIAL_STEPS + [kept == "offload"] * 2
    assert all(len(ms) == TRIAL_STEPS for ms in trial.ms)
    assert trial.median(0 if slow == "recompute" else 1) < trial.median(1 if slow == "recompute" else 0)
    assert abs(trial.gain_ms) >= 20.0  # at least one slower call a step, by the clock alone
    assert (planner.plan.offloaded > 0) == (kept == "offload") and trial.kept is planner.plan
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == set(planner.plan.recomputed)
    text = planner.explain()
    assert "tried offload 2 blocks against recompute 2 blocks in alternation" in text
    assert f"kept {'offload 2 blocks' if kept == 'offload' else 'recompute 2 blocks'}, " in text
    planner.close()


@pytest.mark.parametrize("slow", ["reentrant", "non-reentrant"])
def test_the_faster_recompute_form_is_kept(monkeypatch, slow):
    """A plan that recomputes in the reentrant form runs in alternation with the same plan
    recomputing by torch's non-reentrant checkpoint (cheaper on the GPU where blocks end in
    work nothing saves, dearer on the host), and the faster is kept; here the ``slow`` form's
    blocks each take 100 ms more on the planner's clock (a sleep instead was outweighed by a
    loaded machine's noise). Every step's gradients are those of no offload, bit for bit."""
    clock = FakeClock()
    call = Recompute.__call__

    def slower(self, *a, **k):
        if self.reentrant == (slow == "reentrant"):
            clock.now += 0.1
        return call(self, *a, **k)

    model, idx, ref, planner = traced_gpt_planner(clock, chooser=recompute_two)
    monkeypatch.setattr(Recompute, "__call__", slower)
    forms = []
    for step in range(2 * TRIAL_STEPS + 2):
        assert planner.settled == (step >= 2 * TRIAL_STEPS)
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        forms.append({model.blocks[i].forward.reentrant for i in (0, 1)})
    kept = slow == "non-reentrant"
    assert forms == [{True}, {False}] * TRIAL_STEPS + [{kept}] * 2, planner.explain()
    assert planner.plan.reentrant == kept and planner.plan.recomputed == frozenset({0, 1})
    text = planner.explain()
    form = "the reentrant form" if kept else "torch's non-reentrant checkpoint"
    assert f"kept {form}, " in text
    assert ("recomputed in the reentrant form (storm.recompute), kept in its trial" if kept
            else "recomputed with torch's non-reentrant checkpoint, kept in its trial") in text
    planner.close()


def timed_form_trial(ms: Callable[[int, bool], float]) -> tuple[list[bool], storm.Planner]:
    """A planner on the CPU GPT whose plan recomputes blocks 0 and 1, run through its form trial
    (and 2 steps more) with the trial's step times given: ``ms(k, reentrant)`` for its k-th
    step. Returns the form of each step and the planner."""
    clock, timed = FakeClock(), []
    model, idx, ref, planner = traced_gpt_planner(clock, chooser=recompute_two)

    def given(start, end):  # a trial step's, read as the next step starts with its plan still in force
        if planner.phase is not Phase.TRY:  # the compute trace's, read at the first planned step
            return FakeClock.elapsed_ms(clock, start, end)
        timed.append(ms(len(timed), planner.plan.reentrant))
        return timed[-1]

    clock.elapsed_ms = given
    forms = []
    while not planner.settled or len(forms) < len(timed) + 2:
        assert len(forms) <= 2 * TRIAL_MAX_STEPS + 2, planner.explain()
        ctx = planner.step()
        forms.append(planner.plan.reentrant)
        grads_of(model, idx, ctx)
    return forms, planner


@pytest.mark.parametrize("apart, close", [(0.01, True), (0.05, False)])
def test_a_trial_whose_plans_are_close_runs_more_steps_before_it_decides(apart, close):
    """Plans within TRIAL_CLOSE of each other are within a lent GPU's step-to-step noise: the
    trial then runs each plan up to TRIAL_MAX_STEPS steps before it keeps the faster; farther
    apart, TRIAL_STEPS decide. Here the non-reentrant form's steps take ``apart`` less."""
    forms, planner = timed_form_trial(lambda k, reentrant: 100.0 if reentrant else 100.0 * (1 - apart))
    steps = TRIAL_MAX_STEPS if close else TRIAL_STEPS
    assert TRIAL_STEPS < TRIAL_MAX_STEPS
    assert forms == [True, False] * steps + [False] * 2
    assert [len(ms) for ms in planner.trial.ms] == [steps, steps]
    assert f"in alternation, {steps} steps each" in planner.explain()
    planner.close()


def test_a_slow_stretch_of_the_host_does_not_decide_a_trial():
    """The host slows by 40 ms a step from the trial's sixth step on, so the reentrant form's
    median step (100 ms) is under the non-reentrant one's (137); but each non-reentrant step
    took 3 ms less than the reentrant step before it, but for the one where the slowdown began,
    and that form is kept: the median of those differences decides."""
    forms, planner = timed_form_trial(lambda k, reentrant: (100.0 if reentrant else 97.0) + 40.0 * (k >= 5))
    assert TRIAL_STEPS == 5  # the slowdown's start, above, is placed for it
    assert planner.trial.median(0) < planner.trial.median(1)
    assert planner.trial.gain_ms == pytest.approx(3.0)
    assert forms[-2:] == [False, False] and not planner.plan.reentrant
    assert "kept torch's non-reentrant checkpoint, 3.0 ms a step faster in the median of the 5 pairs" \
        in planner.explain()
    planner.close()


def test_a_trial_step_without_backward_is_run_again_so_its_pairs_stay_steps_run_one_after_the_other():
    """The non-reentrant form takes 3 ms less than the reentrant one at every moment while every
    step takes 2 ms more than the last; the alternative's first step runs its forward alone (a batch
    skipped after it). That step is not timed and the same plan runs next: each pair compared is of
    two steps run one after the other, and the faster form is kept."""
    clock = FakeClock()
    model, idx, ref, planner = traced_gpt_planner(clock, chooser=recompute_two)
    forms, k = [], 0
    while not planner.settled:
        assert k <= 2 * TRIAL_MAX_STEPS + 2, planner.explain()
        trying = planner.phase is Phase.TRY
        ctx = planner.step()
        if trying:
            forms.append(planner.plan.reentrant)
        if trying and k == 1:
            with ctx:
                model.loss(idx[:, :-1], idx[:, 1:])
        else:
            if trying:
                clock.now += ((100.0 if planner.plan.reentrant else 97.0) + 2.0 * k) / 1e3
            grads_of(model, idx, ctx)
        k += trying
    assert forms[:4] == [True, False, False, True]  # the skipped alternative's step runs again
    assert planner.trial.gain_ms == pytest.approx(1.0)  # 3 ms faster, 2 ms later: the adjacent pairs
    assert not planner.plan.reentrant
    planner.close()


def test_no_form_trial_where_the_user_asked_for_the_non_reentrant_form():
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.05, mode="embedded", min_bytes=0, reentrant=False,
                         clock=FakeClock())  # its packs' host time then does not depend on a busy machine
    for _ in range(4):  # the traces, and two planned steps: the plan offloads inputs, its packs are read
        grads_of(model, idx, planner.step())
    assert planner.plan.recomputed and not planner.plan.reentrant
    assert planner.settled and not planner.trials
    planner.close()


def test_the_alternative_a_trial_keeps_is_the_plan_as_measured(monkeypatch):
    """A trial measures the alternative's first step against the target; where it keeps the
    alternative, the plan in force is that measured plan (it fits and ranks by it), and explain()
    says its measured peak: it put in force the unmeasured copy ('this one not yet'), beside the
    peak the plan before had measured."""
    from planner_fakes import MiB, ScriptedMemory
    from storm import mover
    from storm.planner.measure import HOST_CHECK_STEP

    clock = FakeClock()
    put = mover.Mover.put

    def slower(*args, **kwargs):
        clock.now += 0.02
        return put(*args, **kwargs)

    memory = ScriptedMemory(extra=0)
    model, idx = gpt()
    planner = memory.planner = storm.Planner(model.blocks, peak="200MiB", memory=memory, clock=clock,
                                             chooser=by_kind(1 << 20), form_trial=False,
                                             host_check_tolerance=float("inf"), mode="embedded", min_bytes=0)
    for _ in range(3):  # the offload trace and, with peak=, two compute traces
        grads_of(model, idx, planner.step())
    monkeypatch.setattr(mover.Mover, "put", slower)  # offloading is the slower kind: the trial keeps the other
    for _ in range(HOST_CHECK_STEP + 2 * TRIAL_STEPS + 2):
        grads_of(model, idx, planner.step())
    assert planner.trial is not None and planner.trial.kept is planner.plan and not planner.plan.offloads
    assert planner.plan.measured_over is not None and planner.plan.fits
    text = planner.explain()
    assert "this one not yet" not in text
    assert f"measured: step peak {planner.measured_peak / MiB:.1f} MiB" in text
    assert planner.measured_peak == planner.target + planner.plan.measured_over
    planner.close()
