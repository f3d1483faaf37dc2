"""Where a planned step's peak GPU memory goes: storm.plan(peak=cap) steps, each planned one's
measured peak against the plan's prediction, and what was allocated at that peak, by who
allocated it (the CUDA caching allocator's history).

    python bench/plan_peak.py --workload W2 --caps 11.92 9.52 --out bench/results/plan-peak-w2.json

For each cap (GiB above the step's start, as bench/frontier.py asks), one model: the two traced
steps, then --steps planned ones, each recorded. Per planned step: the plan in force (blocks
offloaded and recomputed, copy queue, prefetch window), its predicted saves and gradients at
the peak, the measured peak, the margins the planner has learned, and the live allocations
at the replayed peak grouped by their first STORM frame (storm:module.function), else the
model's line, else "autograd" (allocations made by the C++ engine in backward, with no
Python frame: parameter and activation gradients). The replay counts an allocation until its
free is requested, as torch.cuda.max_memory_allocated does (a buffer freed behind another
stream's event, record_stream, is reused only once that event has passed).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from offload import write  # noqa: E402
from workloads import W1, W2  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def allocated_by(frames: list[dict]) -> str:
    for f in frames:
        if any(part in f["filename"] for part in ("/client/", "/storm/", "/stormd/")):
            return f"storm:{Path(f['filename']).stem}.{f['name']}"
    for f in frames:
        if "workloads.py" in f["filename"]:
            return f"model:{f['name']}:{f['line']}"
    return "autograd" if not frames else f"torch:{frames[0]['name']}"


def at_peak(snapshot: dict) -> tuple[int, dict[str, int]]:
    """Replay the recorded allocations: their largest total, and what made it up."""
    live: dict[int, tuple[int, str]] = {}
    total, best, best_live = 0, 0, {}
    for e in snapshot["device_traces"][torch.cuda.current_device()]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], allocated_by(e.get("frames", [])))
            total += e["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:  # where the allocator stops counting it
            total -= live.pop(e["addr"])[0]
    by, sizes = collections.Counter(), collections.defaultdict(list)
    for size, who in best_live.values():
        by[who] += size
        sizes[who].append(round(size / MiB, 1))
    # STORM's own buffers one by one (which fetched tensors are still alive there)
    return best, {k: round(v / MiB, 1) if not k.startswith("storm:") else [round(v / MiB, 1), sorted(sizes[k])]
                  for k, v in by.most_common()}


def planned_steps(w, cap: float, steps: int, pool_size: str) -> list[dict]:
    device = torch.device("cuda")
    model, x = w.build(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    plan = storm.plan(model.blocks, peak=int(cap * GiB), mode="embedded", pool_size=pool_size, min_bytes=1 << 20)
    rows = []
    for s in range(2 + steps):
        record = s >= 2  # the two traced steps are not recorded
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if record:
            torch.cuda.memory._record_memory_history(max_entries=500_000, context="alloc", stacks="python")
        t0 = time.perf_counter()
        with plan.step():
            p = plan.plan
            y = model(x)
        y.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        row = {"step": s, "step_ms": round((time.perf_counter() - t0) * 1e3, 1),
               "peak_MiB": round((torch.cuda.max_memory_allocated() - base) / MiB, 1)}
        if record:
            replayed, row["at_replayed_peak_MiB"] = at_peak(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
            row["replayed_peak_MiB"] = round(replayed / MiB, 1)
        if p is not None:
            row.update(offloaded=p.offloaded, recomputed=sorted(p.recomputed), copy_queue_MiB=p.max_held_bytes / MiB,
                       prefetch_window_MiB=p.prefetch_bytes / MiB,
                       predicted_MiB=round((plan.besides + plan._step_peak(p)) / MiB, 1),
                       target_MiB=round(plan.target / MiB, 1),
                       margins_MiB={"keep": plan._margins[False] / MiB, "offload": plan._margins[True] / MiB})
        print(row, flush=True)
        rows.append(row)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del y
    rows.append({"explain": plan.explain()})
    print(plan.explain(), flush=True)
    plan.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W2", choices=["W1", "W2"])
    p.add_argument("--caps", type=float, nargs="+", required=True, help="peak caps, GiB above the step's start")
    p.add_argument("--steps", type=int, default=4, help="planned steps recorded per cap")
    p.add_argument("--pool-size", default="24GiB")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    w = {"W1": W1, "W2": W2}[args.workload]
    results = {f"{cap:g}": planned_steps(w, cap, args.steps, args.pool_size) for cap in args.caps}
    write(args, {args.workload: results, "pool_size": args.pool_size})
    return 0


if __name__ == "__main__":
    sys.exit(main())
