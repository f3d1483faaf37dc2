"""bench/codec.py on the CPU: both ways of timing a call, the byte-weighted aggregate, and a small
run end to end (every codec's decode checked bit for bit, both throughputs reported)."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import bench_module, bench_result, run_bench

codec = bench_module("codec")
Timing, aggregate, timed = codec.Timing, codec.aggregate, codec.timed


def test_timed_reports_a_call_alone_and_calls_back_to_back():
    calls = []

    def fn() -> int:
        calls.append(time.perf_counter())
        time.sleep(0.002)
        return len(calls)

    timing, out = timed(fn, torch.device("cpu"), reps=3)
    assert len(calls) == 1 + 3 + 3  # a warm-up, three alone, three back to back
    assert out == 7  # the last call's result
    assert 0.002 <= timing.call < 0.05 and 0.002 <= timing.stream < 0.05


def test_aggregate_weighs_by_bytes_both_ways_and_skips_what_was_not_timed():
    parts = [{"raw": 300, "enc_bytes": 100, "te": Timing(1e-6, 0.5e-6), "td": Timing(2e-6, 1e-6), "ok": True},
             {"raw": 100, "enc_bytes": 100, "te": Timing(1e-6, 0.5e-6), "td": Timing(0.0, 0.0), "ok": True},
             {"raw": 200, "enc_bytes": 200, "te": None, "td": None, "ok": True}]  # stored raw, untimed
    out = aggregate(parts)
    assert out["ratio"] == round(600 / 400, 4)
    assert out["enc_GBps"] == round(400 / 2e-6 / 1e9, 3) and out["enc_GBps_back_to_back"] == round(400 / 1e-6 / 1e9, 3)
    assert out["dec_GBps"] == round(400 / 2e-6 / 1e9, 3) and out["dec_GBps_back_to_back"] == round(400 / 1e-6 / 1e9, 3)
    assert out["not_applicable_bytes"] == 200 and out["lossless"]
    assert not aggregate([{**parts[0], "ok": False}])["lossless"]


@pytest.mark.slow  # processes, a daemon and real encodes: tens of seconds on 2 cores
def test_a_small_cpu_run_checks_every_codec_and_reports_both_throughputs(tmp_path):
    out = tmp_path / "codec.json"
    r = run_bench("codec.py", "--device", "cpu", "--size-mib", "1", "--reps", "1", "--kinds", "bf16-gauss",
                  "--skip", "zstd,scan,ancf", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["meta"]["device"] == "cpu" and result["size_bytes"] == 1 << 20
    rows = {r["impl"]: r for r in result["rows"]}
    assert {"storm:raw", "storm:huff_exp", "storm:ancf_exp_frame"} <= set(rows)
    for r in rows.values():
        if "ratio" in r:
            assert r["lossless"], r["impl"]
            assert r["enc_GBps"] > 0 and r["enc_GBps_back_to_back"] > 0, r["impl"]
    assert rows["storm:ancf_exp_frame"]["ratio"] > 1.3  # N(0,1) bf16 frames: 1.323 on the device
