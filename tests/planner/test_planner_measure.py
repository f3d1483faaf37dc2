"""What the planner measures and makes of it: which storages a frame codec frames, a step's
peak (the CUDA allocator's, scripted here through ``memory=``) against its target, margins that
correct the plan, kept_extra, and a planned step's dearer packs replacing the traced host time."""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

import storm
from planner_fakes import MiB, ScriptedMemory, gpt, grads_of, pack_clock, traced_gpt_planner
from storm.examples.models import same_bits
from storm.kernels.bits_frame import bits_frame_nbytes
from storm.kernels.float32_frame import float32_frame_nbytes
from storm.kernels.frame import frame_nbytes
from storm.planner import Phase, Plan, Scenario, choose, frames_of, moments, predicted_peak
from storm.planner.measure import MAX_CHECKS, MAX_SEARCH


def test_the_mover_frames_cuda_bf16_bool_and_float32_storages_of_at_least_4_mib():
    cuda, cpu, bf16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
    saves = [SimpleNamespace(device=d, dtype=t, nbytes=n) for d, t, n in [
        (cuda, bf16, 4 * MiB), (cuda, bf16, 64 * MiB), (cuda, torch.bool, 8 * MiB),  # framed
        (cuda, torch.float32, 8 * MiB),                                             # framed, as codec auto does
        (cuda, bf16, 4 * MiB - 2), (cuda, torch.float16, 8 * MiB), (cpu, bf16, 8 * MiB)]]
    assert frames_of(saves) == (4, 84 * MiB, frame_nbytes(2 * MiB) + frame_nbytes(32 * MiB) + bits_frame_nbytes(8 * MiB)
                                + float32_frame_nbytes(8 * MiB))
    assert frames_of(saves, "ancf_exp") == (2, 68 * MiB, frame_nbytes(2 * MiB) + frame_nbytes(32 * MiB))  # bf16 alone
    assert frames_of([]) == (0, 0, 0)


def scripted_planner(memory: ScriptedMemory | None = None, **kw: Any) -> tuple[Any, torch.Tensor, storm.Planner,
                                                                               ScriptedMemory]:
    """A planner on the CPU GPT whose steps' peaks ``memory`` reports (a ScriptedMemory), and whose
    choice is fixed: offload the first 2 blocks unless offloading plans carry a margin, then
    recompute 4. No form trial, which would add its steps after these tests' last."""
    def fixed(s: Scenario) -> Plan:
        trace = s.trace
        if s.offload_margin <= 0:
            return Plan(offloaded=2, recomputed=frozenset(), offload_budget=trace.offloaded_before[2],
                        max_held_bytes=1 << 30, prefetch_bytes=0, predicted_peak=predicted_peak(trace, 2, set(), 0),
                        predicted_cost_ms=0.0, fits=True)
        rec = frozenset(range(4))
        return Plan(offloaded=0, recomputed=rec, offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=predicted_peak(trace, 0, rec, 0), predicted_cost_ms=1.0, fits=True)

    memory = memory or ScriptedMemory()
    model, idx = gpt()
    # these tests follow the peak: a host check set off by a loaded CPU's pack times would plan again
    planner = storm.Planner(model.blocks, mode="embedded", min_bytes=0, memory=memory, chooser=fixed,
                            form_trial=False, host_check_tolerance=float("inf"), **kw)
    memory.planner = planner
    return model, idx, planner, memory


def test_a_step_measured_over_its_target_plans_again_with_a_margin():
    model, idx, planner, memory = scripted_planner(budget=0.9)
    ref = grads_of(copy.deepcopy(model), idx)
    for _ in range(3):
        got = grads_of(model, idx, planner.step())
    assert planner.besides == memory.besides  # from the compute trace
    # the planned step's, read as backward reached each block and as it ended: not between steps
    assert memory.reads == 2 * (len(model.blocks) + 1)
    first = planner.plan
    assert first.offloaded == 2
    assert not planner.settled  # reading the first plan's measured step finds it over its target ...
    assert planner.measured_peak == planner.besides + memory.extra + predicted_peak(
        planner.trace, first.offloaded, first.recomputed, first.in_flight_bytes, kept_extra=planner.kept_extra)
    # ... by `extra`: offloading plans get a margin, and the next plan recomputes
    assert planner.margins[True] >= memory.extra and planner.margins[False] == 0
    ctx = planner.step()
    assert planner.plan.offloaded == 0 and planner.plan.recomputed == frozenset(range(4))
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == set(range(4))
    got = grads_of(model, idx, ctx)
    assert planner.settled  # measured within its target: no more measuring
    assert planner.measured_peak <= planner.target
    assert memory.starts == 3  # the compute trace and the two planned steps measured, no more
    grads_of(model, idx, planner.step())
    assert memory.starts == 3 and planner.settled
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert "measured: step peak" in planner.explain() and "after 2 measured steps" in planner.explain()
    planner.close()


