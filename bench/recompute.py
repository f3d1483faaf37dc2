"""What recomputing W1's blocks costs the host and holds: storm.plan's reentrant recompute against the non-reentrant one.

    python bench/recompute.py --out bench/results/recompute-w1.json   # CUDA

Per variant, a fresh model whose first k blocks are storm.recompute.Recompute (the wrapper
storm.plan sets as a recomputed block's forward), reentrant or not, and no offload (k = 0):
median over --steps steps, after 3, of bench/profile_step.timed_step's times: the host's to
return from forward and from backward, the compute stream's for each, and the whole step
(synchronized), and the steps' peak GPU memory above what was allocated before them
(``peak_MiB``: what the planner's besides compares per form); --rounds rounds of every variant in turn, as the lent hosts drift. When
forward's or backward's host time reaches its GPU time the step is host-bound and every
microsecond of a recompute's Python is step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storm.recompute import Recompute  # noqa: E402
from offload import cuda_device, write  # noqa: E402
from profile_step import medians, timed_step  # noqa: E402
from workloads import W1  # noqa: E402


def variant(k: int, reentrant: bool, steps: int, device: torch.device) -> dict:
    model, x = W1.build(device)
    for b in list(model.blocks)[:k]:
        b.forward = Recompute(type(b).forward.__get__(b), device, reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(3):
        timed_step(model, x, opt, None)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    times = [timed_step(model, x, opt, None) for _ in range(steps)]
    peak_mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    del model, x, opt
    torch.cuda.empty_cache()
    return {**medians(times), "peak_MiB": round(peak_mib, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[3, 12], help="recompute the first k blocks")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("recompute.py")
    if device is None:
        return 2
    variants = [("none", 0, True)] + [(f"{'reentrant' if r else 'non-reentrant'}-{k}", k, r)
                                      for k in args.blocks for r in (True, False)]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for _ in range(args.rounds):
        for label, k, reentrant in variants:
            runs[label].append(variant(k, reentrant, args.steps, device))
            print(label, runs[label][-1], flush=True)
    summary = {label: medians(rs) for label, rs in runs.items()}
    write(args, {"workload": "W1", "steps": args.steps, "rounds": args.rounds, "runs": runs, "median": summary})
    for label, s in summary.items():
        print(f"{label:<18} forward host {s['host_fwd_ms']:>7.2f} gpu {s['gpu_fwd_ms']:>7.2f}  backward host "
              f"{s['host_bwd_ms']:>7.2f} gpu {s['gpu_bwd_ms']:>7.2f}  step {s['step_ms']:>7.2f} ms  "
              f"peak {s['peak_MiB']:>7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
