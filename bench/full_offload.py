"""Where full offload's peak is, and what moves it: STORM's storm.offload() beside torchtune's
OffloadActivations and torch's save_on_cpu, on a Hugging Face decoder, with the copy queue
(``max_held_bytes``) and the prefetch window (``prefetch_bytes``) varied.

    python bench/full_offload.py --out bench/results/full-offload-<device>-<date>-<commit>.json   # CUDA

Two diagnostic variants switch parts of STORM's room (storm/room.py) off for their steps:
"storm,room=queue" keeps the user's prefetch window in backward (the room limits only the copy
queue), "storm,room=off" neither. Per row, the median step and the step's peak above its start,
split into forward's peak and backward's (the peak statistics are reset as forward ends); rows
run in alternation, --rounds rounds of --steps steps each, after a warm-up, so that the ratios
compare like with like. With --peaks, one more step of each row runs under the allocator's
record (torch.cuda.memory._record_memory_history) and the JSON says what was alive at that
step's peak, grouped by the innermost frame outside torch (and each block of 32 MiB or more, with
when and on which stream it was allocated), and the profiled step's record with
its readings and rises (storm/allocator_record.py), the allocator's events themselves only with
--traces (megabytes). --cell trains a zoo cell (bench/zoo.py) instead.
Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
from hf import HF
from zoo import CELLS

import storm
from common import GiB, Llama, cuda_device, torchtune_offload, write
from storm.room import Room

# a decoder of another shape than W3 (issue 51's: 12 layers, hidden 2560, 8,192 tokens a step)
MODEL: Llama | HF = Llama("L12-2560", layers=12, hidden=2560, mlp=6912, heads=20, kv_heads=4, vocab=32000, batch=4,
                          seq=2048)
MiB = 1 << 20
LARGE = 32 * MiB  # blocks alive at a peak listed one by one (when each was allocated, on which stream)


@contextlib.contextmanager
def room_parts(method: str) -> Iterator[None]:
    """A diagnostic variant's room: the whole of it, the copy queue's alone, or none (see above)."""
    saved = (Room.queue, Room.window)
    if "room=off" in method:
        Room.queue = lambda self, made: 1 << 62
    if "room=" in method:
        Room.window = lambda self, unpacked, limit: limit
    try:
        yield
    finally:
        Room.queue, Room.window = saved


def contexts(method: str) -> object:
    if method == "none":
        return None
    if method == "torchtune":
        return torchtune_offload()()
    if method == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    opts = {}
    for part in method.split(",")[1:]:  # "storm,max_held_bytes=64MiB,prefetch_bytes=0"
        k, v = part.split("=")
        if k != "room":
            opts[k] = v
    return storm.offload(**opts)


def step(model: torch.nn.Module, ids: torch.Tensor, method: str, device: torch.device) -> tuple[float, int, int]:
    """One step: seconds, forward's peak and backward's (bytes above the step's start)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with room_parts(method):
        ctx = contexts(method)
        if ctx is None:
            loss = MODEL.forward(model, ids)
        else:
            with ctx:
                loss = MODEL.forward(model, ids)
        fwd = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        del loss
        torch.cuda.synchronize(device)
    bwd = torch.cuda.max_memory_allocated(device) - base
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - t0, fwd, bwd


def recorded(run: Callable[[], object]) -> list[dict]:
    """The allocator's record (with Python frames) of what ``run()`` allocates and frees on this device."""
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        run()
        return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def compact(trace: list[dict]) -> list[list]:
    """A record's events as [action, address, bytes, stream, where], for the JSON."""
    return [[e["action"], e["addr"], e["size"], e.get("stream"), where(e.get("frames", []))] for e in trace]


def alive_at_peak(method: str, model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict:
    """One step of ``method`` under the allocator's record: where its peak fell (the event's index)
    and the bytes alive there, by the innermost frame outside torch. A block counts from its
    allocation to its free's request, as the allocator's allocated bytes do (a block used on
    another stream completes its free later, once that stream's work is done)."""
    trace = recorded(lambda: step(model, ids, method, device))
    alive: dict[int, tuple[int, dict]] = {}  # address: (the allocation's index, its event)
    now = peak = peak_at = 0
    at_peak: list[tuple[int, dict]] = []
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            alive[e["addr"]] = (i, e)
            now += e["size"]
        elif e["action"] == "free_requested" and e["addr"] in alive:
            now -= alive.pop(e["addr"])[1]["size"]
        if now > peak:
            peak, peak_at, at_peak = now, i, list(alive.values())
    groups: collections.Counter[str] = collections.Counter()
    for _, e in at_peak:
        groups[where(e.get("frames", []))] += e["size"]
    large = [{"event": i, "MiB": round(e["size"] / MiB, 1), "stream": e.get("stream"),
              "where": where(e.get("frames", []))} for i, e in at_peak if e["size"] >= LARGE]
    return {"peak_MiB": round(peak / MiB, 1), "event": peak_at, "events": len(trace),
            "alive_MiB": {k: round(v / MiB, 1) for k, v in groups.most_common(20)}, "large_blocks": large,
            "trace": compact(trace)}


def profiled(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict:
    """A fresh store's first two full-offload steps (the profile, then the first to follow its room)
    under the allocator's record, started here: STORM reads it and leaves it running. The record's
    events, the profile's readings, marks and rises, and the room's limits."""
    storm.close_all()
    trace = recorded(lambda: [step(model, ids, "storm", device) for _ in range(2)])
    room = storm.registry.session_for("auto", None, None).rooms.room
    p = room.profile if room is not None else None
    return {"events": compact(trace),
            "profile": p and {k: getattr(p, k) for k in ("sizes", "saves", "unpack_sizes", "unpacks", "unpack_saves",
                                                          "marks", "rises")},
            "room": room and {"floor": room.floor, "kept": room.kept,
                              "saves": room._saves, "between": room._between}}


def where(frames: list[dict]) -> str:
    """An allocation's place: the innermost frame outside torch's own files, with the torch frame it called."""
    inner = "?"
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name or "/storm/" in name:
            return f"{name.rsplit('/', 2)[-2:]!s}:{f.get('line')} {f.get('name')} <- {inner}"
        inner = f.get("name", "?")
    return inner


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=[
        "none", "torchtune", "save_on_cpu", "storm", "storm,max_held_bytes=64MiB",
        "storm,prefetch_bytes=64MiB", "storm,max_held_bytes=64MiB,prefetch_bytes=64MiB",
        "storm,max_held_bytes=16MiB,prefetch_bytes=16MiB"])
    ap.add_argument("--peaks", action="store_true", help="what was alive at each row's peak (one recorded step)")
    ap.add_argument("--traces", action="store_true", help="with --peaks, the allocator's events too (megabytes)")
    ap.add_argument("--cell", choices=list(CELLS), help="a cell of bench/zoo.py instead of the 12-layer Llama")
    args = ap.parse_args()
    if args.cell:
        global MODEL  # the workload every row of this run trains
        MODEL = CELLS[args.cell]
    device = cuda_device("full_offload.py")
    if device is None:
        return 2
    model, ids = MODEL.build(device)
    rows: dict[str, dict[str, list]] = {m: {"ms": [], "fwd": [], "bwd": []} for m in args.methods}
    for m in args.methods:  # warm-up: kernels, the pool, torchtune's streams
        for _ in range(2):
            step(model, ids, m, device)
    for _ in range(args.rounds):
        for m in args.methods:
            for _ in range(args.steps):
                s, f, b = step(model, ids, m, device)
                rows[m]["ms"].append(s * 1e3)
                rows[m]["fwd"].append(f)
                rows[m]["bwd"].append(b)
    out = {}
    for m, r in rows.items():
        out[m] = {"step_ms": round(statistics.median(r["ms"]), 1),
                  "forward_peak_GiB": round(max(r["fwd"]) / GiB, 3), "backward_peak_GiB": round(max(r["bwd"]) / GiB, 3),
                  "peak_GiB": round(max(max(r["fwd"]), max(r["bwd"])) / GiB, 3)}
        print(f"{m:55s} {out[m]['step_ms']:8.1f} ms  fwd {out[m]['forward_peak_GiB']:.3f}  "
              f"bwd {out[m]['backward_peak_GiB']:.3f} GiB", flush=True)
    peaks = {m: alive_at_peak(m, model, ids, device) for m in args.methods} if args.peaks else None
    # a process of torch's rows alone builds no STORM pool beside the pinned memory torch's own allocator caches
    stormed = any(m.startswith("storm") for m in args.methods)
    record = profiled(model, ids, device) if args.peaks and stormed else None
    if peaks:
        print(json.dumps({m: {k: v for k, v in p.items() if k != "trace"} for m, p in peaks.items()}, indent=1))
        if not args.traces:  # the summaries above stay; the events are for --traces
            for p in peaks.values():
                p.pop("trace")
            if record:
                record.pop("events")
    room = stormed and storm.registry.session_for("auto", None, None).rooms.room  # what the storm rows' profile found
    found = room and {"floor_MiB": room.floor / MiB, "saves_MiB": [b / MiB for b in room._saves],
                      "between_MiB": [b / MiB for b in room._between]}
    write(args.out, {"model": MODEL.name, "rows": out, "room": found, "peaks": peaks,
                          "profiled": record}, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
