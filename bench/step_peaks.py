"""Each step's peak under ``storm.enable(model, peak=X)`` on a zoo cell, from its first step: which
phase the planner was in, what it read of the steps it measured, and what each step peaked at as
bench/zoo.py's rows read it (above the step's start, the optimizer's step counted); for the
steps asked for, what was alive on the device at the step's peak, by where it was allocated.
For a plan whose settled steps peak above what the planner measured of it.

    python bench/step_peaks.py --cell mistral-wide --peak 2.93GiB --out FILE   # CUDA
    python bench/step_peaks.py --cell mistral-wide --peak 2.93GiB --record 1 3 --out FILE

A step's own peak is read for settled steps alone: the planner resets the allocator's peak
statistics within the steps it measures or tries (its reading of them is ``planner_read_MiB``).
``--record N...``: the settled steps (1 = the first) whose allocator history is recorded
(torch.cuda.memory._record_memory_history with Python stacks: it slows the host, so those steps
run later than the others) and replayed to the step's highest moment; what was alive there and
allocated in the step is grouped by the innermost frame of STORM, the model's library or this
script. ``--record-phases P...``: every step of these planner phases too (e.g. measure).
``--profile``: the last settled step runs under torch.profiler (host and device, Python frames
included), and the entries that took the most host time of their own are kept, with the step's
timeline (where the compute stream sat idle, and when each copy ran); with ``--baseline
METHOD`` (a method of common.Trainer, such as checkpoint), a step of that method on the same cell
too, once STORM's trainer is closed: where a plan's step time goes against the method it competes
with. Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import sys
import tempfile
from typing import Any, Iterator

import torch
from zoo import CELLS

import trace_gaps
from common import GiB, Trainer, cuda_device, plan_summary, write
from stormd.wire.sizes import exact_size

MiB = 1 << 20
FORWARD = "step_peaks.forward"  # the host annotation of a profiled step's forward (trace_gaps.steps)
OURS = ("/storm/", "/transformers/", "/bench/", "torch/utils/checkpoint")  # frames that say where, innermost first


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame of STORM, the model's library or a bench script (else the innermost)."""
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def storm_path(frames: list[dict[str, Any]], most: int = 8) -> str:
    """STORM's frames of a stack, innermost first: which of its paths allocated a block."""
    ours = [f for f in frames if "/storm/" in f["filename"]][:most]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in ours)


def at_peak(events: list[dict[str, Any]], top: int = 12) -> dict:
    """Replays a recorded step (the allocator's device trace, begun at the step's start): the most
    it held above its start, the event where it did, and the blocks allocated in the step and
    alive there, summed by stream and ``where`` they were allocated, the largest ``top`` groups."""
    level = high = 0
    at = -1
    alive: dict[int, tuple[int, int, str, str]] = {}  # address -> size, stream, where, STORM's path
    peak_alive: dict[int, tuple[int, int, str, str]] = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            level += e["size"]
            frames = e.get("frames", [])
            alive[e["addr"]] = (e["size"], e["stream"], where(frames), storm_path(frames))
            if level > high:
                high, at, peak_alive = level, i, dict(alive)
        elif e["action"] == "free_requested":
            level -= e["size"]
            alive.pop(e["addr"], None)
    groups: collections.Counter[tuple[int, str, str]] = collections.Counter()
    counts: collections.Counter[tuple[int, str, str]] = collections.Counter()
    for size, *key in peak_alive.values():
        groups[tuple(key)] += size  # type: ignore[index]
        counts[tuple(key)] += 1  # type: ignore[index]
    return {"peak_MiB": round(high / MiB, 1), "event": at, "events": len(events),
            "alive_MiB": round(sum(s for s, *_ in peak_alive.values()) / MiB, 1),
            "groups": [{"stream": key[0], "where": key[1], "MiB": round(b / MiB, 1), "blocks": counts[key]}
                       | ({"storm": key[2]} if key[2] else {}) for key, b in groups.most_common(top)]}


def recorded_step(t: Trainer, device: torch.device) -> tuple[float, dict]:
    """One step of ``t`` with the allocator's history recorded: its seconds, and at_peak of it."""
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=1 << 20)
    try:
        seconds = t.step()
        index = device.index if device.index is not None else torch.cuda.current_device()
        events = torch.cuda.memory._snapshot()["device_traces"][index]
    finally:
        torch.cuda.memory._record_memory_history(None)
    return seconds, at_peak(events)


def profile_summary(averages: list[Any], top: int = 30) -> list[dict]:
    """torch.profiler's key averages, the ``top`` that took the most host time of their own (an op,
    a Python function, a CUDA runtime call such as a host wait): calls, host ms of their own and in
    all, and the device ms of their own."""
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 3),
             "host_ms": round(e.cpu_time_total / 1e3, 3),
             "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3)} for e in rows]


