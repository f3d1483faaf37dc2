"""bench/load.py on this machine, small: client processes speaking the protocol to a fresh stormd,
every byte fetched compared (tests/test_faults_load.py runs it at full size)."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.slow  # spawned clients and a daemon: several seconds on 2 cores
def test_two_clients_store_and_fetch_every_byte_back(tmp_path):
    out = tmp_path / "load.json"
    r = run_bench("load.py", "--procs", "2", "--steps", "50", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["machine"]["cpus"] > 0
    assert result["tensors"] == 100 and result["requests"] == 4 * 100  # PUT, SEAL, GET, FREE each
    assert result["mismatches"] == 0 and result["errors"] == []
    assert 0 < result["latency_ms"]["all"]["p50"] <= result["latency_ms"]["all"]["p99"]
    daemon = result["daemon"]  # between two STATUS requests: the first, the clients' and their BYEs
    assert daemon["requests"] == 1 + 4 * 100 + 2 and daemon["busy_us"] > 0
    assert daemon["cpu_us"] >= daemon["loop_cpu_us"] >= 0  # the process's, of which its loop thread's
