"""A CPU model's step before and after STORM first offloads in the process (the mover's threads).

    python bench/cpu_threads.py --out bench/results/cpu-threads.json

A 12-block model of bench/workloads.py's Block at d=64 (small ops: what a parallel op's
start-up costs shows) trains without offload; then another model takes --offload-steps steps
under storm.offload (embedded store); then the first trains again. Medians of forward and of
backward over --steps steps each time, and torch's intra-op thread count as seen by the
training thread and by the mover's worker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from offload import write  # noqa: E402
from workloads import Workload  # noqa: E402

SMALL = Workload("small", layers=12, d=64, heads=2, batch=2, seq=64)


def phases(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> dict:
    fwd, bwd = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = model(x)
        t1 = time.perf_counter()
        y.float().pow(2).mean().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"forward_ms": round(statistics.median(fwd) * 1e3, 2), "backward_ms": round(statistics.median(bwd) * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--offload-steps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cpu = torch.device("cpu")
    model, x = SMALL.build(cpu)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    phases(model, x, opt, 3)  # warm-up
    before = phases(model, x, opt, args.steps)
    other, y = SMALL.build(cpu, seed=1)
    for _ in range(args.offload_steps):
        with storm.offload(mode="embedded", min_bytes=0):
            out = other(y)
        out.sum().backward()
    after = phases(model, x, opt, args.steps)
    session = storm.session.session_for("embedded", None, None)
    worker = session.mover._worker.submit(torch.get_num_threads).result()
    results = {"cpus": os.cpu_count(), "intra_op_threads": torch.get_num_threads(), "mover_intra_op_threads": worker,
               "before_offload": before, "after_offload": after}
    write(args, results)
    print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
