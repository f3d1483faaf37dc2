"""bench/shared_link.py on CPU: processes training at once through one stormd each offload every
step, and the script times only the steps they ran together."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.slow  # processes, a daemon and real encodes: tens of seconds on 2 cores
def test_processes_sharing_a_daemon_all_offload_and_are_timed_together(tmp_path):
    out = tmp_path / "shared.json"
    r = run_bench("shared_link.py", "--device", "cpu", "--tiny", "--procs", "2", "--steps", "3", "--warmup", "1",
                  "--pool-size", "256MiB", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["workload"] == "tiny"
    rows = [result["alone"], *result["shared"]]
    assert [row["process"] for row in result["shared"]] == [0, 1]
    for row in rows:
        assert row["offloaded_tensors_per_step"] > 0  # through the daemon: mode="daemon" has no fallback
        assert row["steps_counted"] >= 3 and row["step_ms"] > 0  # each steps until all have run 3
    summary = result["summary"]
    assert summary["shared_step_ms"] == [row["step_ms"] for row in result["shared"]]
    assert summary["spread"] >= 1.0
