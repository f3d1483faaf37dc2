"""bench/compiled.py on made-up measurements: the rows it builds (torch's budgets, STORM over
torch's recompute at a larger budget and at none, full offload), STORM's choice at each budget's
peak, the duels, resumption, and issue 52's verdicts, each failing where its numbers do; and its
command line without CUDA."""

from __future__ import annotations

import json

from helpers import bench_module, run_bench

common = bench_module("common")
for sibling in ("hf", "zoo_verdicts", "zoo"):  # the zoo's cells and duel: the script imports them as siblings
    bench_module(sibling)
compiled = bench_module("compiled")
GiB = common.GiB
BUDGETS = [0.7, 0.5, 0.3, 0.1]
# torch's rows: no offload, then each budget (less memory, more time)
PEAK = {None: 10 * GiB, 0.7: 8 * GiB, 0.5: 6 * GiB, 0.3: 5 * GiB, 0.1: 4 * GiB}
STEP = {None: 100.0, 0.7: 103.0, 0.5: 106.0, 0.3: 112.0, 0.1: 125.0}


class Fake:
    """common.run and zoo.duel, made up: a torch row as PEAK and STEP say; STORM over torch's
    recompute at a budget peaks that row's peak less what it offloads (as one graph, the
    partitioner's budget; per block, down to its cap) and pays 2 ms per GiB; its full offload
    peaks at 3 GiB over none and 2.5 over 0.1. A duel's ratio is the rows' steps'."""

    def __init__(self, lowers: float = 1.0) -> None:
        self.runs: list = []
        self.duels: list = []
        self.lowers = lowers  # of the bytes the partitioner sends, what comes off the peak

    def run(self, row) -> dict:
        self.runs.append(row)
        v = row.variant
        at = v.memory_budget
        if row.label.startswith("storm full"):
            peak, step = (2.5 if at else 3.0) * GiB, 140.0
        elif row.label.startswith("storm"):
            sent = v.partitioner["budget"] if v.compile == "graph" else max(0, PEAK[at] - row.opts["peak"])
            peak, step = PEAK[at] - sent * (self.lowers if v.compile == "graph" else 1), STEP[at] + 2.0 * sent / GiB
        else:
            peak, step = PEAK[at], STEP[at]
        return {"step_ms": step, "peak_bytes": int(peak)}

    def duel(self, these) -> dict:
        self.duels.append([r.label for r in these])
        mine, theirs = (self.rows[r.label]["step_ms"] for r in these)
        return {"ms": [mine, theirs], "first_over": [round(mine / theirs, 3)], "first_over_95": [[0.9, 1.1]]}


def measured(mode: str, sec: dict | None = None, fake: Fake | None = None) -> tuple[dict, Fake]:
    sec = {} if sec is None else sec
    fake = fake or Fake()
    fake.rows = sec.setdefault("rows", {})
    compiled.measure(common.W3_TINY, mode, BUDGETS, sec, fake.run, fake.duel, lambda: None)
    return sec, fake


def test_storm_at_each_budget_s_peak_runs_over_the_next_budget_and_none_and_the_fastest_that_fits_is_kept():
    sec, fake = measured("graph")
    labels = [r.label for r in fake.runs]
    assert labels[:5] == ["compiled", "amb 0.7", "amb 0.5", "amb 0.3", "amb 0.1"]
    assert [r.variant.memory_budget for r in fake.runs[:5]] == [None, *BUDGETS]
    assert all(r.variant.compile == "graph" and r.method == "none" for r in fake.runs)
    # at amb 0.1's peak (4 GiB): over 0.3 (1 GiB to send) and over none (6 GiB)
    over = {r.label: r for r in fake.runs if r.label.startswith("storm 4.000GiB")}
    assert set(over) == {"storm 4.000GiB over amb 0.3", "storm 4.000GiB over compiled"}
    assert over["storm 4.000GiB over amb 0.3"].variant.partitioner["budget"] == GiB
    assert over["storm 4.000GiB over compiled"].variant.partitioner["budget"] == 6 * GiB
    # 0.3 plus 1 GiB sent: 114 ms, against none plus 6 GiB: 112 ms
    assert sec["chosen"]["amb 0.1"] == "storm 4.000GiB over compiled"
    assert sec["chosen"]["amb 0.7"] == "storm 8.000GiB over compiled"  # none plus 2 GiB: 104 against 103
    assert sec["chosen"]["least"] == "storm full over amb 0.1"
    # 15% under amb 0.1's 4 GiB: over 0.1 sending 0.6 GiB (126.2 ms) or over none sending 6.6 (113.2)
    assert sec["chosen"]["under"] == "storm 3.400GiB over compiled"
    assert {"storm 3.400GiB over amb 0.1", "storm 3.400GiB over compiled"} <= {r.label for r in fake.runs}
    assert ["storm full over amb 0.1", "amb 0.1"] in fake.duels and len(fake.duels) == 6
    assert ["storm 3.400GiB over compiled", "amb 0.1"] in fake.duels
    v = compiled.verdicts(sec)
    caps = {c["amb"]: c for c in v["at_amb_peaks"]["caps"]}
    assert caps["amb 0.1"]["x_amb"] == round(112 / 125, 3) and caps["amb 0.1"]["holds"]
    assert caps["amb 0.7"]["x_amb"] == round(104 / 103, 3) and not caps["amb 0.7"]["holds"]
    assert not v["at_amb_peaks"]["holds"]
    # 2.5 GiB is 37.5% under 4, at 140 / 125 = 1.12x
    assert v["least"]["under"] == 0.375 and v["least"]["x"] == 1.12 and v["least"]["holds"]
    assert v["under"]["under"] == 0.15 and v["under"]["x"] == round(113.2 / 125, 3) and v["under"]["holds"]


