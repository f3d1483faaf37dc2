"""bench/step_peaks.py replays a recorded step to its highest moment: what it held above the
step's start there, and what was alive then, by where it was allocated."""

from __future__ import annotations

import torch

from helpers import bench_module

for sibling in ("hf", "zoo_verdicts", "zoo"):  # the zoo's cells: the script imports them as siblings
    bench_module(sibling)
step_peaks = bench_module("step_peaks")
MiB = 1 << 20


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def test_the_peak_is_the_highest_moment_and_what_was_alive_there_is_grouped_by_where():
    queue = [frame("/usr/lib/torch/autograd/graph.py", 10, "pack"), frame("/src/storm/session.py", 250, "save")]
    model = [frame("/x/transformers/models/mistral/modeling_mistral.py", 90, "forward")]
    events = [
        {"action": "free_requested", "addr": 1, "size": 8 * MiB, "stream": 0},  # held before the step
        {"action": "alloc", "addr": 2, "size": 64 * MiB, "stream": 0, "frames": model},
        {"action": "alloc", "addr": 3, "size": 32 * MiB, "stream": 7, "frames": queue},
        {"action": "alloc", "addr": 4, "size": 32 * MiB, "stream": 7, "frames": queue},
        {"action": "free_requested", "addr": 3, "size": 32 * MiB, "stream": 7},
        {"action": "alloc", "addr": 5, "size": 48 * MiB, "stream": 0, "frames": model},  # the peak: 136 MiB
        {"action": "free_requested", "addr": 5, "size": 48 * MiB, "stream": 0},
        {"action": "alloc", "addr": 6, "size": 40 * MiB, "stream": 0, "frames": []},
    ]
    out = step_peaks.at_peak(events)
    assert out["peak_MiB"] == 136.0 and out["event"] == 5 and out["alive_MiB"] == 144.0
    assert out["groups"] == [
        {"stream": 0, "where": "mistral/modeling_mistral.py:90 forward", "MiB": 112.0, "blocks": 2},
        {"stream": 7, "where": "storm/session.py:250 save", "MiB": 32.0, "blocks": 1, "storm": "session.py:250 save"},
    ]


def test_a_profile_keeps_what_took_the_most_host_time_of_its_own():
    """profile_summary over a real torch.profiler run (on the CPU): the entries that took the most
    host time of their own, most first, each with its calls; Python functions are among them."""
    x = torch.randn(256, 256)

    def matmuls() -> None:
        for _ in range(5):
            x.mm(x)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        matmuls()
    top = step_peaks.profile_summary(list(prof.key_averages()), top=50)
    assert [r["self_host_ms"] for r in top] == sorted((r["self_host_ms"] for r in top), reverse=True)
    mm = next(r for r in top if r["name"] == "aten::mm")
    assert mm["calls"] == 5 and mm["host_ms"] >= mm["self_host_ms"] > 0
    assert any("matmuls" in r["name"] for r in top)
    assert len(step_peaks.profile_summary(list(prof.key_averages()), top=2)) == 2


def kernel(tid: int, ts: float, dur: float, name: str = "gemm", cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_a_timeline_finds_where_the_compute_stream_sat_idle_and_when_each_copy_ran():
    """From a chrome trace's GPU events: the compute stream (the one of most kernels), its idle
    time in all, before the loss's first kernel, and per bucket of the span; the copy streams."""
    trace = {"traceEvents": [
        kernel(7, 0, 1000), kernel(7, 1500, 1000), kernel(7, 3000, 1000),  # two gaps of 500 us in forward
        kernel(7, 9000, 1000, "cunn_SoftMaxForward"),  # 5 ms waiting on the copy below: before the loss
        kernel(7, 10000, 6000),
        kernel(13, 1000, 600, "Memcpy DtoH", "gpu_memcpy"),
        kernel(17, 4000, 5000, "Memcpy HtoD", "gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 0, "dur": 99999, "name": "aten::mm"},  # host: left out
    ]}
    out = step_peaks.timeline(trace, bucket_ms=4.0)
    assert out["span_ms"] == 16.0 and out["loss_at_ms"] == 9.0
    assert out["compute"] == {"busy_ms": 10.0, "idle_ms": 6.0, "idle_before_loss_ms": 6.0,
                              "idle_per_4_ms": [1.0, 5.0, 0.0, 0.0, 0.0]}
    assert out["copies"] == {"13": {"busy_ms": 0.6, "count": 1, "at_ms": [[1.0, 0.6]]},
                             "17": {"busy_ms": 5.0, "count": 1, "at_ms": [[4.0, 5.0]]}}
    assert step_peaks.timeline({"traceEvents": []}) == {}
