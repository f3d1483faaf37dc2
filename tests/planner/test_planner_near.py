"""With peak=, a cheaper plan the model predicts a little over the target is measured once a plan
within it has been (Planner.near_plan, measure.near_slack): at a cap as tight as no offload's own
peak, a model a MiB long would otherwise never measure the plan that fits, and keep a slower one.
Peaks are scripted (``memory=``), as the planner's other measuring tests do; the chooser allows
only plans that do not offload, so that no trial times steps on the host."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import storm
from planner_fakes import MiB, ScriptedMemory, gpt, grads_of, trace
from storm.examples.models import same_bits
from storm.planner import Phase, Plan, Scenario, choose
from storm.planner.measure import NEAR_SHARE, near_slack
from storm.planner.phases import UNREAD_STEPS

OPTIONS: dict[str, Any] = {"mode": "embedded", "min_bytes": 0, "form_trial": False,
                           "host_check_tolerance": float("inf")}


def keeping(s: Scenario) -> Plan | None:
    """choose(), of the plans that offload nothing."""
    return None if s.offload else choose(dataclasses.replace(s, offload=False))


class Long(ScriptedMemory):
    """The model is ``long`` bytes over every planned step's measured peak, with ``recomputing``
    only over those of plans that recompute (the compute traces read as the model predicts them)."""

    def __init__(self, long: int, recomputing: bool = False) -> None:
        super().__init__(extra=0)
        self.long, self.recomputing = long, recomputing

    def peak(self) -> int:
        p = self.planner.plan
        long = p is not None and (bool(p.recomputed) or not self.recomputing)
        return super().peak() - self.long * long


def keep_all_peak() -> int:
    """What the model predicts a step that keeps every block peaks at, besides included, on the CPU GPT."""
    model, idx = gpt()
    memory = ScriptedMemory(extra=0)
    probe = memory.planner = storm.Planner(model.blocks, peak="1GiB", memory=memory, chooser=keeping, **OPTIONS)
    for _ in range(4):
        grads_of(model, idx, probe.step())
    keep = dataclasses.replace(probe.plan, recomputed=frozenset())
    peak = probe.besides + probe.step_peak(keep)
    probe.close()
    return peak


def planned(peak: int, memory: ScriptedMemory, steps: int = 8) -> storm.Planner:
    """A planner at ``peak`` over the CPU GPT, ``steps`` steps run, each bit-exact."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = memory.planner = storm.Planner(model.blocks, peak=peak, memory=memory, chooser=keeping, **OPTIONS)
    for _ in range(steps):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    return planner


def keeps_all(p: Plan) -> bool:
    return not p.offloaded and not p.recomputed and not p.inputs_offloaded


def test_near_slack_is_what_the_model_was_long_by_up_to_a_share_of_the_target():
    assert near_slack(1000 * MiB, 3 * MiB) == 3 * MiB
    assert near_slack(1000 * MiB, 30 * MiB) == 1000 * MiB // NEAR_SHARE
    assert near_slack(1000 * MiB, 0) == near_slack(1000 * MiB, -MiB) == 0  # exact or short: nothing to measure


def test_a_plan_predicted_just_over_the_cap_is_measured_and_kept_where_it_fits(caplog):
    """The cap is no offload's peak less a little, and the model is long by more than that: the
    plan that recomputes what the prediction needs fits; keeping every block, predicted over by
    less than the model was measured long by, is measured next, fits, and is kept."""
    top = keep_all_peak()
    short = top // 400
    with caplog.at_level(logging.INFO, logger="storm"):
        planner = planned(top - short, Long(long=2 * short))
    first, kept = list(planner.state.measured.values()), planner.plan
    assert len(first) == 2 and first[0].recomputed and keeps_all(first[1])
    assert keeps_all(kept) and kept.fits and kept.measured_over == -short
    assert planner.settled and planner.checks == 2
    assert any("measuring a cheaper plan predicted" in r.getMessage() for r in caplog.records)
    planner.close()


def test_a_plan_predicted_further_over_than_the_model_may_miss_by_is_not_measured():
    """Keeping every block predicted over the cap by more than the model was long by, and, with the
    model far longer, by more than a share of the cap (measure.NEAR_SHARE): the plan that fits
    stays, the only one measured."""
    top = keep_all_peak()
    for short, long in ((top // 400, top // 1600), (top // 40, top // 10)):
        assert short > min(long, (top - short) // NEAR_SHARE)
        planner = planned(top - short, Long(long=long))
        (first,) = planner.state.measured.values()
        assert first.recomputed and planner.plan.shape == first.shape and planner.settled and planner.checks == 1
        planner.close()


def test_a_near_plan_measured_over_gives_way_to_the_plan_measured_within_and_sets_no_margin():
    """The model long on plans that recompute and exact where every block is kept, predicted (and
    measured) a little over the cap: it is measured once, over, and the plan measured within
    stays, with no margin for plans of its kind (the model was not short)."""
    top = keep_all_peak()
    planner = planned(top - top // 400, Long(long=top // 200, recomputing=True))
    first, near = planner.state.measured.values()
    assert keeps_all(near) and not near.fits and near.measured_over == top // 400
    assert planner.plan.shape == first.shape and first.fits
    assert planner.margins == {False: 0, True: 0} and planner.settled and planner.checks == 2
    planner.close()


def test_a_near_plan_whose_step_never_reaches_backward_is_not_kept():
    """Steps of forward alone while the near plan is in force read no peak: after as many as the
    planner waits for, the plan measured within comes back, and the near plan is never settled on."""
    top = keep_all_peak()
    model, idx = gpt()
    memory = Long(long=top // 200)
    planner = memory.planner = storm.Planner(model.blocks, peak=top - top // 400, memory=memory, chooser=keeping,
                                             **OPTIONS)
    for _ in range(6):  # the traces, the plan within
        grads_of(model, idx, planner.step())
        if not planner.settled and planner.phase is Phase.MEASURE_NEAR:  # settled reads the step
            break
    assert keeps_all(planner.plan) and not planner.plan.fits
    assert "measures a cheaper plan predicted a little over the target" in planner.explain()
    for _ in range(UNREAD_STEPS + 1):
        with planner.step():
            model.loss(idx[:, :-1], idx[:, 1:])  # no backward
    ctx = planner.step()  # reads the last of them
    first = next(iter(planner.state.measured.values()))
    assert planner.plan.shape == first.shape and first.recomputed and first.fits
    assert [keeps_all(p) for p in planner.state.measured.values()] == [False]
    grads_of(model, idx, ctx)
    assert planner.settled and planner.plan.shape == first.shape
    planner.close()


def test_choose_ranks_a_measured_plan_its_recompute_rule_never_makes_by_its_measure():
    """At a budget a little under keeping every block, choose() recomputes a block; keeping every
    block measured within its target, it keeps every block (cost 0) and says so by the measure."""
    t = trace(n=4)
    keep = choose(Scenario(t, 1 << 40))
    assert keeps_all(keep)
    s = Scenario(t, keep.predicted_peak - 1, offload=False)
    chosen = choose(s)
    assert chosen.recomputed and chosen.fits and chosen.predicted_cost_ms > 0
    measured = choose(dataclasses.replace(s, measured={keep.shape: -1}))
    assert measured.shape == keep.shape and measured.fits and measured.measured_over == -1
    assert measured.predicted_cost_ms == 0 and measured.predicted_peak == keep.predicted_peak
    over = choose(dataclasses.replace(s, measured={keep.shape: 1}))  # measured over: as before
    assert over.shape == chosen.shape
