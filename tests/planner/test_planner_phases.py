"""The planner's phases where a step does not run as planned: a step whose backward never reached
the blocks (a batch skipped after its forward), a step begun and never entered, a re-plan from
the host check in the same step as one from the peak, and a full offload kept. Each case is a
defect a review found (phases.py, driver.py)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from test_planner_measure import RecomputedFullFits

import storm
import storm.session as session_mod
from planner_fakes import FakeClock, MiB, ScriptedMemory, gpt, grads_of, predicted_peak
from storm import mover
from storm.examples.models import same_bits
from storm.planner import Phase, Plan, Scenario


def forward_only(model, idx, ctx) -> None:
    """A step whose backward never runs: its batch is skipped after its forward."""
    with ctx:
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    del loss


@pytest.mark.parametrize("target", [{"peak": "60MiB"}, {"budget": 0.5}])
def test_a_compute_trace_whose_backward_never_ran_is_traced_again_and_disable_leaves_no_hook(target):
    """peak= and budget= need what a step holds besides its saves, read as backward passes the
    blocks (every step's target is made with it): a compute trace without backward read nothing,
    so the next step traces again (before: with peak= the plan was made without it and asserted;
    with budget= no step was measured for the trace's life); and storm.enable's disable() after
    such a step takes every hook off."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    memory = ScriptedMemory(extra=0)
    planner = memory.planner = storm.Planner(model.blocks, **target, memory=memory, form_trial=False,
                                             mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())  # the offload trace
    forward_only(model, idx, planner.step())  # the compute trace, skipped
    assert not planner.settled and planner.phase is Phase.TRACE_COMPUTE and planner.besides is None
    for _ in range(3):
        assert all(same_bits(a, b) for a, b in zip(ref, grads_of(model, idx, planner.step())))
    assert planner.besides is not None and planner.plan is not None
    planner.close()

    model = gpt()[0]
    memory = ScriptedMemory(extra=0)
    handle = storm.enable(model, peak="60MiB", memory=memory, mode="embedded", min_bytes=0)
    memory.planner = handle.planner
    grads_of(model, idx)  # the offload trace
    model.loss(idx[:, :-1], idx[:, 1:])  # the compute trace's forward; training stops here
    handle.disable()
    assert not [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m)]
    storm.enable(model, mode="embedded").disable()  # the model is no longer STORM's


def offloading(trace, k: int, held: int = 1 << 30) -> Plan:
    """Offload blocks[:k], predicted to fit."""
    return Plan(offloaded=k, recomputed=frozenset(), offload_budget=trace.offloaded_before[k], max_held_bytes=held,
                prefetch_bytes=0, predicted_peak=predicted_peak(trace, k, set(), 0), predicted_cost_ms=0.0, fits=True)


def recomputing(trace, n: int = 4) -> Plan:
    """Recompute blocks[:n], nothing offloaded, predicted to fit."""
    rec = frozenset(range(n))
    return Plan(offloaded=0, recomputed=rec, offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                predicted_peak=predicted_peak(trace, 0, rec, 0), predicted_cost_ms=1.0, fits=True)


def fixed_offload(s: Scenario) -> Plan:
    """Offload 2 blocks until offloading plans carry a margin, then recompute 4 (as
    test_planner_measure.scripted_planner's)."""
    return offloading(s.trace, 2) if s.offload_margin <= 0 else recomputing(s.trace)


def test_a_measured_step_whose_backward_never_ran_is_measured_by_the_next():
    """The first planned step is skipped after its forward: its peak was not read, so it is no
    check (before: the plan settled unmeasured, 70 MiB over its target); the next step measures
    the plan, finds it over and plans again, as without the skipped step."""
    model, idx = gpt()
    memory = ScriptedMemory()
    planner = memory.planner = storm.Planner(model.blocks, budget=0.9, mode="embedded", min_bytes=0, memory=memory,
                                             chooser=fixed_offload, form_trial=False,
                                             host_check_tolerance=float("inf"))
    for _ in range(2):
        grads_of(model, idx, planner.step())
    assert not planner.settled and planner.phase is Phase.MEASURE and planner.plan.offloaded == 2
    forward_only(model, idx, planner.step())
    assert not planner.settled and planner.checks == 0 and planner.phase is Phase.MEASURE
    for _ in range(4):
        grads_of(model, idx, planner.step())
    assert planner.settled and planner.plan.offloaded == 0  # the offloading plan measured over: recompute
    assert any(p.offloaded == 2 and p.measured_over > 0 for p in planner.state.measured.values())
    planner.close()


def offload_two_or_three(s: Scenario) -> Plan:
    return offloading(s.trace, 2 if s.offload_margin <= 0 else 3)


def test_a_step_that_replans_from_its_peak_and_its_host_time_plans_once_and_keeps_the_fitting_full_offload():
    """The host check's step (its packs dearer than traced) is also a measured step over its target:
    the plan is made once, with the dearer host time (before: twice, and the second skipped the full
    offload over recomputed blocks that the first had put in force, which fits here)."""
    model, idx = gpt()
    memory = RecomputedFullFits(cost=0)
    memory.extra = 500 * MiB
    planner = memory.planner = storm.Planner(model.blocks, peak="60MiB", memory=memory, chooser=offload_two_or_three,
                                             form_trial=False, host_check_tolerance=0.0, clock=FakeClock(),
                                             mode="embedded", min_bytes=0)
    for _ in range(40):
        if planner.settled:
            break
        grads_of(model, idx, planner.step())
    kept = planner.plan
    assert planner.settled and kept.full and kept.recomputed and kept.fits
    assert len(planner.state.full_tried) == 1
    planner.close()


def recompute_only(s: Scenario) -> Plan:
    """Plans of the blocks that offload nothing, predicted not to fit, the least recompute first."""
    n = len(s.trace.blocks)
    for k in range(n, 0, -1):
        plan = Plan(offloaded=0, recomputed=frozenset(range(n - k, n)), offload_budget=0, max_held_bytes=0,
                    prefetch_bytes=0, predicted_peak=10**12 - k, predicted_cost_ms=float(k), fits=False)
        if plan.shape not in s.measured:
            return plan
    return plan


def test_a_kept_full_offload_is_not_tried_against_its_other_recompute_form():
    """A full offload's room would profile again for the other form's saves inside the trial's
    timed steps: it gets no form trial, even where the host check makes the plan again."""
    model, idx = gpt()
    memory = RecomputedFullFits(cost=50 * MiB)
    planner = memory.planner = storm.Planner(model.blocks, peak="1MiB", memory=memory, chooser=recompute_only,
                                             host_check_tolerance=0.0, clock=FakeClock(), mode="embedded",
                                             min_bytes=0)
    for _ in range(40):
        if planner.settled:
            break
        grads_of(model, idx, planner.step())
    assert planner.settled and planner.plan.full and planner.plan.reentrant
    assert not any(p.full for t in planner.trials for p in t.plans)
    planner.close()


def test_a_step_begun_and_never_entered_does_not_count_towards_the_host_check(monkeypatch):
    """The host check reads the HOST_CHECK_STEP-th planned step that offloads: one begun and never
    entered (a batch skipped after step()) timed no pack, and is not counted (before: the check was
    lost when it was that step, and packs 40 times dearer than traced never planned again)."""
    clock = FakeClock()
    monkeypatch.setattr(session_mod, "time", types.SimpleNamespace(perf_counter=clock.host))

    def by_host_cost(s: Scenario) -> Plan:
        if s.trace.host_ms_per_tensor <= 10.0:
            return Plan(offloaded=2, recomputed=frozenset(), offload_budget=s.trace.offloaded_before[2],
                        max_held_bytes=1 << 30, prefetch_bytes=0, predicted_peak=1 << 40, predicted_cost_ms=0.0,
                        fits=True)
        return Plan(offloaded=0, recomputed=frozenset({0, 1}), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=1 << 40, predicted_cost_ms=1.0, fits=True)

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(),
                            chooser=by_host_cost, form_trial=False)
    for _ in range(2):
        grads_of(model, idx, planner.step())  # the traces: packs cost nothing
    put = mover.Mover.put

    def slow(self, req):
        clock.now += 0.020
        return put(self, req)

    monkeypatch.setattr(mover.Mover, "put", slow)  # planned steps' packs: 20 ms each
    for step in range(5):
        ctx = planner.step()
        if step == 1:
            continue  # begun, never entered
        grads_of(model, idx, ctx)
    assert planner.traced_host_ms_per_tensor is not None and planner.plan.offloaded == 0
    planner.close()