def test_peak_is_the_target_and_the_besides_come_off_it():
    model, idx, planner, memory = scripted_planner(ScriptedMemory(extra=0), peak="60MiB")
    for _ in range(4):  # with peak=, the compute trace runs twice, with and without the hand-over
        grads_of(model, idx, planner.step())
    assert planner.saved_budget == 60 * MiB - memory.besides
    assert planner.target == 60 * MiB
    assert not planner.settled  # until a second offloading step's host time is read
    # within the target at the first measure: no more measuring, the host check next
    assert planner.phase is Phase.CHECK_HOST and planner.plan.offloaded == 2
    grads_of(model, idx, planner.step())
    assert planner.settled
    assert "peak 60.0 MiB above the step's start" in planner.explain()
    planner.close()


def test_kept_blocks_backward_is_planned_with_what_it_holds_more():
    """Autograd keeps a kept block's saves until each node that saved them ends, where Recompute
    hands a recomputed block's over as the node takes them (on a GPU a plan that kept its first
    blocks went over its cap without counting it). The second compute trace,
    without the hand-over, measures the difference, and plans count it at kept blocks'
    backward: at a peak where the plan that leaves it out would go over, the planner takes one
    that does not, and its steps stay within the target."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    options = {"mode": "embedded", "min_bytes": 0, "pool_size": "64KiB"}  # plans offload almost nothing
    memory = ScriptedMemory(extra=0)
    probe = memory.planner = storm.Planner(model.blocks, peak="1GiB", memory=memory, form_trial=False, **options)
    for _ in range(3):
        grads_of(model, idx, probe.step())
    t = probe.trace
    probe.close()
    extra = t.blocks[0].saved_bytes // 2

    def over(b: int) -> bool:  # the plan that leaves the extra out goes over b with it
        blind = choose(Scenario(t, b, grads=True))
        return predicted_peak(t, blind.offloaded, blind.recomputed, blind.in_flight_bytes, kept_extra=extra) > b

    budget = next(b for b in range(t.total_bytes, 0, -MiB // 8)
                  if over(b) and choose(Scenario(t, b, grads=True, kept_extra=extra)).fits)
    blind = choose(Scenario(t, budget, grads=True))
    memory = ScriptedMemory(extra=0, kept_extra=extra)
    planner = memory.planner = storm.Planner(model.blocks, peak=budget + memory.besides, memory=memory,
                                             form_trial=False, **options)
    for _ in range(5):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.kept_extra == extra and planner.besides == memory.besides
    assert planner.plan == choose(Scenario(planner.trace, budget, grads=True, kept_extra=extra)) != blind
    assert planner.settled and planner.checks == 1 and planner.measured_peak <= planner.target
    assert f"and {extra / MiB:.1f} more while a kept block's backward runs" in planner.explain()
    planner.close()


def test_backward_start_is_measured_apart_so_offloading_inputs_goes_below_checkpointing():
    """A language model's loss and head hold the logits' gradients as backward starts: there the
    step peaks, above any block's backward (W3 on a lent H100). The planner measures that moment
    apart from the blocks' backward; with one figure for the whole step it counted the logits at
    every block's backward, where offloading recomputed blocks' inputs lowers nothing, and found
    no plan below checkpointing's peak. Here a peak between checkpointing's and what offloading
    every block's input reaches is met by a plan that does, and its steps stay within it."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    options = {"mode": "embedded", "min_bytes": 0}
    probe = storm.Planner(model.blocks, budget=0.5, **options)
    for _ in range(2):
        grads_of(model, idx, probe.step())
    t = probe.trace
    probe.close()
    n, every = len(t.blocks), set(range(len(t.blocks)))
    held = moments(t, 0, every, 0, grads=True)
    inputs = sum(b.input_bytes for b in t.blocks)
    start_extra = max(held[:-1]) - held[-1] + 2 * inputs  # backward's start is the step's peak by far
    memory = ScriptedMemory(extra=0, start_extra=start_extra)
    checkpointing = memory.besides + held[-1] + start_extra
    cap = checkpointing - inputs // 2
    planner = memory.planner = storm.Planner(model.blocks, peak=cap, memory=memory, form_trial=False, **options)
    for _ in range(6):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.besides == memory.besides and planner.start_extra == start_extra
    p = planner.plan
    assert p.fits and p.inputs_offloaded > 0 and p.recomputed == frozenset(range(n)) - set(range(p.offloaded))
    assert planner.measured_peak <= cap < checkpointing
    assert f"{start_extra / MiB:+.1f} at backward's start" in planner.explain()
    planner.close()


