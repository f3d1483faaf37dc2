"""Where a step's compute stream sat idle, and why: from the torch.profiler traces bench/ddp.py --profile writes.

    python bench/trace_gaps.py DIR/ranks2-W1-embedded-rank0.trace.json.gz DIR/ranks2-W1-daemon-rank0.trace.json.gz \\
        [--forward DistributedDataParallel.forward] [--out bench/results/trace-gaps-<device>-<date>-<commit>.json]

A step runs from its forward's host annotation (--forward) to the host's next cudaDeviceSynchronize
(bench/ddp.py synchronizes at the end of each step). The compute stream is the one that ran the most
kernels. Every idle stretch between two of its operations in the step is one of:
  host: the operation after it was launched only after the stretch began; the host was late
        (its Python, a wait on a reply, a lock), and the GPU had nothing queued;
  wait: it was launched before; the stream waited on an event (a copy not yet landed, another stream).
each counted in forward or backward by when that operation was launched (before or after the
forward annotation ended). A step whose backward idles mostly "wait" is bound by its copies; mostly
"host", by the host's work on its path. Over the whole trace it also sums the host time of
backward's nodes (``*Backward0``), the part of it outside every operation recorded inside them (an
unpack hook's Python, and its waits for replies, locks or the GIL), and the host time of a few
operations every node runs (aten::mm, aten::empty, kernel launches): slower there, the thread
was short of CPU. And it lists the longest stretches the host was late for, with what the launching
thread was inside then (``late``; Python functions where the profiler ran with_stack).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from common import write

GPU_OPS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cuda_runtime", "cuda_driver")


def load(path: str | Path) -> list[dict]:
    """A chrome trace's events (plain or gzipped JSON)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def steps(events: list[dict], forward: str) -> list[dict]:
    """Per step: its span on the GPU, the compute stream's busy time, and its idle time split into
    forward/backward and host/wait (module docstring), all in ms."""
    starts = sorted((e for e in events if e.get("name") == forward and e.get("ph") == "X"), key=lambda e: e["ts"])
    # an annotation nested in another of the same name (a module calling itself) is not a new step
    starts = [e for i, e in enumerate(starts) if i == 0 or e["ts"] >= starts[i - 1]["ts"] + starts[i - 1]["dur"]]
    syncs = sorted(e["ts"] for e in events if e.get("cat") in HOST_CALLS and e["name"] == "cudaDeviceSynchronize")
    launches = launched_by(events)
    stream = compute_ops(events)
    out = []
    for start in starts:
        ends = [t for t in syncs if t > start["ts"]]
        if not ends:
            break
        forward_end = start["ts"] + start["dur"]
        ops = [e for e in stream
               if start["ts"] <= launches.get(e["args"].get("correlation"), {"ts": -1})["ts"] < ends[0]]
        if not ops:
            continue
        idle = {phase: {"host": 0.0, "wait": 0.0} for phase in ("forward", "backward")}
        for gap, idle_from, launched in idle_stretches(ops, launches):
            phase = "forward" if launched["ts"] < forward_end else "backward"
            idle[phase]["host" if launched["ts"] > idle_from else "wait"] += gap
        last = max(e["ts"] + e["dur"] for e in ops)
        out.append({"step_ms": round((last - start["ts"]) / 1e3, 2),
                    "busy_ms": round(sum(e["dur"] for e in ops) / 1e3, 2),
                    "idle_ms": {p: {k: round(v / 1e3, 2) for k, v in d.items()} for p, d in idle.items()}})
    return out


def compute_stream(gpu: list[dict]) -> object | None:
    """Of a trace's GPU operations, the stream that ran the most kernels; None where none ran."""
    kernels = collections.Counter(e["args"]["stream"] for e in gpu if e["cat"] == "kernel")
    return kernels.most_common(1)[0][0] if kernels else None


def compute_ops(events: list[dict]) -> list[dict]:
    """The compute stream's operations in the order they ran; none where no kernel ran."""
    gpu = [e for e in events if e.get("cat") in GPU_OPS]
    compute = compute_stream(gpu)
    return sorted((e for e in gpu if e["args"]["stream"] == compute), key=lambda e: e["ts"]) if compute is not None \
        else []


