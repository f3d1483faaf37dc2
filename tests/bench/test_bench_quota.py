"""bench/quota.py on CPU: a holder process takes the shared pool and the trainer beside it is
refused, unless stormd's client_quota holds the holder to its share; every trainer step stays
bit-identical to the same step without offload."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.slow  # two daemons, two holder processes, the tiny model: about ten seconds on 2 cores
def test_a_quota_keeps_the_pool_for_the_trainer_beside_a_holder(tmp_path):
    out = tmp_path / "quota.json"
    r = run_bench("quota.py", "--device", "cpu", "--model", "tiny", "--pool-size", "64MiB", "--quota", "32MiB",
                  "--holder-batch", "768", "--batch", "96", "--steps", "2", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    free, held = bench_result(out)["settings"]
    assert free["quota"] is None and held["quota"] == "32MiB"
    for s in (free, held):
        assert s["holder"]["backward"] and all(t["identical"] for t in s["trainer"]), s
    # no quota: the holder fills the pool, the trainer's saves are refused
    assert free["holder"]["offloaded_bytes"] > 32 << 20
    assert all(t["refused"].get("pool full", 0) > 0 for t in free["trainer"]), free
    # a quota: the holder stops at its share, the trainer offloads every save
    assert 0 < held["holder"]["offloaded_bytes"] <= 32 << 20 and held["holder"]["refused"].get("over quota", 0) > 0
    assert all(t["refused"] == {} for t in held["trainer"]), held
    assert all(t["offloaded_bytes"] > f["offloaded_bytes"] for t, f in zip(held["trainer"], free["trainer"]))