class OneFigure(ScriptedMemory):
    """A memory= without restart(): the peak of the whole step, as before the planner split it."""

    restart = None

    def peak(self) -> int:
        reads = []
        for at in [None, *range(len(self.planner.hooks.blocks))]:
            self.at = at
            reads.append(super().peak())
        return max(reads)


def test_a_memory_without_restart_gives_one_figure_for_the_step():
    memory = OneFigure(extra=0, start_extra=8 * MiB)
    model, idx = gpt()
    planner = memory.planner = storm.Planner(model.blocks, peak="1GiB", memory=memory, form_trial=False,
                                             mode="embedded", min_bytes=0)
    for _ in range(4):
        grads_of(model, idx, planner.step())
    every = set(range(len(model.blocks)))
    with_extra, model_held = (moments(planner.trace, 0, every, 0, grads=True, start_extra=e) for e in (8 * MiB, 0))
    assert planner.start_extra == 0  # the whole step's extra is counted at every moment
    assert planner.besides == memory.besides + max(with_extra) - max(model_held)
    assert planner.plan is not None
    planner.close()


class AlwaysOver(ScriptedMemory):
    """Every measured planned step far over, whatever it does."""

    def peak(self) -> int:
        return super().peak() + (10**12 if self.planner.plan else 0)


def test_a_plan_chosen_again_after_its_step_went_over_gives_way_to_the_least_measured(caplog):
    model, idx, planner, _ = scripted_planner(AlwaysOver(), budget=0.9)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(8):
            grads_of(model, idx, planner.step())
    # the fixed chooser's second plan, measured over too, is chosen again: of the two, the least measured stays
    assert planner.settled and planner.checks == 2
    assert any("the one of least measured peak is kept" in r.getMessage() for r in caplog.records)
    overs = [p.measured_over for p in planner.state.measured.values()]
    assert len(overs) == 2 and planner.plan.measured_over == min(overs)  # the fixed chooser's two plans
    planner.close()


class KeepingCostsMore(ScriptedMemory):
    """Each block whose saves or inputs a plan keeps on the device adds ``cost`` to its step's
    peak beyond what the model predicts (as where a kept tensor's storage is larger than the
    trace saw): the plan the model predicts lowest here, every block recomputed and nothing
    offloaded, measures highest."""

    def __init__(self, cost: int) -> None:
        super().__init__(extra=0)
        self.cost = cost

    def peak(self) -> int:
        p = self.planner.plan
        kept = len(self.planner.trace.blocks) - p.offloaded - p.inputs_offloaded if p is not None else 0
        return super().peak() + self.cost * kept


class FullCostsMore(KeepingCostsMore):
    """As KeepingCostsMore, and full offload's steps peak ``full`` over everything measured before."""

    def __init__(self, cost: int, full: int) -> None:
        super().__init__(cost)
        self.full = full

    def peak(self) -> int:
        p = self.planner.plan
        return super().peak() + (self.full if p is not None and p.full else 0)


class RecomputedFullFits(KeepingCostsMore):
    """As KeepingCostsMore, and full offload over every block recomputed peaks at nothing: within any target."""

    def peak(self) -> int:
        p = self.planner.plan
        return 0 if p is not None and p.full and p.recomputed else super().peak()