def launched_by(events: list[dict]) -> dict[Any, dict]:
    """Each GPU operation's correlation id -> the host call that launched it."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in HOST_CALLS and "correlation" in e.get("args", {})}


def idle_stretches(ops: list[dict], launches: dict[Any, dict]) -> Iterator[tuple[float, float, dict]]:
    """Each stretch a stream sat idle between two of its operations (``ops``, in order), as (us idle,
    when it began, the host call that launched the operation after it): the host was late where
    that call came after the stretch began, else the stream waited."""
    for before, after in zip(ops, ops[1:]):
        idle_from = before["ts"] + before["dur"]
        launched = launches.get(after["args"].get("correlation"))
        if after["ts"] > idle_from and launched is not None:
            yield after["ts"] - idle_from, idle_from, launched


def copies(events: list[dict], listed: int = 40) -> dict:
    """What ran on each stream but the compute stream (a step's copies to and from the host): per
    stream its busy ms, its operations and when the first ``listed`` of them began (ms from the
    trace's first GPU operation) and how long each took: whether a fetch came when it was needed."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_OPS), key=lambda e: e["ts"])
    compute = compute_stream(gpu)
    if compute is None:
        return {}
    by_stream: dict = collections.defaultdict(list)
    for e in gpu:
        if e["args"]["stream"] != compute:
            by_stream[e["args"]["stream"]].append(e)
    t0 = gpu[0]["ts"]
    return {str(stream): {"busy_ms": round(sum(e["dur"] for e in ops) / 1e3, 2), "count": len(ops),
                          "at_ms": [[round((e["ts"] - t0) / 1e3, 2), round(e["dur"] / 1e3, 2)] for e in ops[:listed]]}
            for stream, ops in by_stream.items()}


def late(events: list[dict], top: int = 10, depth: int = 8) -> list[dict]:
    """The ``top`` longest stretches the compute stream sat idle for the host (the operation after
    one was launched only after it began), longest first: when it began (ms from the stream's first
    operation), how long it lasted, and what the launching thread was inside halfway between the
    stretch's start and that launch: its innermost ``depth`` host events, outermost first (Python
    functions, where torch.profiler ran with_stack, operations and annotations). Where the host's
    time went when the GPU had nothing queued: a hook's Python, a wait, a lock."""
    stream = compute_ops(events)
    if not stream:
        return []
    gaps = [(gap, idle_from, launched) for gap, idle_from, launched in idle_stretches(stream, launched_by(events))
            if launched["ts"] > idle_from]
    kinds = ("python_function", "cpu_op", "user_annotation")
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in kinds]
    out = []
    for gap, idle_from, launched in sorted(gaps, key=lambda g: -g[0])[:top]:
        at = (idle_from + launched["ts"]) / 2
        inside = sorted((e for e in host if e.get("tid") == launched.get("tid") and e["ts"] <= at < e["ts"] + e["dur"]),
                        key=lambda e: (e["ts"], -e["dur"]))
        out.append({"at_ms": round((idle_from - stream[0]["ts"]) / 1e3, 2), "idle_ms": round(gap / 1e3, 2),
                    "inside": [e["name"] for e in inside][-depth:]})
    return out


def backward_host(events: list[dict]) -> dict:
    """The host side of backward's nodes over the whole trace: the time of the ``*Backward0`` operations,
    the part of it outside every operation recorded inside them (an unpack hook's Python and its waits),
    and the host time of the operations most nodes run (in ms)."""
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", *HOST_CALLS)),
                 key=lambda e: e["ts"])
    by_thread: dict = collections.defaultdict(list)
    for e in ops:
        by_thread[e["tid"]].append(e)
    starts = {tid: [e["ts"] for e in thread] for tid, thread in by_thread.items()}  # for bisect
    total = outside = 0.0
    for e in ops:
        if e["cat"] != "cpu_op" or not e["name"].endswith("Backward0") or e["name"].startswith("autograd::"):
            continue
        end = e["ts"] + e["dur"]
        covered, reached = 0.0, e["ts"]
        at = starts[e["tid"]]
        # the thread's operations that start inside it, in start order
        for inner in by_thread[e["tid"]][bisect.bisect_left(at, e["ts"]):bisect.bisect_left(at, end)]:
            if inner is e:
                continue
            lo, hi = max(inner["ts"], reached), min(inner["ts"] + inner["dur"], end)
            if hi > lo:
                covered += hi - lo
                reached = hi
        total += e["dur"]
        outside += e["dur"] - covered
    common = ("aten::mm", "aten::empty", "cudaLaunchKernel", "cuLaunchKernelEx")
    spent = collections.Counter()
    for e in ops:
        if e["name"] in common:
            spent[e["name"]] += e["dur"]
    host = {name: round(spent[name] / 1e3, 2) for name in common}
    return {"nodes_ms": round(total / 1e3, 2), "outside_ops_ms": round(outside / 1e3, 2), "ops_ms": host}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--forward", default="DistributedDataParallel.forward",
                   help="the host annotation that opens each step's forward")
    p.add_argument("--source", help="the run the traces come from (its JSON), kept in --out")
    p.add_argument("--late", type=int, default=10, metavar="N",
                   help="the N longest stretches the compute stream waited for the host, with what it was doing")
    p.add_argument("--out")
    a = p.parse_args()
    results = {"forward": a.forward, "source": a.source, "traces": {}}
    for path in a.traces:
        events = load(path)
        found = steps(events, a.forward)
        nodes = backward_host(events)
        waits = late(events, a.late)
        results["traces"][Path(path).name] = {"steps": found, "backward_host": nodes, "late": waits}
        print(f"{Path(path).name}: backward's nodes {nodes['nodes_ms']} ms on the host, {nodes['outside_ops_ms']} ms "
              f"of it outside their operations; {nodes['ops_ms']}")
        for i, s in enumerate(found):
            f, b = s["idle_ms"]["forward"], s["idle_ms"]["backward"]
            print(f"{Path(path).name} step {i}: {s['step_ms']} ms, compute busy {s['busy_ms']} ms; idle forward "
                  f"host {f['host']} wait {f['wait']}, backward host {b['host']} wait {b['wait']}")
        for w in waits:
            print(f"  idle {w['idle_ms']} ms at {w['at_ms']} ms, the host in: {' > '.join(w['inside'])}")
    if a.out:
        write(a.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
