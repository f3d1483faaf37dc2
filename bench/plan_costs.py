"""What storm.plan's trace says W1's costs are, against what steps measure (CUDA).

    python bench/plan_costs.py --out bench/results/plan-costs-w1.json

First, in this fresh process after grad-mode steps, block 0's first forward without autograd
and its second: the compute trace's reentrant forward is a process's first such forward
(storm.plan runs block 0 once, untimed, before it). Then, per k in --offload: a
storm.plan(peak=...) whose choice is forced (its choose() wrapped) to offload blocks[:k] raw,
with a copy queue of all they send and nothing recomputed; once settled, --rounds rounds of
--steps steps of it and of no offload in turn (profile_step.timed_step: host and compute
stream, forward and backward). Per k: the median step, the planned steps' packs' host time
per offloaded tensor (stats.pack_s) against the trace's (half its host_ms_per_tensor, as the
model counts a pack), and the model's predicted cost of that plan (_Offloading.cost_ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from storm.planner import _Offloading  # noqa: E402
from offload import GiB, Trainer, cuda_device, write  # noqa: E402
from profile_step import medians, timed_step  # noqa: E402
from workloads import W1  # noqa: E402


def first_forward_without_autograd(device: torch.device) -> dict[str, float]:
    """ms of block 0's forward: under no_grad first and second, then with grad, after 3 grad steps."""
    t = Trainer(W1, "none", {}, device)
    t.warm(3)
    block, out = t.model.blocks[0], {}
    for label, grad in (("no_grad_first_ms", False), ("no_grad_second_ms", False), ("grad_ms", True)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(grad):
            block(t.x)
        torch.cuda.synchronize(device)
        out[label] = round((time.perf_counter() - t0) * 1e3, 3)
    t.close()
    return out


def force_offloading(k: list[int]) -> None:
    """storm.plan's choice, from now on: offload blocks[:k[0]] raw, all they send queued, nothing recomputed."""
    choose = storm.planner.choose

    def forced(trace, *args, **kwargs):
        p = choose(trace, *args, **kwargs)
        n = k[0]
        sent = trace.before_bytes + sum(b.saved_bytes for b in trace.blocks[:n])
        return dataclasses.replace(p, offloaded=n, recomputed=frozenset(), offload_budget=trace.offloaded_before[n],
                                   max_held_bytes=sent, prefetch_bytes=0, in_flight_bytes=0, fits=True,
                                   compressed=False)

    storm.planner.choose = forced


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--offload", type=int, nargs="+", default=[1, 2], help="offload the first k blocks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("plan_costs.py")
    if device is None:
        return 2
    results: dict = {"first_forward_block0": first_forward_without_autograd(device)}
    print(results, flush=True)
    k = [0]
    force_offloading(k)
    opts = {"mode": "embedded", "min_bytes": 1 << 20, "pool_size": "24GiB", "peak": 6 * GiB}  # above W1's step
    none = Trainer(W1, "none", {}, device)
    none.warm(3)
    planned = {}
    for n in args.offload:
        k[0] = n
        planned[n] = Trainer(W1, "plan", opts, device)
        planned[n].warm(3)
    samples: dict[str, list] = {"none": [], **{f"offload-{n}": [] for n in planned}}
    packs: dict[int, list[float]] = {n: [] for n in planned}
    for _ in range(args.rounds):
        samples["none"] += [timed_step(none.model, none.x, none.opt, None) for _ in range(args.steps)]
        for n, t in planned.items():
            for _ in range(args.steps):
                samples[f"offload-{n}"].append(timed_step(t.model, t.x, t.opt, t.planner.step))
                st = t.planner._ctx.stats
                packs[n].append(st.pack_s / st.offloaded * 1e6)
    results["steps"] = {label: medians(s) for label, s in samples.items()}
    for n, t in planned.items():
        pl, tr = t.planner, t.planner.trace
        traced = pl.traced_host_ms_per_tensor or tr.host_ms_per_tensor
        results[f"offload-{n}"] = {
            "pack_us_per_tensor": round(statistics.median(packs[n]), 1),
            "traced_pack_us_per_tensor": round(traced / 2 * 1e3, 1),
            "host_check_took_measured": pl.traced_host_ms_per_tensor is not None,
            "model_cost_ms": round(_Offloading.of(dataclasses.replace(tr, host_ms_per_tensor=traced), n,
                                                  pl.plan.max_held_bytes)[0].cost_ms, 2),
            "measured_cost_ms": round(results["steps"][f"offload-{n}"]["step_ms"] - results["steps"]["none"]["step_ms"],
                                      2),
            "explain": pl.explain()}
        t.close()
    none.close()
    write(args, results)
    for label, s in results["steps"].items():
        print(label, s)
    for n in planned:
        print(n, {key: v for key, v in results[f"offload-{n}"].items() if key != "explain"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