def no_plan_fits(memory: ScriptedMemory, caplog: Any, chooser: Any = choose,
                 steps: int = 20, **seams: Any) -> tuple[storm.Planner, list[Plan]]:
    """A peak below anything a plan reaches, on the CPU GPT, ``steps`` steps each bit-exact against
    training without STORM; the planner (with the other ``seams`` given), settled, and its measured
    plans in the order measured."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = memory.planner = storm.Planner(model.blocks, peak="1MiB", memory=memory, chooser=chooser,
                                             form_trial=False, host_check_tolerance=float("inf"), mode="embedded",
                                             min_bytes=0, **seams)
    with caplog.at_level(logging.INFO, logger="storm"):
        for _ in range(steps):
            got = grads_of(model, idx, planner.step())
            assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.settled
    return planner, list(planner.state.measured.values())


def full_kinds(measured: list[Plan]) -> list[str | None]:
    """Per measured plan: None for a plan of the blocks, else which full offload."""
    return [None if not p.full else "recomputed" if p.recomputed else "full" for p in measured]


def test_where_no_plan_fits_the_lowest_are_measured_in_turn_then_full_offload_and_the_least_measured_is_kept(caplog):
    """The planner measures the plans of least peak in turn (each measured one ranks by its
    measure, not its prediction), then full offload over every block recomputed and full offload
    alone, each over the steps its room takes to settle, and keeps the least measured: here a
    full offload, which keeps nothing on the device."""
    memory = KeepingCostsMore(cost=50 * MiB)
    planner, measured = no_plan_fits(memory, caplog)
    assert planner.checks == MAX_SEARCH > MAX_CHECKS  # a deeper search than corrections'
    assert full_kinds(measured) == [None] * MAX_SEARCH + ["recomputed", "full"] and not any(p.fits for p in measured)
    assert measured[-2].recomputed == frozenset(range(len(planner.blocks))) and not measured[-1].recomputed
    lowest_predicted = choose(dataclasses.replace(planner.scenario(), measured={}))
    assert measured[0].shape == lowest_predicted.shape  # the model's lowest, measured first
    kept = planner.plan
    assert kept.full and kept.measured_over == min(p.measured_over for p in measured)
    assert planner.measured_peak == measured[-1].measured_over + planner.target  # the last one's settled room
    assert any("measuring full offload over every block recomputed" in r.getMessage() for r in caplog.records)
    assert any("keeping the plan of least measured peak (full offload)" in r.getMessage() for r in caplog.records)
    text = planner.explain()
    assert "full offload: every save is offloaded" in text
    assert "predicted: nothing of full offload's peak, which its room makes and its steps measure" in text
    assert "none fits, so this one, of least measured peak, is kept" in text
    planner.close()


def test_full_offload_over_recomputed_blocks_that_fits_is_kept_without_measuring_full_offload_alone(caplog):
    planner, measured = no_plan_fits(RecomputedFullFits(cost=50 * MiB), caplog)
    assert full_kinds(measured) == [None] * MAX_SEARCH + ["recomputed"]
    kept = planner.plan
    assert kept.full and kept.fits and kept.recomputed == frozenset(range(len(planner.blocks)))
    assert {i for i, b in enumerate(planner.blocks) if "forward" in vars(b)} == set(range(len(planner.blocks)))
    assert "recompute, inputs offloaded" in planner.explain()
    assert "room paces (storm/rooms.py), codec of the store;" in planner.explain()  # the CPU frames nothing
    # planned again (as where a step's packs were dearer than traced): the full offload that fits stays, and
    # full offload alone, which the blocks' plans choose() weighs cannot stand for, is not measured after all
    phase = planner.make_plan()
    assert type(phase).__name__ != "MeasureFull" and planner.plan.full and planner.plan.recomputed
    assert full_kinds(list(planner.state.measured.values())) == [None] * MAX_SEARCH + ["recomputed"]
    planner.close()


def test_full_offload_measured_higher_than_a_plan_of_the_blocks_leaves_that_plan_kept(caplog):
    memory = FullCostsMore(cost=50 * MiB, full=10**9)
    planner, measured = no_plan_fits(memory, caplog)
    assert full_kinds(measured)[-2:] == ["recomputed", "full"]
    assert min(p.measured_over for p in measured[-2:]) > max(p.measured_over for p in measured[:-2])
    kept = planner.plan
    assert not kept.full and kept.measured_over == min(p.measured_over for p in measured)
    assert kept.inputs_offloaded + kept.offloaded > 0  # the least measured of the blocks' plans, as before
    assert any("keeping the plan of least measured peak, " in r.getMessage() for r in caplog.records)
    assert "full offload" not in planner.explain()
    planner.close()


@pytest.fixture
def read_rooms():
    """A new embedded session whose full-offload steps read their memory (as constant beside the
    queue and the window: the CPU has no allocator to read), so that they profile and follow rooms."""
    storm.close_all()
    session = storm.registry.session_for("embedded", None, None)
    session.copy_queue.memory = lambda device: session.copy_queue.nbytes + session.restorer.prefetch.nbytes + MiB
    yield session.rooms
    storm.close_all()


def test_full_offload_is_measured_by_its_first_step_that_follows_the_room_it_settled_on(read_rooms):
    """A full-offload plan's first step profiles its room (and a trial may follow): those steps run
    otherwise than the steps after them, so MeasureFull measures the first step that ran as they
    will (Offload.room_settled), each full plan after steps that did not."""
    memory = KeepingCostsMore(cost=50 * MiB)
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = memory.planner = storm.Planner(model.blocks, peak="1MiB", memory=memory, form_trial=False,
                                             host_check_tolerance=float("inf"), mode="embedded", min_bytes=0)
    runs: list[tuple[tuple | None, bool]] = []  # per step of a full plan: its shape, and whether its room settled
    for _ in range(40):
        if planner.settled:
            break
        full = planner.phase is Phase.MEASURE_FULL
        if full:
            assert "not settled yet: no plan of the blocks measured within the target, so full offload is " \
                   "measured" in planner.explain()
        ctx = planner.step()
        assert all(same_bits(a, b) for a, b in zip(ref, grads_of(model, idx, ctx)))
        if full:
            runs.append((planner.plan.shape, ctx.room_settled))
    assert planner.settled
    shapes = list(dict.fromkeys(shape for shape, _ in runs))
    assert len(shapes) == 2  # over recomputed blocks, then alone
    for shape in shapes:
        settled = [ok for sh, ok in runs if sh == shape]
        assert len(settled) > 1 and settled[-1] and not any(settled[:-1])  # measured once its room settled
    assert [p.full for p in planner.state.measured.values()][-2:] == [True, True]
    planner.close()


def test_a_plan_that_measured_over_and_is_chosen_again_has_full_offload_measured_beside_it(caplog):
    """The chooser's plan, predicted to fit, measures over; chosen again (it ranks by its measure
    now and nothing else is predicted lower), there is nothing left to measure of the blocks'
    plans before the checks run out: full offload is measured then, not only after them."""
    def one(s: Scenario) -> Plan:
        rec = frozenset(range(4))
        return Plan(offloaded=0, recomputed=rec, offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=0, predicted_cost_ms=1.0, fits=True)

    planner, measured = no_plan_fits(KeepingCostsMore(cost=50 * MiB), caplog, chooser=one, steps=14)
    assert planner.checks == 1 < MAX_CHECKS
    assert full_kinds(measured) == [None, "recomputed", "full"] and planner.plan.full
    assert planner.plan.measured_over == min(p.measured_over for p in measured)
    planner.close()


FRAMING = {"frames_of": lambda saves, setting: (1, 8 * MiB, 6 * MiB)}  # every block frames a save


@pytest.mark.parametrize("codec", [None, "raw", "auto", "ancf_exp"])
def test_both_full_offloads_are_planned_whatever_codec_the_planner_was_given(codec):
    """model.full_offloads' figures are the raw plans nearest each (a codec given to the planner
    picks a full step's frames in plan_context, not these): a frame codec, under which choose()'s
    plans offloading every block are compressed, drops neither. They frame where the step does; the
    planner's own frames (no codec given) are followed by full offload raw."""
    _, _, _, planner = traced_gpt_planner(**FRAMING, **({"codec": codec} if codec else {}))
    assert any(b.framed for b in planner.trace.blocks)
    scenario = dataclasses.replace(planner.scenario(), codec=codec)
    fulls = storm.planner.model.full_offloads(scenario)
    n = len(planner.blocks)
    both = [(0, n, n, codec != "raw"), (n, 0, 0, codec != "raw")]
    assert [(p.offloaded, p.inputs_offloaded, len(p.recomputed), p.compressed) for p in fulls] == \
        both + ([(n, 0, 0, False)] if codec is None else [])
    assert all(p.full and not p.fits for p in fulls) and len({p.shape for p in fulls}) == len(fulls)
    planner.close()


