"""bench/trace_gaps.py: a step's compute-stream idle time, split by phase and by whether the host
launched the next operation late (host) or early, so that the stream waited (wait)."""

from __future__ import annotations

import gzip
import json

from helpers import bench_module

trace_gaps = bench_module("trace_gaps")


def kernel(ts: float, dur: float, correlation: int, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}


def launch(ts: float, correlation: int, name: str = "cudaLaunchKernel") -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": correlation}}


def events() -> list[dict]:
    """One step: forward annotated over [0, 100) us, four kernels on the compute stream, one elsewhere."""
    return [
        {"ph": "X", "cat": "user_annotation", "name": "DistributedDataParallel.forward", "ts": 0, "dur": 100},
        launch(5, 1), kernel(10, 10, 1),
        launch(40, 2), kernel(50, 10, 2),      # launched after the stream went idle at 20: forward, host, 30 us
        launch(120, 3), kernel(200, 10, 3),    # launched in backward after the idle began at 60: host, 140 us
        launch(150, 4), kernel(300, 10, 4),    # launched before the idle began at 210: the stream waited, 90 us
        launch(160, 5), kernel(170, 500, 5, stream=9),  # another stream: not the compute stream's
        launch(400, 6, "cudaDeviceSynchronize"),
        launch(410, 7), kernel(420, 10, 7),    # after the step's end: not its
    ]


def test_idle_time_is_split_by_phase_and_by_who_was_late(tmp_path):
    (step,) = trace_gaps.steps(events(), "DistributedDataParallel.forward")
    assert step == {"step_ms": 0.31, "busy_ms": 0.04,
                    "idle_ms": {"forward": {"host": 0.03, "wait": 0.0}, "backward": {"host": 0.14, "wait": 0.09}}}


def test_a_gzipped_trace_reads_as_a_plain_one(tmp_path):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events()}, f)
    assert trace_gaps.load(path) == events()


def test_a_trace_without_kernels_or_steps_has_no_steps():
    assert trace_gaps.steps([launch(1, 1)], "DistributedDataParallel.forward") == []
    assert trace_gaps.steps([kernel(1, 1, 1)], "DistributedDataParallel.forward") == []


def test_backward_host_time_outside_the_operations_inside_its_nodes():
    node = {"ph": "X", "cat": "cpu_op", "name": "AddmmBackward0", "ts": 1000, "dur": 100, "tid": 2}
    inside = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1010, "dur": 30, "tid": 2},
              {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 1020, "dur": 5, "tid": 2},  # within mm
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1060, "dur": 10, "tid": 2,
               "args": {}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1010, "dur": 500, "tid": 3}]  # another thread
    found = trace_gaps.backward_host([node, *inside])
    assert found["nodes_ms"] == 0.1 and found["outside_ops_ms"] == 0.06  # 100 us less mm's 30 and the launch's 10
    assert found["ops_ms"] == {"aten::mm": 0.53, "aten::empty": 0.01, "cudaLaunchKernel": 0.01, "cuLaunchKernelEx": 0.0}


def test_copies_are_what_ran_beside_the_compute_stream_and_when():
    """The streams other than the compute stream (the one of most kernels), each with its busy
    time and when each operation began, from the trace's first GPU operation."""
    copy = dict(kernel(170, 500, 5, stream=9), cat="gpu_memcpy")
    assert trace_gaps.copies([*events(), copy]) == {
        "9": {"busy_ms": 1.0, "count": 2, "at_ms": [[0.16, 0.5], [0.16, 0.5]]}}
    assert trace_gaps.copies([*events(), copy], listed=1)["9"]["at_ms"] == [[0.16, 0.5]]
    assert trace_gaps.copies([launch(1, 1)]) == {}


def test_late_lists_the_longest_stretches_the_host_was_late_for_and_what_it_was_in():
    """Of the stretches the compute stream idled because the next operation came late, the longest
    first, each with the launching thread's host events at its middle, outermost first: here a
    pack hook's Python inside a block's forward, on the thread that launched, not another's."""
    def on(e: dict, tid: int) -> dict:
        return {**e, "tid": tid}

    def python(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = [
        on(launch(5, 1), 1), kernel(10, 10, 1),
        on(launch(40, 2), 1), kernel(50, 10, 2),       # idle 20-50 for the host: 30 us, middle 30
        on(launch(150, 3), 1), kernel(200, 10, 3),     # idle 60-200: 140 us, middle (60 + 150) / 2
        on(launch(205, 4), 1), kernel(300, 10, 4),     # launched before the stream went idle: a wait
        python("step", 0, 400), python("block.forward", 20, 30), python("hooks.py: pack", 25, 10),
        python("backward", 100, 100), {"ph": "X", "cat": "cpu_op", "name": "MulBackward0", "ts": 100, "dur": 10,
                                       "tid": 1},
        python("elsewhere", 0, 400, tid=2),
    ]
    assert trace_gaps.late(trace) == [
        {"at_ms": 0.05, "idle_ms": 0.14, "inside": ["step", "backward", "MulBackward0"]},
        {"at_ms": 0.01, "idle_ms": 0.03, "inside": ["step", "block.forward", "hooks.py: pack"]}]
    assert trace_gaps.late(trace, top=1, depth=1) == [{"at_ms": 0.05, "idle_ms": 0.14, "inside": ["MulBackward0"]}]
    assert trace_gaps.late([launch(1, 1)]) == []
