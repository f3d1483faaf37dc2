"""bench/step_peaks.py replays a recorded step to its highest moment: what it held above the
step's start there, and what was alive then, by where it was allocated."""

from __future__ import annotations

import torch

from helpers import bench_module

for sibling in ("hf", "zoo_verdicts", "zoo", "trace_gaps"):  # the zoo's cells: the script imports them as siblings
    bench_module(sibling)
step_peaks = bench_module("step_peaks")
trace_gaps = bench_module("trace_gaps")
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



def test_a_profiled_forward_is_annotated_for_trace_gaps_to_split_the_step_at(tmp_path):
    """forward_annotated opens a host annotation at the model's forward and closes it at its end: a
    real CPU profile's trace holds it around forward's operations and not backward's."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    with step_peaks.forward_annotated(model), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = trace_gaps.load(tmp_path / "t.json")
    (forward,) = [e for e in events if e.get("name") == step_peaks.FORWARD and e.get("ph") == "X"]
    inside = {e["name"] for e in events if e.get("cat") == "cpu_op"
              and forward["ts"] <= e["ts"] < forward["ts"] + forward["dur"]}
    assert "aten::linear" in inside and "aten::tanh" in inside and not any("Backward" in n for n in inside)
    assert not model._forward_pre_hooks and not model._forward_hooks  # taken off on leaving


def test_the_peak_is_taken_as_bench_zoo_prints_caps_decimals_rounded_down_to_a_byte():
    """Its help's own example, 2.93GiB, is no whole number of bytes, which parse_size refuses: the
    --peak of a call after a zoo run (6.549GiB) was refused so."""
    import argparse

    import pytest

    assert step_peaks.cap("2.93GiB") == 3146063544 and step_peaks.cap("6.549 GiB") == 7031935205
    assert step_peaks.cap("7031902976") == 7031902976 and step_peaks.cap("512MiB") == 512 << 20
    for bad in ("lots", "-1GiB", "2.93 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            step_peaks.cap(bad)