class RawFullFits(KeepingCostsMore):
    """As KeepingCostsMore, and full offload peaks at nothing where it goes raw: within any target."""

    def peak(self) -> int:
        p = self.planner.plan
        return 0 if p is not None and p.full and not p.compressed else super().peak()


def test_where_framed_full_offloads_measure_over_full_offload_raw_is_measured_and_kept(caplog):
    """A frame being encoded sits beside its tensor: where the planner frames full offload's saves
    (its own choice) and both full offloads measure over, full offload raw is measured last, and
    kept where it fits; its steps go raw."""
    planner, measured = no_plan_fits(RawFullFits(cost=50 * MiB), caplog, steps=40, **FRAMING)
    assert full_kinds(measured) == [None] * MAX_SEARCH + ["recomputed", "full", "full"]
    assert [p.compressed for p in measured[-3:]] == [True, True, False]
    kept = planner.plan
    assert kept.full and not kept.compressed and kept.fits
    assert planner.step().options["codec"] == "raw"
    assert "room paces (storm/rooms.py), codec raw;" in planner.explain()
    assert any("measuring full offload (raw)" in r.getMessage() for r in caplog.records)
    planner.close()


def test_with_budget_full_offload_is_never_measured():
    """budget= counts saves alone: offloading every block fits any budget the store takes, so
    there is nothing for full offload to reach."""
    model, idx, planner, _ = scripted_planner(AlwaysOver(), budget=0.9)
    for _ in range(8):
        grads_of(model, idx, planner.step())
    assert planner.full_offload() is None and not any(p.full for p in planner.state.measured.values())
    planner.close()


