"""bench/offload.py: its gradients check on CPU with the tiny workload (no offload twice, then the
embedded store and stormd, raw and in frames, bit for bit), and its timings, which measure on CUDA
only (without it the script exits 2)."""

from __future__ import annotations

import pytest
import torch

from helpers import bench_module, bench_result, run_bench

offload = bench_module("offload")


@pytest.mark.slow  # a daemon, six models, frames encoded on the CPU: ten seconds and more on 2 cores
def test_the_check_on_cpu_finds_every_gradient_identical_through_both_stores(tmp_path):
    out = tmp_path / "bitexact.json"
    r = run_bench("offload.py", "--check", "--device", "cpu", "--workloads", "tiny", "--pool-size", "256MiB",
                  "--min-bytes", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["deterministic_algorithms"]
    rows = result["tiny"]
    assert rows["none"] == "reference"
    assert set(rows) == {"none", "none-again", "storm-embedded", "storm-daemon", "storm-embedded-frames",
                         "storm-daemon-frames"}
    for name, row in rows.items():
        if name != "none":
            assert row["differing_gradients"] == 0 and row["of"] > 0, (name, row)
        if name.startswith("storm-"):
            assert row["offloaded_tensors"] > 0, (name, row)


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures where CUDA is")
def test_the_timings_without_cuda_measure_nothing_and_say_so(tmp_path):
    r = run_bench("offload.py", "--workloads", "W1", "--methods", "none", "--out", str(tmp_path / "t.json"))
    assert r.returncode == 2 and "measures on CUDA" in r.stderr and "--check --device cpu" in r.stderr, r.stderr
    assert not (tmp_path / "t.json").exists()


def test_the_timings_refuse_another_device():
    r = run_bench("offload.py", "--device", "cpu", "--out", "unused.json")
    assert r.returncode == 2 and "the timings measure on CUDA" in r.stderr, r.stderr


def test_a_plans_budget_is_a_fraction_or_bytes():
    assert offload.plan_budget("0.3") == 0.3
    assert offload.plan_budget("6GiB") == "6GiB"
    with pytest.raises(SystemExit, match="need --budget"):
        offload.plan_budget(None)
