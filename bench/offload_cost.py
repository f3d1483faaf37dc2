"""What offloading b bytes costs a W2 step: STORM with budget=b (the earliest b bytes), one model,
each configuration a step in turn, in a shuffled order per round.

    python bench/offload_cost.py --rounds 25 --out bench/results/offload-cost-w2.json   # CUDA

Per configuration: its median step and its step minus the no-offload step of the same round
(mean, standard error, median). One model for all, so drift and the allocator's state hit
every configuration alike; W2 is GPU-bound, so what offloading costs is small next to a
step's noise and needs the pairing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import GiB, cuda_device, train_step, write  # noqa: E402
from workloads import W2  # noqa: E402

BUDGETS_GiB = (0.06, 0.3, 0.55, 1.0, 2.0, 2.9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("offload_cost.py")
    if device is None:
        return 2
    model, x = W2.build(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    base = {"mode": "embedded", "min_bytes": 1 << 20, "pool_size": "24GiB"}
    configs: dict[str, dict | None] = {"none": None}
    configs.update({f"b{b}": {**base, "budget": int(b * GiB)} for b in BUDGETS_GiB})
    # as storm.plan asks: everything offloaded may wait for the link, no prefetch window
    configs["b1.0-held-all"] = {**base, "budget": GiB, "max_held_bytes": 2 * GiB, "prefetch_bytes": 0}
    configs["b2.6-held-all"] = {**base, "budget": int(2.6 * GiB), "max_held_bytes": 4 * GiB, "prefetch_bytes": 0}

    def step(opts: dict | None) -> tuple[float, object]:
        t0 = time.perf_counter()
        ctx = train_step(model, x, opt, "none" if opts is None else "storm", opts or {})
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3, ctx

    for opts in configs.values():
        for _ in range(2):
            step(opts)
    times: dict[str, list[float]] = {k: [] for k in configs}
    moved: dict[str, dict] = {}
    order = random.Random(0)
    for _ in range(args.rounds):
        names = list(configs)
        order.shuffle(names)
        for name in names:
            ms, ctx = step(configs[name])
            times[name].append(ms)
            if ctx is not None:
                moved[name] = {"offloaded_GiB": round(ctx.stats.offloaded_bytes / GiB, 3),
                               "tensors": ctx.stats.offloaded}
    results = {"rounds": args.rounds, "configs": {}}
    for name, ts in times.items():
        over = [a - b for a, b in zip(ts, times["none"])]
        results["configs"][name] = {
            "median_ms": round(statistics.median(ts), 2), "minus_none_mean_ms": round(statistics.mean(over), 2),
            "minus_none_se_ms": round(statistics.stdev(over) / len(over) ** 0.5, 2) if name != "none" else 0.0,
            "minus_none_median_ms": round(statistics.median(over), 2), **moved.get(name, {}), "steps_ms": ts}
        print(name, {k: v for k, v in results["configs"][name].items() if k != "steps_ms"}, flush=True)
    write(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