def test_peak_needs_cuda():
    model, _ = gpt()
    with pytest.raises(ValueError, match="peak= is measured with the CUDA caching allocator"):
        storm.plan(model.blocks, peak="1GiB")


def by_host_cost(dearer_than_ms: float, seen: list[float]) -> Callable[[Scenario], Plan]:
    """A choice that offloads blocks 0-1 while the trace's host time per tensor is at most
    ``dearer_than_ms``, else recomputes them; the host times it was asked with go to ``seen``."""

    def choose(s: Scenario) -> Plan:
        trace = s.trace
        seen.append(trace.host_ms_per_tensor)
        if trace.host_ms_per_tensor <= dearer_than_ms:
            return Plan(offloaded=2, recomputed=frozenset(), offload_budget=trace.offloaded_before[2],
                        max_held_bytes=1 << 30, prefetch_bytes=0, predicted_peak=1 << 40, predicted_cost_ms=0.0,
                        fits=True)
        return Plan(offloaded=0, recomputed=frozenset({0, 1}), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=1 << 40, predicted_cost_ms=1.0, fits=True)

    return choose


@pytest.mark.parametrize("slow_ms", [0.0, 20.0])
def test_a_planned_steps_dearer_packs_replace_the_traced_host_time(monkeypatch, slow_ms):
    """The trace's host time per offloaded tensor is the offload trace's median block's; a
    planned step's packs can cost more (on a GPU, a few times more where only the first block
    is offloaded). The second planned step that offloads is read: slower packs (here each put takes
    ``slow_ms`` on the packs' clock once the trace is done) become the trace's and the planner plans again,
    here to recompute instead; faster ones (here against a trace set to 5 ms a tensor) change
    nothing. Gradients stay bit-exact."""
    from storm import mover

    seen: list[float] = []
    put, clock = mover.Mover.put, pack_clock(monkeypatch)

    def put_slower(self, req):
        clock.now += slow_ms / 1e3
        return put(self, req)

    model, idx, ref, planner = traced_gpt_planner(chooser=by_host_cost(10.0, seen), form_trial=False)
    monkeypatch.setattr(mover.Mover, "put", put_slower)
    assert planner.trace.host_ms_per_tensor == 0.0  # the packs' clock stood still in the trace
    if not slow_ms:
        planner.trace.host_ms_per_tensor = 5.0  # far over what packs take here
    traced_ms = planner.trace.host_ms_per_tensor
    offloading = []
    for step in range(4):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in planned step {step}"
        offloading.append(ctx.stats.offloaded > 0)
        # not settled before the second offloading step has been read
        assert planner.settled == (step >= 1)
    if slow_ms:
        assert offloading == [True, True, False, False]
        assert planner.traced_host_ms_per_tensor == traced_ms
        assert planner.trace.host_ms_per_tensor == pytest.approx(2 * slow_ms)  # pack and unpack, as the trace counts
        assert seen[-1] == planner.trace.host_ms_per_tensor and planner.plan.offloaded == 0
        assert f"(measured in a planned step; traced {traced_ms * 1e3:.0f})" in planner.explain()
    else:
        assert offloading == [True] * 4 and planner.traced_host_ms_per_tensor is None
        assert planner.trace.host_ms_per_tensor == traced_ms and set(seen) == {traced_ms}  # never planned again
    planner.close()