def test_a_larger_evaluation_forward_at_the_host_check_is_not_read_as_its_step(monkeypatch):
    """The planned step the host check reads is a grad-enabled evaluation of a batch four times
    larger, with no backward: no step to plan for, so the check reads the next training step
    (before: the evaluation's dearer packs, a pack's host time growing with its bytes here, became
    the trace's host time per tensor)."""
    clock = FakeClock()
    monkeypatch.setattr(session_mod, "time", types.SimpleNamespace(perf_counter=clock.host))
    put = mover.Mover.put

    def by_bytes(self, req):  # a pack's host time grows with its bytes
        clock.now += 1e-6 + req.source.nbytes() * 1e-11
        return put(self, req)

    monkeypatch.setattr(mover.Mover, "put", by_bytes)

    def offload_2(s: Scenario) -> Plan:
        t = s.trace
        return Plan(offloaded=2, recomputed=frozenset(), offload_budget=t.offloaded_before[2], max_held_bytes=1 << 30,
                    prefetch_bytes=0, predicted_peak=predicted_peak(t, 2, set(), 0), predicted_cost_ms=0.0, fits=True)

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.9, mode="embedded", min_bytes=0, chooser=offload_2,
                            form_trial=False, clock=FakeClock())
    while planner.phase is not Phase.CHECK_HOST:
        grads_of(model, idx, planner.step())
        planner.settled  # reads the step
    grads_of(model, idx, planner.step())  # the first planned step: it warms up
    evaluation = torch.randint(0, 256, (32, 65))
    with planner.step():
        model.loss(evaluation[:, :-1], evaluation[:, 1:]).item()  # grad enabled, no backward
    assert not planner.settled and planner.phase is Phase.CHECK_HOST  # read: not the check's step
    grads_of(model, idx, planner.step())  # the check's step
    assert planner.settled and planner.replans == 0 and planner.traced_host_ms_per_tensor is None
    planner.close()


