"""bench/frontier.py's lower bound and summary, on numbers given here, and its --plot-only on a
committed run (the measured runs are CUDA's: without CUDA it exits 2)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import BENCH, bench_module, run_bench

frontier = bench_module("frontier")
Bound, ratio_interval, summarize = frontier.Bound, frontier.ratio_interval, frontier.summarize
RECORDED = BENCH / "results" / "frontier-w1-h100-2026-11-26-4e6e189.json"  # docs/results.md's W1 frontier

GiB = 1 << 30
GB = 1e9

# W1-like: 8 ms forward of a 26 ms step over 12 blocks, 0.25 GB removed per recomputed block, 50 GB/s
W1 = Bound(forward_ms=8.0, layers=12, bytes_per_block=0.25 * GB, d2h_GBps=50.0, h2d_GBps=50.0)


def test_what_forward_can_carry_costs_nothing():
    assert W1.ms(0, 26.0) == pytest.approx(26.0)
    assert W1.ms(int(0.4 * GB), 26.0) == pytest.approx(26.0)  # 8 ms of forward carries 0.4 GB


def test_beyond_it_the_cheaper_of_stalling_forward_and_recomputing_counts():
    # 1 GB: 0.4 GB offloaded in forward's 8 ms, 0.6 GB recomputed (2.4 blocks of 8/12 ms) ...
    assert W1.ms(int(1.0 * GB), 26.0) == pytest.approx(26.0 + 2.4 * 8.0 / 12, abs=0.01)
    # ... unless recomputing is dearer than the link: blocks of 20 ms, forward stalls instead
    slow = Bound(forward_ms=240.0, layers=12, bytes_per_block=0.25 * GB, d2h_GBps=50.0, h2d_GBps=1e6)
    assert slow.ms(int(13.0 * GB), 300.0) == pytest.approx(300.0 + 13.0 * GB / 50e6 - 240.0, abs=0.01)


def test_more_than_recomputing_every_block_removes_must_be_offloaded():
    # 3.5 GB with 3 GB recomputable: at least 0.5 GB crosses, 2 ms more than forward's 8 carry
    assert W1.ms(int(3.5 * GB), 26.0) == pytest.approx(26.0 + 2.0 + 12 * 8.0 / 12, abs=0.01)
    no_recompute = Bound(forward_ms=8.0, layers=12, bytes_per_block=0.0, d2h_GBps=50.0, h2d_GBps=50.0)
    assert no_recompute.ms(int(1.0 * GB), 26.0) == pytest.approx(20.0 + max(18.0, 20.0), abs=0.01)


def test_the_link_only_bound_is_not_a_bound_where_recomputing_is_cheaper():
    b = int(2.5 * GB)
    assert W1.link_only(b, 26.0) == pytest.approx(50.0)
    assert W1.ms(b, 26.0) < 36.0 < W1.link_only(b, 26.0)  # checkpointing every block: 26 + 8 ms


LOOSE = int(0.3 * GiB)  # less than forward's 8 ms carry: the bound is the no-offload step


def section() -> dict:
    rows = [
        {"label": "none", "method": "none", "step_ms": 26.0, "forward_ms": 8.0, "peak_GiB": 3.0},
        {"label": "checkpoint", "method": "checkpoint", "step_ms": 36.0, "peak_GiB": 1.0},
        {"label": "plan 2.70GiB", "method": "plan", "budget_bytes": LOOSE, "step_ms": 27.0, "peak_GiB": 2.4},
        {"label": "plan 0.50GiB", "method": "plan", "budget_bytes": 5 * GiB // 2, "step_ms": 40.0, "peak_GiB": 1.0},
    ]
    return {"layers": 12, "rows": rows, "total_bytes": 3 * GiB, "bytes_per_block": 2 * GiB / 12,
            "budgets": [LOOSE, 5 * GiB // 2],
            "duel": [{"budget_bytes": LOOSE, "plan_ms": 28.0, "other": "checkpoint", "other_ms": 36.0,
                      "ratio": 0.778, "none_ms": 27.0, "lower_bound_ms": 1.0, "x_bound": 28.0}]}


def test_the_summary_compares_fitting_plans_and_marks_what_nothing_reaches():
    out = summarize(section(), {"d2h_GBps": 50.0, "h2d_GBps": 50.0})
    loose, tight = out["planner"]
    assert loose["fits_cap"] and loose["reachable"] and loose["best_other"] == "checkpoint"
    assert loose["x_bound"] == pytest.approx(27.0 / 26.0, abs=1e-3)
    assert loose["x_other"] == pytest.approx(27.0 / 36.0, abs=1e-3)
    # a cap of 0.5 GiB: the plan's 1 GiB and checkpointing's do not fit, nor does anything else
    assert not tight["fits_cap"] and tight["best_other"] is None and not tight["reachable"]
    assert "x_bound" not in tight
    # the duel's bound is recomputed from the no-offload time measured beside it
    duel = out["duel"][0]
    assert duel["lower_bound_ms"] == pytest.approx(27.0, abs=0.01)
    assert duel["x_bound"] == pytest.approx(28 / 27, abs=1e-3)
    assert out["bound"][0]["link_only_ms"] == pytest.approx(26.0)


def test_the_duels_interval_excludes_a_tie_only_where_the_rounds_agree():
    faster = [[98.0 + i % 3, 99.0, 100.0] for i in range(8)]
    slower = [[100.0 + i % 3, 101.0, 102.0] for i in range(8)]
    lo, hi = ratio_interval(faster, slower)
    assert lo <= 99.0 / 101.0 <= hi < 1.0
    # rounds that disagree (each method faster in half of them) give an interval around 1
    mixed_a = [[100.0 + (3 if i % 2 else -3)] * 5 for i in range(8)]
    mixed_b = [[100.0 - (3 if i % 2 else -3)] * 5 for i in range(8)]
    lo, hi = ratio_interval(mixed_a, mixed_b)
    assert lo < 1.0 < hi
    assert ratio_interval(mixed_a, mixed_b) == (lo, hi)  # seeded: a rerun of the summary gives the same


def test_plot_only_redraws_a_recorded_run_on_any_machine(tmp_path):
    png = tmp_path / "frontier.png"
    r = run_bench("frontier.py", "--plot-only", str(RECORDED), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 0
    recorded = json.loads(RECORDED.read_text())
    assert {"device", "date", "commit", "command"} <= set(recorded["meta"])
    assert "W1" in r.stdout and len(r.stdout.splitlines()) >= len(recorded["W1"]["duel"])  # a row per budget


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures where CUDA is")
def test_without_cuda_it_measures_nothing_and_says_so(tmp_path):
    r = run_bench("frontier.py", "--quick", "--out", str(tmp_path / "f.json"))
    assert r.returncode == 2 and "measures on CUDA" in r.stderr and "--plot-only" in r.stderr, r.stderr
    assert not (tmp_path / "f.json").exists()