@contextlib.contextmanager
def forward_annotated(model: torch.nn.Module) -> Iterator[None]:
    """Within: each forward of ``model`` is a host annotation named FORWARD in a profile, which
    bench/trace_gaps.py splits a step's idle time at (forward against backward)."""
    opened: list[Any] = []

    def enter(m: torch.nn.Module, args: Any) -> None:
        opened.append(torch.profiler.record_function(FORWARD).__enter__())

    def leave(m: torch.nn.Module, args: Any, out: Any) -> None:
        opened.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def profiled_step(t: Trainer) -> dict:
    """One step of ``t`` under torch.profiler: its ms, profile_summary of it, and its timeline as
    bench/trace_gaps.py reads the trace: where the compute stream sat idle, in forward and in
    backward, waiting for the host or for another stream, when each copy ran, and what the host was
    doing in the longest stretches it was late for."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with forward_annotated(t.model), torch.profiler.profile(activities=activities, with_stack=True) as prof:
        seconds = t.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = trace_gaps.load(path)
    return {"ms": round(seconds * 1e3, 2), "top": profile_summary(list(prof.key_averages())),
            "timeline": {"steps": trace_gaps.steps(events, FORWARD), "copies": trace_gaps.copies(events),
                         "late": trace_gaps.late(events)}}


def baseline_profile(cell: str, method: str, device: torch.device, warmup: int = 3) -> dict:
    """A step of ``method`` on ``cell`` under torch.profiler, after ``warmup`` steps."""
    t = Trainer(CELLS[cell], method, {}, device)
    try:
        t.warm(warmup)
        return {"method": method, **profiled_step(t)}
    finally:
        t.close()


def cap(text: str) -> int:
    """A peak as bench/zoo.py prints caps: bytes, or a size in a unit with decimals that need not
    make whole bytes ('2.93GiB', rounded down to a byte), which parse_size refuses."""
    try:
        return math.floor(exact_size(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", required=True, choices=list(CELLS))
    p.add_argument("--peak", required=True, type=cap, help="storm.enable's peak=, e.g. 2.93GiB or bytes")
    p.add_argument("--steps", type=int, default=8, help="settled steps after the planner settles")
    p.add_argument("--record", nargs="*", type=int, default=[], metavar="N",
                   help="settled steps (1 = the first) whose allocator history is replayed at their peak")
    p.add_argument("--record-phases", nargs="*", default=[], metavar="PHASE",
                   help="planner phases (storm.planner.Phase values) whose steps are recorded too")
    p.add_argument("--profile", action="store_true", help="the last settled step under torch.profiler")
    p.add_argument("--baseline", metavar="METHOD", help="with --profile: a step of this method profiled too")
    p.add_argument("--max-steps", type=int, default=60, help="steps before giving up on settling")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("step_peaks.py")
    if device is None:
        return 2
    t = Trainer(CELLS[args.cell], "enable", {"mode": "embedded", "peak": args.peak}, device)
    rows: list[dict] = []
    settled, checks = 0, 0
    try:
        while settled < args.steps and len(rows) < args.max_steps:
            phase, plan = None, None
            planner = t.planner
            if planner is not None:
                planner.settled  # reads the last step: what it measured, and so this step's phase and plan
                if planner.checks > checks and rows and planner.measured_peak is not None:
                    rows[-1]["planner_read_MiB"] = round(planner.measured_peak / MiB, 1)
                checks = planner.checks
                phase, plan = planner.phase.value, planner.plan
            if rows:
                print(rows[-1], flush=True)
            record = phase == "settled" and settled + 1 in args.record or phase in args.record_phases
            profile = args.profile and phase == "settled" and settled + 1 == args.steps
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            alive = profiled = None
            if record:
                seconds, alive = recorded_step(t, device)
            elif profile:
                profiled = profiled_step(t)
                seconds = profiled["ms"] / 1e3
            else:
                seconds = t.step()
            row = {"step": len(rows) + 1, "phase": phase, "ms": round(seconds * 1e3, 2),
                   "peak_MiB": round((torch.cuda.max_memory_allocated(device) - base) / MiB, 1)
                   if phase == "settled" else None}
            if plan is not None:
                row["plan"] = {"full": plan.full, "offloaded": plan.offloaded, "recomputed": len(plan.recomputed),
                               "inputs_offloaded": plan.inputs_offloaded,
                               "max_held_MiB": round(plan.max_held_bytes / MiB, 1),
                               "prefetch_MiB": round(plan.prefetch_bytes / MiB, 1)}
            if alive is not None:
                row["at_peak"] = alive
            if profiled is not None:
                row["profile"], row["timeline"] = profiled["top"], profiled["timeline"]
            rows.append(row)
            settled += phase == "settled"
        if rows:
            print(rows[-1], flush=True)
        summary = plan_summary(t.planner) if t.planner is not None else None
        explain = t.planner.explain() if t.planner is not None else None
    finally:
        t.close()
    baseline = baseline_profile(args.cell, args.baseline, device) if args.profile and args.baseline else None
    write(args.out, {"cell": args.cell, "peak_GiB": round(args.peak / GiB, 3), "steps": rows, "plan": summary,
                     "explain": explain, "baseline": baseline}, device, command=" ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
