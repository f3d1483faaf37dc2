"""bench/pool.py on this machine, with a small pool: start-up, the allocator's alloc/free and the
store's PUT/SEAL/GET/FREE, each timed and written with the run's provenance."""

from __future__ import annotations

from helpers import bench_module, bench_result, run_bench

pool = bench_module("pool")


def test_a_small_pool_is_timed_end_to_end(tmp_path):
    out = tmp_path / "pool.json"
    r = run_bench("pool.py", "--pool-size", "64MiB", "--pool-dir", str(tmp_path), "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu"
    assert result["pool_startup_s"]["pool_bytes"] == 64 << 20 and len(result["pool_startup_s"]["all"]) == 3
    assert set(result["allocator"]) == {"live_10", "live_100", "live_1000"}
    assert result["store_put_seal_get_free"]["plan_hits"] > 0  # steps after the first are placed by its plan
    assert not list(tmp_path.glob("stormd-*"))  # the pool segments it made are gone


def test_alloc_and_free_are_timed_with_that_many_extents_live():
    out = pool.alloc_free_us(live=10, n=100)
    assert out["alloc_us"] > 0 and out["free_us"] > 0
