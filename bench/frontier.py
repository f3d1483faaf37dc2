"""At each GPU-memory budget, which method trains fastest: the step time against peak memory frontier.

    python bench/frontier.py --out bench/results/frontier-w1.json --plot bench/results/frontier-w1.png   # CUDA
    python bench/frontier.py --quick --workloads W1 W2 --out /tmp/frontier.json                         # smoke run
    python bench/frontier.py --plot-only bench/results/frontier-w1.json --plot frontier.png             # any machine
    python bench/frontier.py --workloads W3 --compiled --out bench/results/frontier-w3.json             # issue 40

Per workload (bench/common.py's: W1, W2, W3 the Hugging Face Llama), with common.run() (median
step time of --steps steps after --warmup; peak GPU memory above what was allocated before the
steps): no offload, per-block checkpointing (W3: Hugging Face's, non-reentrant),
save_on_cpu(pin_memory=True), torchtune's OffloadActivations alone and over checkpointed
blocks, STORM full offload, storm.offload over checkpointed blocks (as a user with
checkpointing already on would add it), STORM with budget=b (the earliest b bytes offloaded) for each byte
budget b (default: 10 fractions, 0.1 to 1.0, of the no-offload peak, the two that cap the
peak at checkpointing's and at half of it, and where another method went below checkpointing,
the least peak it reached and halfway from there to checkpointing's), per-block checkpointing
of only the first k blocks, k = round(b / bytes one block's recompute removes), and storm.plan
(storm/planner/: per block keep, offload or recompute, planned from two traced steps). With --compiled, also: the model
compiled as one graph at torch's activation_memory_budget 1.0 (no recompute added), 0.5 and
0.1, and under STORM's full offload; its blocks compiled one by one, alone and under storm.plan
capped at the 0.1 row's peak. A budget b asks for a
peak of at most cap = (no-offload peak - b); storm.plan is given that cap
(peak=cap: it measures its own steps' peaks above their start, the same
quantity, and corrects its plan until one fits). Per budget the
summary compares the planner's measured step and peak with the fastest other
method whose measured peak fits the same cap, and with the lower bound (Bound:
from the no-offload step, the pinned bandwidths measured in the same run and
what recomputing a block removes; budgets no method fits are marked
unreachable; compiled rows are not compared with the eager planner's), and the must-show
verdicts of issue 40 (summary.must_show). A method that cannot run here (torchtune not installed,
a compile failing) leaves a row saying why (common.run) and the run goes on. With --duel R, per budget the
planner, that best other method and no offload are then built side by side and timed in
alternation, R rounds of
--steps steps each (each round in a shuffled order), and the planner is compared
with both (with a 95% interval of the ratio to the other, resampling rounds) and
with the bound from that no-offload time: the lent machines drift by 10 to 40% within a run,
and rows measured minutes apart compare that drift too. (Three models at once:
W2's take about 60 GiB of parameters and gradients.) Without CUDA it exits 2, except
--plot-only, which recomputes the summary from a results JSON, prints the table
and draws the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import (
    WORKLOADS,
    GiB,
    Llama,
    Net,
    Trainer,
    Variant,
    Workload,
    alternate,
    cuda_device,
    link_bandwidth,
    plan_summary,
    run,
    workloads,
    write,
)
from stormd.wire.sizes import parse_size
from summary import (
    Bound,
    Measurements,
    blocks_for,
    budgets,
    must_show,
    peak_bytes,
    ratio_interval,
    rebound,
    summarize,
    table,
)


class FirstKCheckpointed(nn.Module):
    """A Net whose blocks[i], i < k, are recomputed in backward; the rest save as usual."""

    def __init__(self, net: Net, k: int):
        super().__init__()
        self.net, self.k = net, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.net.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i < self.k else b(x)
        return x


@dataclasses.dataclass(frozen=True)
class FirstK(Workload):
    """The workload built as FirstKCheckpointed, so common.run() measures it like any method."""

    k: int = 0

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        model, x = super().build(device, seed=seed)
        return FirstKCheckpointed(model, self.k), x


def contender(w: Workload | Llama, row: dict, storm_opts: dict,
              total_bytes: int | None = None) -> tuple[Workload | Llama | Variant, str, dict]:
    """What common.run() (or a Trainer) needs to measure a row: workload, method as run() names
    it, options. A plan row is asked for a peak of at most total_bytes less its budget; a row
    with "compiled" set runs on the model compiled so (common.Variant), under its
    "memory_budget" where set, through storm.partitioner(**row["partitioner"]) where set."""
    if row.get("compiled"):
        w = Variant(w, compile=row["compiled"], memory_budget=row.get("memory_budget"),
                    partitioner=row.get("partitioner"))
    if row["method"] == "ckpt-first":
        k = row["ckpt_blocks"]
        return (FirstK(**dataclasses.asdict(w), k=k) if isinstance(w, Workload)
                else dataclasses.replace(w, ckpt_blocks=k)), "none", {}
    if row["method"] == "torchtune-checkpoint":
        return Variant(w, ckpt=True), "torchtune", {}
    if row["method"] == "storm-checkpoint":  # storm.offload over the model's own checkpointing
        return Variant(w, ckpt=True), "storm", storm_opts
    if row["method"] == "storm-budget":
        return w, "storm", {**storm_opts, "budget": row["budget_bytes"]}
    if row["method"] == "plan":
        return w, "plan", {**storm_opts, "peak": total_bytes - row["budget_bytes"]}
    if row["method"] == "storm":
        return w, "storm", storm_opts
    return w, row["method"], {}


# Issue 40's compiled rows (--compiled): torch.compile of the whole graph at these
# activation_memory_budget values (1.0 is torch.compile's default: no recompute added).
MEMORY_BUDGETS = (1.0, 0.5, 0.1)


def measure(args: argparse.Namespace, device: torch.device, measure_row: Callable[..., dict] = run,
            link: dict[str, float] | None = None) -> dict:
    """Every workload's rows and their summary: ``measure_row`` (common.run) measures a row, and
    ``link`` is the pinned bandwidths (measured here when not given)."""
    link = link or link_bandwidth(device)
    print(f"link: {link}", flush=True)
    results: dict = {"link": link}
    prior = json.loads(Path(args.resume).read_text()) if args.resume else {}
    if prior:
        results["resumed_from"] = prior.get("meta")  # rows measured by that run are kept as they were
    storm_opts = {"mode": "embedded", "min_bytes": args.min_bytes, "pool_size": args.pool_size}
    for w in workloads(args.workloads, args.batch, args.layers):
        sec: dict = {"layers": w.layers, "rows": []}
        results[w.name] = sec
        done = {r["label"]: r for r in prior.get(w.name, {}).get("rows", [])}

        def add(label: str, method: str, budget: int | None = None, k: int | None = None, **compiled: object) -> dict:
            if label in done:
                sec["rows"].append(done[label])
                return done[label]
            row = {"label": label, "method": method, "budget_bytes": budget, "ckpt_blocks": k, **compiled}
            workload, how, opts = contender(w, row, storm_opts, sec.get("total_bytes"))
            r = measure_row(workload, how, args.steps, args.warmup, opts, device)
            if "peak_extra_GiB" in r:
                r["peak_GiB"] = r.pop("peak_extra_GiB")
            row.update(r)
            sec["rows"].append(row)
            print(f"{w.name} {label}: {r}", flush=True)
            write(args.out, results)  # what is done survives a time limit
            return row

        none, ckpt = add("none", "none"), add("checkpoint", "checkpoint")
        if "error" in none or "error" in ckpt:
            raise RuntimeError(f"{w.name}: the budgets are taken from the no-offload and checkpoint peaks, "
                               f"and a run failed: none {none}, checkpoint {ckpt}")
        sec["total_bytes"] = int(none["peak_GiB"] * GiB)
        sec["bytes_per_block"] = (none["peak_GiB"] - ckpt["peak_GiB"]) * GiB / w.layers
        ckpt_bytes = peak_bytes(ckpt)  # issue 40's caps: checkpointing's peak and half of it
        sec["ckpt_budgets"] = {"checkpoint": sec["total_bytes"] - ckpt_bytes,
                               "half_checkpoint": sec["total_bytes"] - ckpt_bytes // 2}
        sec["budgets"] = sorted(set(args.budgets or budgets(sec["total_bytes"], args.points))
                                | set(sec["ckpt_budgets"].values()))
        others = [add("save_on_cpu", "save_on_cpu"), add("torchtune", "torchtune"),
                  add("torchtune-checkpoint", "torchtune-checkpoint"), add("storm-full", "storm"),
                  add("storm-checkpoint", "storm-checkpoint")]
        least = min((peak_bytes(r) for r in others if "peak_GiB" in r), default=None)
        if least is not None and least < ckpt_bytes:
            # below checkpointing, where offloading recomputed blocks' inputs is the planner's way:
            # the least peak another method reached, and halfway from there to checkpointing's
            sec["ckpt_budgets"].update(below_checkpoint=sec["total_bytes"] - (ckpt_bytes + least) // 2,
                                       least_other=sec["total_bytes"] - least)
            sec["budgets"] = sorted(set(sec["budgets"]) | set(sec["ckpt_budgets"].values()))
        for b in sec["budgets"]:
            add(f"storm-budget {b / GiB:.2f}GiB", "storm-budget", budget=b)
        for k in sorted({blocks_for(b, Measurements.of(sec)) for b in sec["budgets"]}):
            add(f"ckpt-first-{k}", "ckpt-first", k=k)
        for b in sec["budgets"]:
            add(f"plan {(sec['total_bytes'] - b) / GiB:.2f}GiB", "plan", budget=b)
        if args.compiled:
            for mb in MEMORY_BUDGETS:
                add("compiled" if mb == 1.0 else f"compiled budget {mb}", "none", compiled="graph", memory_budget=mb)
            add("compiled storm-full", "storm", compiled="graph")  # STORM warns here: it records the peak anyway
            add("compiled storm-graph", "none", compiled="graph", partitioner=storm_opts)  # storm.partitioner
            add("blocks-compiled", "none", compiled="blocks")
            low = next(r for r in sec["rows"] if r["label"] == f"compiled budget {MEMORY_BUDGETS[-1]}")
            if "peak_GiB" in low:  # storm.plan on the blocks compiled, at the cap torch's lowest budget reached
                cap = peak_bytes(low)  # a cap a peak as measured fits
                add(f"blocks-compiled plan {cap / GiB:.2f}GiB", "plan", budget=sec["total_bytes"] - cap,
                    compiled="blocks")
        sec.update(summarize(sec, link))
        sec["must_show"] = must_show(sec)
        write(args.out, results)
        if args.duel:
            sec["duel"] = []
            resumed = prior.get(w.name, {}).get("duel", [])
            dueled = {d["budget_bytes"]: d for d in resumed if d.get("rounds") == args.duel}
            for entry in duel(w, sec, args, device, storm_opts, link, dueled):
                sec["duel"].append(entry)
                write(args.out, results)  # each budget's, as it comes: a time limit keeps those done
    return results


def duel(w: Workload, sec: dict, args: argparse.Namespace, device: torch.device, storm_opts: dict,
         link: dict[str, float], done: dict[int, dict]) -> Iterator[dict]:
    """Per budget where the planner fit its cap: the planner, the fastest other method that fits
    and no offload (the bound's reference), side by side on the device, timed in alternation
    (each round in a shuffled order, so that none always runs after the same one); medians of
    all their steps, the planner against the bound from that no-offload time, and the ratio's
    95% interval over rounds (ratio_interval). Budgets in ``done`` (a resumed run's) are yielded as they were."""
    lower = Bound.of(sec, link)
    order = random.Random(0)
    none = Trainer(w, "none", {}, device)  # one for every budget: a third model on the device, not more
    try:
        none.warm(args.warmup)
        for p in sec["planner"]:
            if not p["fits_cap"] or p["best_other"] is None:
                continue
            if p["budget_bytes"] in done:
                yield done[p["budget_bytes"]]
                continue
            row = next(r for r in sec["rows"] if r["label"] == p["best_other"])
            mine = Trainer(*contender(w, {"method": "plan", "budget_bytes": p["budget_bytes"]}, storm_opts,
                                      sec["total_bytes"]), device)
            theirs = Trainer(*contender(w, row, storm_opts), device)
            try:
                mine.warm(args.warmup)
                theirs.warm(args.warmup)
                rounds = alternate((mine, theirs, none), args.duel, args.steps, order)
                chosen = plan_summary(mine.planner)  # planned afresh here: it may differ from the row's plan
            finally:
                mine.close()
                theirs.close()
            plan_ms, other_ms, none_ms = (round(statistics.median(s for r in rs for s in r) * 1e3, 2) for rs in rounds)
            lo, hi = ratio_interval(rounds[0], rounds[1])
            entry = rebound({"budget_bytes": p["budget_bytes"], "plan_ms": plan_ms, "other": row["label"],
                             "other_ms": other_ms, "ratio": round(plan_ms / other_ms, 3),
                             "ratio_95": [round(lo, 3), round(hi, 3)], "rounds": args.duel, "none_ms": none_ms,
                             "plan": chosen}, lower)
            print(f"{w.name} duel at cap {p['peak_cap_GiB']} GiB: plan {plan_ms} ms, {row['label']} {other_ms} ms "
                  f"(ratio {lo:.3f} to {hi:.3f}), none {none_ms} ms (bound {entry['lower_bound_ms']} ms)", flush=True)
            yield entry
    finally:
        none.close()


def plot(results: dict, path: str) -> None:
    """Step time against peak memory, a marker series per method and the lower bound, a panel per workload."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, and none on a training node
    import matplotlib.pyplot as plt

    names = [n for n, s in results.items() if isinstance(s, dict) and "rows" in s]
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5.5), squeeze=False)
    markers = {"none": "o", "checkpoint": "s", "save_on_cpu": "v", "storm": "D", "storm-budget": "^",
               "ckpt-first": "x", "plan": "*", "torchtune": "<", "torchtune-checkpoint": ">",
               "storm-checkpoint": "P"}
    names_of = {"storm": "storm-full", "plan": "storm.plan"}
    for ax, name in zip(axes[0], names):
        sec = results[name]
        for compiled in (None, "graph", "blocks"):
            for method, marker in markers.items():
                pts = [r for r in sec["rows"] if r["method"] == method and r.get("compiled") == compiled
                       and "step_ms" in r]
                if pts:
                    label = names_of.get(method, method) + (f" ({compiled} compiled)" if compiled else "")
                    ax.scatter([r["peak_GiB"] for r in pts], [r["step_ms"] for r in pts], label=label,
                               marker=marker, facecolors="none" if compiled else None)
        bound = sorted(((sec["total_bytes"] - b["budget_bytes"]) / GiB, b["lower_bound_ms"]) for b in sec["bound"])
        ax.plot([x for x, _ in bound], [y for _, y in bound], "k--", label="lower bound at peak cap (total - b)")
        ax.set_xlabel("peak GPU memory above the step's start (GiB)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["W1"], choices=list(WORKLOADS),
                   help="W1, W2, W3 (issue 40's Hugging Face Llama), W3L, tiny, W3-tiny")
    p.add_argument("--compiled", action="store_true",
                   help="also the compiled rows: torch.compile of the whole graph at activation_memory_budget "
                        f"{', '.join(map(str, MEMORY_BUDGETS))} and with STORM's full offload; the blocks compiled "
                        "one by one, alone and under storm.plan at the lowest budget's peak")
    p.add_argument("--batch", type=int, default=None, help="override the workloads' batch size")
    p.add_argument("--layers", type=int, default=None, help="override the workloads' depth (smoke runs)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--points", type=int, default=10, help="budgets: this many fractions of the no-offload peak")
    p.add_argument("--budgets", nargs="+", type=parse_size, default=None, metavar="SIZE",
                   help="byte budgets instead of --points (bytes or e.g. 512MiB)")
    p.add_argument("--pool-size", default="24GiB")
    p.add_argument("--min-bytes", type=parse_size, default=1024,
                   help="STORM rows' min_bytes; the default is torchtune OffloadActivations' min_offload_size, so "
                        "that at a cap another method reached STORM may offload the same tensors")
    p.add_argument("--duel", type=int, default=0, metavar="ROUNDS",
                   help="then time the planner, the best other method that fits and no offload in alternation, "
                        "per budget")
    p.add_argument("--quick", action="store_true", help="3 budgets, --steps 3 --warmup 1: a smoke run")
    p.add_argument("--out", help="results JSON (required unless --plot-only)")
    p.add_argument("--resume", metavar="RESULTS.json", default=None,
                   help="keep the rows of an earlier (cut-off) run, and its duel's budgets where it ran as many "
                        "rounds, and measure only the missing ones")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="draw step time against peak memory")
    p.add_argument("--plot-only", metavar="RESULTS.json", default=None,
                   help="measure nothing: re-plan, print and (with --plot) draw from a results JSON")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.points = 3, 1, 3
    if args.plot_only:
        results = json.loads(Path(args.plot_only).read_text())
        for name, sec in results.items():
            if isinstance(sec, dict) and "rows" in sec:
                sec.update(summarize(sec, results["link"]))
                if "ckpt_budgets" in sec:
                    sec["must_show"] = must_show(sec)
                print(table(name, sec) + "\n")
        if args.plot:
            plot(results, args.plot)
        return 0
    if not args.out:
        p.error("--out is required unless --plot-only")
    device = cuda_device("frontier.py", "; --plot-only RESULTS.json --plot OUT.png draws saved results on any "
                                        "machine")
    if device is None:
        return 2
    results = measure(args, device)
    for w in workloads(args.workloads, args.batch, args.layers):
        print(table(w.name, results[w.name]) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
