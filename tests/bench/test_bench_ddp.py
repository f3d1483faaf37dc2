"""bench/ddp.py on CPU (gloo, the tiny workload): ranks through one stormd get every step's loss and
gradients bit-identical to the same steps without offload, and the JSON says so per rank."""

from __future__ import annotations

import pytest

from helpers import bench_module, bench_result, run_bench

ddp = bench_module("ddp")


@pytest.mark.slow  # torchrun twice, a daemon: tens of seconds on 2 cores
def test_two_cpu_ranks_through_one_daemon_step_bit_identically(tmp_path):
    out = tmp_path / "ddp.json"
    r = run_bench("ddp.py", "--nproc", "2", "--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1",
                  "--pool-size", "64MiB", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["wrapper"] == "ddp" and not result["peer_access"]
    assert len(result["single_rank"]["ranks"]) == 1 and len(result["2_ranks"]["ranks"]) == 2
    for rank in [*result["single_rank"]["ranks"], *result["2_ranks"]["ranks"]]:
        assert rank["identical_steps"] == rank["steps"] == 3 and rank["offloaded_tensors_per_step"] > 0
    for rank in result["2_ranks"]["ranks"]:
        assert rank["throughput_vs_single_rank"] > 0 and rank["offload_cost_vs_single_rank"] > 0


def test_a_budget_is_a_fraction_or_bytes_or_none():
    assert ddp.budget("0.25") == 0.25
    assert ddp.budget("2GiB") == "2GiB"
    assert ddp.budget(None) is None
