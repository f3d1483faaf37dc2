"""bench/load_gpu.py on CPU with a one-layer GPT: a worker through a fresh stormd, every step's
gradients bit for bit against the same step without offload, and the pool back where it was."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.slow  # a spawned worker importing torch: ten seconds and more on 2 cores
def test_a_worker_trains_through_stormd_bit_identically_and_leaves_the_pool_as_it_was(tmp_path):
    out = tmp_path / "load_gpu.json"
    r = run_bench("load_gpu.py", "--device", "cpu", "--procs", "1", "--steps", "3", "--seq-len", "16",
                  "--d-model", "32", "--heads", "2", "--layers", "1", "--batch", "2", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["meta"]["model"]["layers"] == 1
    (worker,) = result["workers"]
    assert worker["steps"] == 3 and worker["mismatches"] == 0 and worker["tensors_per_s"] > 0
    pool = result["pool"]
    assert pool["final_used"] == pool["baseline_used"] and pool["final_clients"] == pool["baseline_clients"]
    assert result["kill_one"] is None and result["errors"] == []
