"""A model torch.compile compiles as one graph, with and without storm.partitioner (CUDA).

    python bench/graph.py --workloads W1 W3 --layers 8 --out bench/results/graph.json

Per workload, each compiled as one graph: no offload; torch's activation_memory_budget=0.1
(its own selective recompute); storm.partitioner offloading every save it can ("storm-graph");
and storm.partitioner with a budget of what the link carries in the compiled forward's time
("storm-graph link-time": forward_ms x the measured pinned D2H bandwidth), the most a step can
offload without waiting for the link. The verdicts: the fraction of the compiled peak the full
offload removes, and the link-time row's step against no offload's (``--link-fractions``: smaller
budgets beside it, to tell the link's cost from each save's own). And whether one step's
gradients through storm.partitioner equal the same compiled model's without it bit for bit,
beside whether that model's own gradients repeat bit for bit (what does not, cannot be compared).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import GiB, Variant, cuda_device, link_bandwidth, run, workloads, write
from storm.examples.models import same_bits

STORM = {"mode": "embedded", "min_bytes": 1 << 20}


def gradients(w: Variant, device: torch.device) -> list[torch.Tensor]:
    """One step's gradients of ``w`` built afresh (the same seed each time)."""
    model, x = w.build(device)
    w.objective(w.forward(model, x)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    del model, x
    torch.cuda.empty_cache()
    return grads


def bit_exact(base, device: torch.device) -> dict:
    """Which parameters' gradients through storm.partitioner differ from the compiled model's
    without it, and which differ between two runs of that model alone (nondeterministic kernels)."""
    ref, again = gradients(Variant(base, compile="graph"), device), gradients(Variant(base, compile="graph"), device)
    got = gradients(Variant(base, compile="graph", partitioner=STORM), device)
    differ = [i for i, (a, b) in enumerate(zip(ref, got)) if not same_bits(a, b)]
    noisy = [i for i, (a, b) in enumerate(zip(ref, again)) if not same_bits(a, b)]
    return {"parameters": len(ref), "differ": differ, "differ_without_storm": noisy,
            "bit_exact_where_deterministic": set(differ) <= set(noisy)}


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    link = link_bandwidth(device)
    results: dict = {"link": link}
    for w in workloads(args.workloads, args.batch, args.layers):
        rows: dict = {}
        results[w.name] = {"rows": rows}

        def add(label: str, variant: Variant) -> dict:
            rows[label] = run(variant, "none", args.steps, args.warmup, {}, device)
            print(f"{w.name} {label}: {rows[label]}", flush=True)
            write(args.out, results, device)
            return rows[label]

        plain = add("compiled", Variant(w, compile="graph"))
        add("compiled budget 0.1", Variant(w, compile="graph", memory_budget=0.1))
        full = add("storm-graph", Variant(w, compile="graph", partitioner=STORM))
        sec = results[w.name]
        if "forward_ms" in plain:
            budget = int(plain["forward_ms"] * 1e-3 * link["d2h_GBps"] * 1e9)
            sec["link_time_budget_GiB"] = round(budget / GiB, 3)
            for f in (1.0, *args.link_fractions):  # fractions: where the cost comes from, the link or each save
                label = "storm-graph link-time" if f == 1.0 else f"storm-graph {f:g} x link-time"
                part = add(label, Variant(w, compile="graph", partitioner={**STORM, "budget": int(f * budget)}))
                if "step_ms" in part:
                    part["x_compiled"] = round(part["step_ms"] / plain["step_ms"], 3)
            if "x_compiled" in rows["storm-graph link-time"]:
                sec["link_time_x_compiled"] = rows["storm-graph link-time"]["x_compiled"]
        if "peak_extra_GiB" in plain and "peak_extra_GiB" in full:
            sec["peak_removed_fraction"] = round(1 - full["peak_extra_GiB"] / plain["peak_extra_GiB"], 3)
            sec["storm_graph_x_compiled"] = round(full["step_ms"] / plain["step_ms"], 3)
        if args.check:
            sec["gradients"] = bit_exact(w, device)
        write(args.out, results, device)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["W1", "W3"])
    ap.add_argument("--layers", type=int, help="override each workload's layer count (W3 compiles faster at 8)")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="also compare one step's gradients bit for bit")
    ap.add_argument("--link-fractions", type=float, nargs="*", default=[],
                    help="also budgets of these fractions of the link-time budget (e.g. 0.5 0.25)")
    ap.add_argument("--out", default="bench/results/graph.json")
    args = ap.parse_args()
    device = cuda_device("graph.py")
    if device is None:
        return 1
    measure(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
