"""What recomputing W1's blocks costs the host and holds: storm.plan's reentrant recompute against the non-reentrant one and torch's reentrant checkpoint.

    python bench/recompute.py --out bench/results/recompute-w1.json   # CUDA

Per variant, a fresh model whose first k blocks are storm.recompute.Recompute (the wrapper
storm.plan sets as a recomputed block's forward), reentrant or not, or torch.utils.checkpoint's
reentrant form in Recompute's place (``torch-reentrant``: what Recompute ran until 2026-11-26,
with the same hand-over of saved tensors), and no offload (k = 0):
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
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch.utils.checkpoint import checkpoint  # noqa: E402
from storm.recompute import Recompute, _release, _Saved  # noqa: E402
from offload import cuda_device, write  # noqa: E402
from profile_step import medians, timed_step  # noqa: E402
from workloads import W1  # noqa: E402


def torch_reentrant(forward: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """A block's forward recomputed by torch.utils.checkpoint(use_reentrant=True), with
    Recompute's grad-requiring tensor beside the input and its hand-over of saved tensors."""
    grad = torch.empty(0, device=device, requires_grad=True)

    def run(_grad: torch.Tensor, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # checkpoint's forward
            return forward(*args)
        with torch.autograd.graph.saved_tensors_hooks(_Saved, _Saved.take):
            out = forward(*args)
        _release(out)
        return out

    return lambda *args: checkpoint(run, grad, *args, use_reentrant=True)


FORMS: dict[str, Callable[[Callable[..., Any], torch.device], Callable[..., Any]]] = {
    "reentrant": lambda f, device: Recompute(f, device),
    "non-reentrant": lambda f, device: Recompute(f, device, reentrant=False),
    "torch-reentrant": torch_reentrant,
}


def variant(k: int, form: str, steps: int, device: torch.device) -> dict:
    model, x = W1.build(device)
    for b in list(model.blocks)[:k]:
        b.forward = FORMS[form](type(b).forward.__get__(b), device)
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
    p.add_argument("--forms", nargs="+", choices=list(FORMS), default=["reentrant", "non-reentrant"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("recompute.py")
    if device is None:
        return 2
    variants = [("none", 0, "reentrant")] + [(f"{form}-{k}", k, form) for k in args.blocks for form in args.forms]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for _ in range(args.rounds):
        for label, k, form in variants:
            runs[label].append(variant(k, form, args.steps, device))
            print(label, runs[label][-1], flush=True)
    summary = {label: medians(rs) for label, rs in runs.items()}
    write(args, {"workload": "W1", "steps": args.steps, "rounds": args.rounds, "forms": args.forms, "runs": runs,
                 "median": summary})
    for label, s in summary.items():
        print(f"{label:<20} forward host {s['host_fwd_ms']:>7.2f} gpu {s['gpu_fwd_ms']:>7.2f}  backward host "
              f"{s['host_bwd_ms']:>7.2f} gpu {s['gpu_bwd_ms']:>7.2f}  step {s['step_ms']:>7.2f} ms  "
              f"peak {s['peak_MiB']:>7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