def other_kind(s: Scenario) -> Plan:
    """Offload 2 blocks (a new queue as the margin widens, so that each is measured), and as the
    alternative of the other kind, recompute 4; both predicted to fit."""
    return recomputing(s.trace) if s.offload is False else offloading(s.trace, 2, (1 << 30) + s.offload_margin)


class RecomputeOver(ScriptedMemory):
    """Plans that offload nothing peak 200 MiB over what the model says."""

    def peak(self) -> int:
        p = self.planner.plan
        return super().peak() + (200 * MiB if p is not None and not p.offloads else 0)


def test_a_trials_alternative_is_measured_by_its_first_step_with_a_backward_and_kept_only_within_its_target():
    """The alternative's first step is skipped after its forward: the next of its steps is the one
    measured (before: none was, and the faster alternative was kept 200 MiB over its target)."""
    clock = FakeClock()
    model, idx = gpt()
    memory = RecomputeOver(extra=0)
    planner = memory.planner = storm.Planner(model.blocks, budget=0.9, mode="embedded", min_bytes=0, memory=memory,
                                             chooser=other_kind, form_trial=False,
                                             host_check_tolerance=float("inf"), clock=clock)
    skipped = False
    for _ in range(40):
        if planner.settled:
            break
        trying = planner.phase is Phase.TRY
        turn = planner.trying.turn if trying else None
        ctx = planner.step()
        clock.now += 0.010 if planner.plan is None or planner.plan.offloads else 0.001  # the alternative is faster
        if trying and turn == 1 and not skipped:  # once: an untimed step's plan runs again, at the same turn
            forward_only(model, idx, ctx)
            skipped = True
        else:
            grads_of(model, idx, ctx)
    trial = planner.trial
    assert skipped and planner.settled and trial.alternative_read and trial.over is not None
    assert trial.kept is trial.plans[0] and planner.plan.offloads
    planner.close()


def test_a_trial_keeps_the_alternative_measured_within_its_target_where_the_plan_measured_over():
    """Every offloading plan measures over its target (the least measured is kept); in the trial,
    the alternative measures within it: kept, though not faster (before: the plan over it stayed).
    On a clock standing still (neither plan faster) its account, which explain() prints, names the
    alternative as kept and why (before: "kept offload 2 blocks: neither was faster", while the plan
    in force recomputed 4 blocks)."""
    model, idx = gpt()
    memory = ScriptedMemory(extra=500 * MiB)
    planner = memory.planner = storm.Planner(model.blocks, budget=0.9, mode="embedded", min_bytes=0, memory=memory,
                                             chooser=other_kind, form_trial=False,
                                             host_check_tolerance=float("inf"), clock=FakeClock())
    for _ in range(40):
        if planner.settled:
            break
        grads_of(model, idx, planner.step())
    trial = planner.trial
    assert planner.settled and trial.plans[0].measured_over > 0 and trial.over is None and trial.alternative_read
    assert trial.kept is trial.plans[1] and not planner.plan.offloads and trial.gain_ms == 0
    said = trial.describe()
    assert "kept recompute 4 blocks" in said and "kept offload 2 blocks" not in said, said
    assert "offload 2 blocks measured" in said and "over its target" in said, said
    assert said in planner.explain()
    planner.close()


def test_a_compute_trace_of_smaller_inputs_is_not_read_and_of_larger_ones_traces_again():
    """The compute trace's block 0 takes a batch of 1 where the offload trace's took 64: its
    recompute times are not the traced step's, so the step is not read and the compute trace runs
    again (before: the planner traced again, from that batch of 1); a batch of 128 there traces
    again (before: likewise), for at least 128."""
    model, idx = gpt()
    big = torch.randint(0, 256, (64, 65))
    ref = grads_of(copy.deepcopy(model), big)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, form_trial=False)
    grads_of(model, big, planner.step())  # the offload trace, batch 64
    grads_of(model, big[:1], planner.step())  # the compute trace, batch 1: not read
    assert not planner.settled  # reads the step
    assert planner.replans == 0 and planner.phase is Phase.TRACE_COMPUTE and planner.smaller_steps == 1
    for _ in range(2):
        assert all(same_bits(a, b) for a, b in zip(ref, grads_of(model, big, planner.step())))
    assert planner.replans == 0 and planner.plan is not None
    grads_of(model, torch.cat([big, big]), planner.step())
    assert not planner.settled and planner.phase is Phase.TRACE_OFFLOAD
    planner.step()
    assert planner.replans == 1 and planner.smaller_steps == 0
    planner.close()