def test_a_planned_steps_framed_packs_are_weighed_apart_from_its_raw_ones():
    """The host check reads a step's packs per kind: those of tensors sent raw against the
    trace's host time per tensor, and what a framed one took beyond the raw figure the model
    charges beside it, against the trace's frame figure (a microbenchmark of one frame's
    kernels). Each kind replaces only its own figure, where dearer past the tolerance: frames
    that cost more do not make every raw tensor dearer. Packs are counted as they are timed,
    so a save the store refuses later (which takes back its offloaded count) moves neither."""
    from storm.planner.measure import host_from_packs, packs_ms_per_tensor
    from storm.planner.records import BlockTrace, Trace
    from storm.stats import OffloadStats

    trace = Trace([BlockTrace(framed=1)], host_ms_per_tensor=0.2, frame_host_ms_per_tensor=0.08)
    # 10 raw packs of 0.1 ms, 10 framed of 0.3 ms: 0.2 and 0.6 ms pack and unpack per tensor
    stats = OffloadStats(offloaded=20, packs=20, pack_s=4e-3, framed=10, frame_pack_s=3e-3)
    assert packs_ms_per_tensor(stats) == pytest.approx((0.2, 0.6))
    host, frame = host_from_packs(trace, stats)
    assert host is None and frame == pytest.approx(0.4)  # raw as traced; a frame adds 0.4, not 0.08
    refused = dataclasses.replace(stats, offloaded=15)  # five framed saves refused by the store after their packs
    assert packs_ms_per_tensor(refused) == pytest.approx((0.2, 0.6))
    slower = dataclasses.replace(stats, pack_s=5e-3)  # raw 0.4: twice the trace's
    assert host_from_packs(trace, slower) == pytest.approx((0.4, 0.2))  # a frame adds 0.2 beyond the new raw
    near = dataclasses.replace(stats, pack_s=4.4e-3)  # raw 0.28: within 1.5x, so the model keeps charging 0.2
    assert host_from_packs(trace, near) == (None, pytest.approx(0.4))  # ...and a frame's is beyond that
    every = OffloadStats(offloaded=10, packs=10, pack_s=2e-3, framed=10, frame_pack_s=2e-3)  # all framed
    assert packs_ms_per_tensor(every) == (None, pytest.approx(0.4))
    assert host_from_packs(trace, every) == (None, pytest.approx(0.2))
    cheap = OffloadStats(offloaded=10, packs=10, pack_s=0.6e-3, framed=5, frame_pack_s=0.35e-3)  # within 1.5x
    assert host_from_packs(trace, cheap) == (None, None)
    assert host_from_packs(trace, OffloadStats()) == (None, None)  # offloaded nothing
    unframed = Trace([BlockTrace()], host_ms_per_tensor=0.2)  # frames outside the blocks (a daemon's codec):
    assert host_from_packs(unframed, stats) == (None, None)   # the model charges none, so none to correct


def test_the_host_check_puts_a_framed_steps_figures_in_the_trace_each_apart():
    """Checked.check_host with a step's framed and raw packs: a frame's dearer figure replaces the
    trace's frame figure alone (the raw one as traced), the trace's is kept for explain(), and the
    plan is to be made again; then a step whose raw packs alone are dearer replaces only those."""
    from storm.planner.phases import CheckHost
    from storm.planner.records import BlockTrace, Trace
    from storm.planner.state import TraceState
    from storm.stats import OffloadStats

    def checked(stats: OffloadStats) -> tuple[bool, TraceState]:
        state = TraceState(trace=Trace([BlockTrace(framed=1)], host_ms_per_tensor=0.2, frame_host_ms_per_tensor=0.08))
        phase = CheckHost(None)
        phase.ctx = SimpleNamespace(stats=stats)
        return phase.check_host(SimpleNamespace(state=state, host_check_tolerance=1.5)), state

    replanned, state = checked(OffloadStats(offloaded=20, packs=20, pack_s=4e-3, framed=10, frame_pack_s=3e-3))
    assert replanned and state.trace.frame_host_ms_per_tensor == pytest.approx(0.4)
    assert state.traced_frame_host_ms_per_tensor == 0.08
    assert state.trace.host_ms_per_tensor == 0.2 and state.traced_host_ms_per_tensor is None
    replanned, state = checked(OffloadStats(offloaded=10, packs=10, pack_s=4e-3))  # raw only, 0.8 a tensor
    assert replanned and state.trace.host_ms_per_tensor == pytest.approx(0.8)
    assert state.traced_host_ms_per_tensor == 0.2 and state.trace.frame_host_ms_per_tensor == 0.08
    assert state.traced_frame_host_ms_per_tensor is None
    assert not checked(OffloadStats(offloaded=10, packs=10, pack_s=1e-3))[0]  # as traced: nothing to replan