def test_as_one_graph_a_candidate_whose_peak_fell_short_is_tried_again_sending_twice_the_miss_more():
    sec, fake = measured("graph", fake=Fake(lowers=0.75))  # a quarter of what goes stays on the peak
    first = next(r for r in fake.runs if r.label == "storm 4.000GiB over amb 0.3")
    again = next(r for r in fake.runs if r.label == "storm 4.000GiB over amb 0.3 (again)")
    miss = sec["rows"][first.label]["peak_bytes"] - 4 * GiB
    assert miss == GiB // 4 and again.variant.partitioner["budget"] == GiB + 2 * miss
    assert sec["rows"][again.label]["peak_bytes"] <= 4 * GiB
    assert sec["chosen"]["amb 0.1"] in {again.label, "storm 4.000GiB over compiled (again)"}


def test_a_miss_of_a_few_bytes_is_tried_again_sending_at_least_an_eighth_more():
    sec, fake = measured("graph", fake=Fake(lowers=0.999))  # a thousandth of what goes stays on the peak
    first = next(r for r in fake.runs if r.label == "storm 4.000GiB over compiled")
    again = next(r for r in fake.runs if r.label == "storm 4.000GiB over compiled (again)")
    miss = sec["rows"][first.label]["peak_bytes"] - 4 * GiB
    sent = first.variant.partitioner["budget"]
    assert 0 < 2 * miss < sent // 8 and again.variant.partitioner["budget"] == sent + sent // 8


def test_per_block_storm_is_storm_enable_at_the_cap_over_blocks_compiled_at_the_budget():
    sec, fake = measured("blocks")
    over = next(r for r in fake.runs if r.label == "storm 4.000GiB over amb 0.3")
    assert over.variant.compile == "blocks" and over.variant.memory_budget == 0.3
    assert over.method == "enable" and over.opts["peak"] == 4 * GiB and over.variant.partitioner is None
    full = next(r for r in fake.runs if r.label == "storm full over compiled")
    assert full.method == "enable" and "peak" not in full.opts


def test_nothing_of_storm_fitting_a_peak_is_said_and_fails_and_a_resumed_run_measures_nothing_again():
    sec, fake = measured("graph")
    for label in ("storm 6.000GiB over amb 0.7", "storm 6.000GiB over compiled"):  # none at 0.5's peak fits
        sec["rows"][label]["peak_bytes"] = 7 * GiB
        sec["rows"][f"{label} (again)"] = {"step_ms": 110.0, "peak_bytes": 7 * GiB}  # nor when tried again
    sec["duels"].clear()
    again = Fake()
    measured("graph", sec, again)
    assert again.runs == [] and sec["chosen"]["amb 0.5"] is None and len(again.duels) == 5
    cap = next(c for c in compiled.verdicts(sec)["at_amb_peaks"]["caps"] if c["amb"] == "amb 0.5")
    assert cap["storm"] is None and not cap["holds"]
    assert "nothing of STORM fits" in compiled.table("W3 graph", sec)


def test_a_least_peak_not_far_enough_under_the_least_budget_s_fails(tmp_path):
    sec, _ = measured("graph")
    sec["rows"]["storm full over amb 0.1"]["peak_bytes"] = int(3.6 * GiB)  # 10% under 4 GiB
    least = compiled.verdicts(sec)["least"]
    assert least["under"] == 0.1 and not least["holds"]
    out = tmp_path / "compiled.json"
    out.write_text(json.dumps({"workloads": {"W3 graph": sec}}))
    done = run_bench("compiled.py", "--summary", str(out))
    assert done.returncode == 0 and "least: storm full over amb 0.1 10.0% under amb 0.1" in done.stdout


def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    done = run_bench("compiled.py", "--workloads", "W3", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "CUDA" in done.stdout + done.stderr


def test_a_duel_of_compiled_rows_clears_dynamo_once_before_building_them(monkeypatch):
    """Each row carries its budget in what it compiles with, so the duel's models need no reset
    between them; a reset after the first was built made it compile again in the timed rounds."""
    import argparse
    import random

    import torch

    zoo = bench_module("zoo")
    events: list[str] = []

    class Built:
        def __init__(self, w, method, opts, device):
            w.build(device)
            events.append(f"built {w.memory_budget}")
            self.planner = None

        def warm(self, steps):
            pass

        def step(self):
            return 0.01

        def close(self):
            pass

    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(zoo, "Trainer", Built)
    specs = [(common.Variant(common.W3_TINY, compile="graph", memory_budget=b), "none", {}) for b in (0.5, 0.1)]
    args = argparse.Namespace(warmup=0, rounds=1, round_steps=1)
    out = zoo.duel(specs, args, common.torch.device("cpu"), random.Random(0))
    assert "first_over" in out and events == ["reset", "built 0.5", "built 0.1"]
