"""bench/plan_time.py times storm.plan's choose() on the CPU over a recorded trace made deeper:
the trace it times is the recorded one, its blocks repeated, and its JSON says which code ran."""

from __future__ import annotations

import json
import sys

from helpers import bench_module, bench_result, run_bench

plan_time = bench_module("plan_time")


def test_the_trace_repeated_once_is_the_recorded_one_and_twice_is_twice_as_deep():
    sys.path.insert(0, str(plan_time.ROOT / "tests" / "planner"))
    try:
        from make_golden import trace_of
    finally:
        sys.path.pop(0)
    recorded = json.loads(plan_time.GOLDEN.read_text())["trace"]
    assert plan_time.repeated(recorded, 1) == trace_of(recorded)
    twice = plan_time.repeated(recorded, 2)
    n = len(recorded["blocks"])
    assert [b.saved_bytes for b in twice.blocks] == [b["saved_bytes"] for b in recorded["blocks"]] * 2
    assert twice.offloaded_before[n] == recorded["offloaded_before"][-1] + recorded["blocks"][-1]["saved_bytes"]
    assert len(twice.offloaded_before) == 2 * n and len(twice.lead_ms) == 2 * n + 1


def test_it_times_each_depth_and_records_where(tmp_path):
    out = tmp_path / "time.json"
    r = run_bench("plan_time.py", "--repeat", "1", "--every", "800", "--rounds", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    [row] = result["rows"]
    assert row["blocks"] == 24 and row["cases"] == 2 and row["ms_per_choice"] > 0, row