def test_dearer_packs_found_in_a_step_whose_reading_goes_on_in_the_next_still_make_the_plan_again(monkeypatch):
    """A Measure step whose peak was not read (a batch skipped after its forward) is read again in
    the next step; the host check, once per trace, ran in the first: what it found makes the plan
    again when the reading ends without a plan of its own."""
    from storm.planner import phases

    hosts = iter([True, False])  # the check's step is the first; the next is not counted again
    made = []
    planner = SimpleNamespace(state=SimpleNamespace(count_host_step=lambda: next(hosts)),
                              make_plan=lambda: made.append(1) or "made again")
    monkeypatch.setattr(phases, "after_checks", lambda planner, alternative: "settled")
    phase = phases.Measure(None)
    monkeypatch.setattr(phase, "check_host", lambda planner: True)
    readings = iter([phase, None])  # unread, then read within the target with nothing else to try
    monkeypatch.setattr(phase, "read", lambda planner: next(readings))
    assert phase.end(planner) is phase and not made
    assert phase.end(planner) == "made again" and made == [1]


@pytest.mark.parametrize("kind", ["form", "other kind"])
def test_the_plan_kept_once_the_measures_run_out_is_tried_against_its_own_other_form(monkeypatch, kind):
    """Measured over its target MAX_CHECKS times, the planner keeps the plan of least measured peak;
    the trial that may follow is of that plan against its own other recompute form, not against the
    other form of the plan measured last (another shape: a "form" trial of two shapes). An
    alternative of the other kind (tests/planner/test_planner_phases.py) stays the alternative."""
    from storm.planner import phases

    last = Plan(offloaded=0, recomputed=frozenset({1}), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                predicted_peak=0, predicted_cost_ms=1.0, fits=True)
    kept = dataclasses.replace(last, recomputed=frozenset({0, 1}), measured_over=5)
    state = SimpleNamespace(checks=MAX_CHECKS - 1, plan=last, besides=0, stale=False, measured_moments={},
                            record=lambda plan, over: plan, least_measured=lambda: kept, count_host_step=lambda: False)
    applied, tried = [], []
    planner = SimpleNamespace(state=state, target=100, apply=applied.append,
                              other_form=lambda plan: ("other form of", plan))
    monkeypatch.setattr(phases, "measure_full", lambda planner: None)
    monkeypatch.setattr(phases, "after_checks", lambda planner, alternative: tried.append(alternative) or "next")
    other_kind = dataclasses.replace(last, offloaded=2, recomputed=frozenset())
    alternative = dataclasses.replace(last, reentrant=False) if kind == "form" else other_kind  # chosen for `last`
    phase = phases.Measure(alternative)
    phase.peak = SimpleNamespace(measured=200, moments=None)  # 100 over
    assert phase.end(planner) == "next"
    assert applied == [kept] and tried == [("other form of", kept) if kind == "form" else other_kind]


def test_the_phases_follow_the_steps_to_settled():
    """With peak= (the reentrant form): the offload trace, the compute trace, the compute trace
    without the hand-over, the plan's measured step, the host check of its second offloading
    step, then settled. Each is what the next step does, once the last step has been read."""
    model, idx, planner, _ = scripted_planner(ScriptedMemory(extra=0), peak="60MiB")
    phases = [planner.phase]
    for _ in range(5):
        grads_of(model, idx, planner.step())
        planner.settled  # reads the step
        phases.append(planner.phase)
    assert phases == [Phase.TRACE_OFFLOAD, Phase.TRACE_COMPUTE, Phase.TRACE_COMPUTE_KEPT, Phase.MEASURE,
                      Phase.CHECK_HOST, Phase.SETTLED]
    assert storm.Planner(model.blocks, budget=0.5).explain() == \
        "storm.plan: no plan yet; the next step is traced with every save offloaded (what each block saves)"
    planner.close()


def test_with_a_budget_a_plan_predicted_over_it_is_measured_against_the_budget():
    """budget= is one target for every plan: the saves within it. A plan the model predicts over the
    budget (the one kept where none fits) was measured against its own prediction, so a step that
    peaked as predicted was said to fit, and the warning that no plan does never came."""
    def keep_all(s: Scenario) -> Plan:
        return Plan(offloaded=0, recomputed=frozenset(), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=predicted_peak(s.trace, 0, set(), 0), predicted_cost_ms=0.0, fits=False)

    memory = ScriptedMemory(extra=0)
    model, idx = gpt()
    planner = storm.Planner(model.blocks, mode="embedded", min_bytes=0, memory=memory, chooser=keep_all,
                            form_trial=False, host_check_tolerance=float("inf"), budget=0.3)
    memory.planner = planner
    for _ in range(3):  # the offload trace, the compute trace, the plan's first step
        grads_of(model, idx, planner.step())
    planner.step()  # reads it
    assert planner.plan.predicted_peak > planner.saved_budget
    assert planner.measured_peak == planner.besides + planner.step_peak(planner.plan)  # as predicted
    assert planner.measured_peak > planner.target
    planner.close()
