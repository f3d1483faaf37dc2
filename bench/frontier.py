"""At each GPU-memory budget, which method trains fastest: the step time against peak memory frontier.

    python bench/frontier.py --out bench/results/frontier-w1.json --plot bench/results/frontier-w1.png   # CUDA
    python bench/frontier.py --quick --workloads W1 W2 --out /tmp/frontier.json                         # smoke run
    python bench/frontier.py --plot-only bench/results/frontier-w1.json --plot frontier.png             # any machine

Per workload, with bench/common.py's run() (median step time of --steps steps
after --warmup; peak GPU memory above what was allocated before the steps):
no offload, per-block checkpointing, save_on_cpu(pin_memory=True), STORM full
offload, STORM with budget=b (the earliest b bytes offloaded) for each byte
budget b (default: 10 fractions, 0.1 to 1.0, of the no-offload peak),
per-block checkpointing of only the first k blocks, k = round(b / bytes one
block's recompute removes), and storm.plan (client/planner/: per block keep,
offload or recompute, planned from two traced steps). A budget b asks for a
peak of at most cap = (no-offload peak - b); storm.plan is given that cap
(peak=cap: it measures its own steps' peaks above their start, the same
quantity, and corrects its plan until one fits). Per budget the
summary compares the planner's measured step and peak with the fastest other
method whose measured peak fits the same cap, and with the lower bound (Bound:
from the no-offload step, the pinned bandwidths measured in the same run and
what recomputing a block removes; budgets no method fits are marked
unreachable). With --duel R, per budget the planner, that best other method and no
offload are then built side by side and timed in alternation, R rounds of
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
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import W1, W2, GiB, Net, Trainer, Workload, cuda_device, link_bandwidth, plan_summary, run, write
from stormd.wire.sizes import parse_size


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


def contender(w: Workload, row: dict, storm_opts: dict, total_bytes: int | None = None) -> tuple[Workload, str, dict]:
    """What common.run() (or a Trainer) needs to measure a row: workload, method as run() names
    it, options. A plan row is asked for a peak of at most total_bytes less its budget."""
    if row["method"] == "ckpt-first":
        return FirstK(**dataclasses.asdict(w), k=row["ckpt_blocks"]), "none", {}
    if row["method"] == "storm-budget":
        return w, "storm", {**storm_opts, "budget": row["budget_bytes"]}
    if row["method"] == "plan":
        return w, "plan", {**storm_opts, "peak": total_bytes - row["budget_bytes"]}
    if row["method"] == "storm":
        return w, "storm", storm_opts
    return w, row["method"], {}


@dataclasses.dataclass
class Measurements:
    """One workload's measured rows, and what its budgets are taken from."""

    total_bytes: int        # no-offload peak: budget b asks for a peak of at most total_bytes - b
    bytes_per_block: float  # what recomputing one block removes: (no-offload - checkpoint-all peak) / layers
    layers: int
    rows: list[dict]

    @classmethod
    def of(cls, section: dict) -> "Measurements":
        return cls(section["total_bytes"], section["bytes_per_block"], section["layers"], section["rows"])


def budgets(total_bytes: int, points: int) -> list[int]:
    """`points` budgets evenly spaced up to total_bytes: 10 points gives 0.1, 0.2, ... 1.0 of it."""
    return [int(total_bytes * (i + 1) / points) for i in range(points)]


def blocks_for(budget: int, m: Measurements) -> int:
    """k such that checkpointing the first k blocks removes about `budget` bytes."""
    if m.bytes_per_block <= 0:  # checkpointing removed nothing measurable: only all blocks can come close
        return m.layers
    return min(m.layers, round(budget / m.bytes_per_block))


@dataclasses.dataclass(frozen=True)
class Bound:
    """The least step time any method here could reach at a budget b, from the no-offload
    step, the measured pinned bandwidths and what recomputing a block removes and costs.

    A peak cap of (no-offload peak - b) holds when forward ends, before backward frees
    anything, so by then b bytes of saves are either off the device or never kept: o bytes
    offloaded, whose copies to the host end before forward does (forward lasts at least
    o / D2H) and whose copies back run in backward (at least o / H2D), and the rest
    recomputed, r = (b - o) / bytes_per_block blocks, each a block's forward more in
    backward (the no-offload forward over the layers, as the step runs it). So a step takes
    at least
        max(F, o / D2H) + max(B + r * F / layers, o / H2D)
    (F, B: the no-offload step's forward and the rest), for the best split o; what hooks
    and recomputing cost the host beyond that is not counted. Bandwidth alone
    (max(no-offload step, b / D2H, b / H2D), ``link_only``) bounds offloading only:
    recomputing beats it where a block's forward costs less than moving its bytes both
    ways, as on W1 (docs/results.md), and it lets forward carry more bytes than its own
    duration can."""

    forward_ms: float       # the no-offload forward
    layers: int
    bytes_per_block: float  # what recomputing a block removes
    d2h_GBps: float
    h2d_GBps: float

    @classmethod
    def of(cls, section: dict, link: dict[str, float]) -> "Bound":
        none = next(r for r in section["rows"] if r["method"] == "none")
        return cls(none["forward_ms"], section["layers"], section["bytes_per_block"], link["d2h_GBps"],
                   link["h2d_GBps"])

    def ms(self, budget: int, none_ms: float, splits: int = 1000) -> float:
        fwd = min(self.forward_ms, none_ms)
        rest, block_ms = none_ms - fwd, fwd / self.layers
        d2h, h2d = self.d2h_GBps * 1e6, self.h2d_GBps * 1e6  # bytes per ms
        recomputable = self.layers * self.bytes_per_block if self.bytes_per_block > 0 else 0.0
        lowest = max(0.0, budget - recomputable)  # recomputing every block removes no more
        best = float("inf")
        for i in range(splits + 1):  # convex in o: a fine grid finds its least to well under 0.01 ms
            o = lowest + (budget - lowest) * i / splits
            blocks = (budget - o) / self.bytes_per_block if budget > o else 0.0
            best = min(best, max(fwd, o / d2h) + max(rest + blocks * block_ms, o / h2d))
        return best

    def link_only(self, budget: int, none_ms: float) -> float:
        """max(no-offload step, b / D2H, b / H2D): the earlier runs' bound, offload alone."""
        return max(none_ms, budget / (self.d2h_GBps * 1e6), budget / (self.h2d_GBps * 1e6))


def best_other(budget: int, m: Measurements) -> dict | None:
    """The fastest measured method other than the planner whose peak fits total_bytes - budget."""
    cap = m.total_bytes - budget
    fits = [r for r in m.rows if "step_ms" in r and r["method"] != "plan" and r["peak_GiB"] * GiB <= cap]
    return min(fits, key=lambda r: r["step_ms"], default=None)


def summarize(section: dict, link: dict[str, float]) -> dict:
    """Per budget: the bound, the planner's measured row and the best other method that fits
    (a budget no measured method fits is unreachable, and left out of the verdict); and the
    duel's planner against its bound, from the no-offload time measured beside it."""
    m = Measurements.of(section)
    lower = Bound.of(section, link)
    none_ms = next(r["step_ms"] for r in m.rows if r["method"] == "none")
    bound, planner = [], []
    for b in section["budgets"]:
        lb = round(lower.ms(b, none_ms), 2)
        bound.append({"budget_bytes": b, "lower_bound_ms": lb, "link_only_ms": round(lower.link_only(b, none_ms), 2)})
        mine = next((r for r in m.rows if r["method"] == "plan" and r["budget_bytes"] == b and "step_ms" in r), None)
        other = best_other(b, m)
        cap = m.total_bytes - b
        fits = bool(mine) and mine["peak_GiB"] * GiB <= cap
        entry = {"budget_bytes": b, "peak_cap_GiB": round(cap / GiB, 3), "lower_bound_ms": lb,
                 "step_ms": mine and mine["step_ms"], "peak_GiB": mine and mine["peak_GiB"], "fits_cap": fits,
                 "best_other": other and other["label"], "best_other_ms": other and other["step_ms"],
                 "reachable": fits or other is not None}
        if fits:
            entry.update(x_bound=round(mine["step_ms"] / lb, 3),
                         x_other=other and round(mine["step_ms"] / other["step_ms"], 3))
        planner.append(entry)
    out = {"bound": bound, "planner": planner}
    if section.get("duel"):
        out["duel"] = [rebound(d, lower) if "none_ms" in d else d for d in section["duel"]]
    return out


def rebound(duel: dict, lower: Bound) -> dict:
    """A duel's entry with its bound from the no-offload time measured beside the planner."""
    lb = lower.ms(duel["budget_bytes"], duel["none_ms"])
    return {**duel, "lower_bound_ms": round(lb, 2), "x_bound": round(duel["plan_ms"] / lb, 3)}


def measure(args: argparse.Namespace, device: torch.device) -> dict:
    link = link_bandwidth(device)
    print(f"link: {link}", flush=True)
    results: dict = {"link": link}
    prior = json.loads(Path(args.resume).read_text()) if args.resume else {}
    if prior:
        results["resumed_from"] = prior.get("meta")  # rows measured by that run are kept as they were
    storm_opts = {"mode": "embedded", "min_bytes": 1 << 20, "pool_size": args.pool_size}
    for w in (w for w in (W1, W2) if w.name in args.workloads):
        sec: dict = {"layers": w.layers, "rows": []}
        results[w.name] = sec
        done = {r["label"]: r for r in prior.get(w.name, {}).get("rows", [])}

        def add(label: str, method: str, budget: int | None = None, k: int | None = None) -> dict:
            if label in done:
                sec["rows"].append(done[label])
                return done[label]
            row = {"label": label, "method": method, "budget_bytes": budget, "ckpt_blocks": k}
            workload, how, opts = contender(w, row, storm_opts, sec.get("total_bytes"))
            r = run(workload, how, args.steps, args.warmup, opts, device)
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
        sec["budgets"] = args.budgets or budgets(sec["total_bytes"], args.points)
        add("save_on_cpu", "save_on_cpu")
        add("storm-full", "storm")
        for b in sec["budgets"]:
            add(f"storm-budget {b / GiB:.2f}GiB", "storm-budget", budget=b)
        for k in sorted({blocks_for(b, Measurements.of(sec)) for b in sec["budgets"]}):
            add(f"ckpt-first-{k}", "ckpt-first", k=k)
        for b in sec["budgets"]:
            add(f"plan {(sec['total_bytes'] - b) / GiB:.2f}GiB", "plan", budget=b)
        sec.update(summarize(sec, link))
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
                rounds: tuple[list[list[float]], ...] = ([], [], [])
                for _ in range(args.duel):
                    turns = list(zip(rounds, (mine, theirs, none)))
                    order.shuffle(turns)
                    for r, trainer in turns:
                        r.append([trainer.step() for _ in range(args.steps)])
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


def ratio_interval(mine: list[list[float]], theirs: list[list[float]], resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(mine) / median(theirs), all steps pooled, resampling
    rounds (round i of each, together: they ran minutes apart at most, so drift moves both)."""
    rng = random.Random(seed)
    n = len(mine)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(s for i in picks for s in mine[i])
                      / statistics.median(s for i in picks for s in theirs[i]))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def table(name: str, section: dict) -> str:
    none_ms = next(r["step_ms"] for r in section["rows"] if r["method"] == "none")
    lines = [f"{name}: no-offload peak {section['total_bytes'] / GiB:.3f} GiB, "
             f"{section['bytes_per_block'] / GiB:.3f} GiB removed per recomputed block",
             f"{'method':<24} {'step ms':>9} {'peak GiB':>9} {'x none':>7}"]
    for r in section["rows"]:
        if "step_ms" in r:
            lines.append(f"{r['label']:<24} {r['step_ms']:>9.2f} {r['peak_GiB']:>9.3f} {r['step_ms'] / none_ms:>7.2f}")
        else:
            lines.append(f"{r['label']:<24} {r.get('error', 'failed'):>9}")
    lines += ["", f"{'budget GiB':>10} {'peak cap GiB':>12} {'bound ms':>9} {'link-only':>9} {'plan ms':>8} "
              f"{'plan GiB':>8} {'fits':>4} {'x bound':>7}  {'best other that fits':<24} {'ms':>8}"]
    for p, b in zip(section["planner"], section["bound"]):
        line = (f"{p['budget_bytes'] / GiB:>10.3f} {p['peak_cap_GiB']:>12.3f} {p['lower_bound_ms']:>9.2f} "
                f"{b.get('link_only_ms', float('nan')):>9.2f} ")
        line += (f"{p['step_ms']:>8.2f} {p['peak_GiB']:>8.3f} {'yes' if p['fits_cap'] else 'no':>4} "
                 f"{p['step_ms'] / p['lower_bound_ms']:>7.2f}  " if p["step_ms"] is not None
                 else f"{'failed':>8} {'':>8} {'':>4} {'':>7}  ")
        line += (f"{p['best_other']:<24} {p['best_other_ms']:>8.2f}" if p["best_other"]
                 else "none fits" + ("" if p.get("reachable", True) else ": unreachable"))
        lines.append(line)
    if section.get("duel"):
        timed_none = all("none_ms" in d for d in section["duel"])  # not in results from before it was
        lines += ["", "in alternation:", f"{'budget GiB':>10} {'plan ms':>8} {'other':<24} {'ms':>8} {'ratio':>6} "
                  f"{'95% of rounds':>13}" + (f" {'none ms':>8} {'bound ms':>9} {'x bound':>7}" if timed_none else "")]
        lines += [f"{d['budget_bytes'] / GiB:>10.3f} {d['plan_ms']:>8.2f} {d['other']:<24} {d['other_ms']:>8.2f} "
                  f"{d['ratio']:>6.3f} "
                  + (f"{d['ratio_95'][0]:>6.3f}-{d['ratio_95'][1]:<6.3f}" if "ratio_95" in d else f"{'':>13}")
                  + (f" {d['none_ms']:>8.2f} {d['lower_bound_ms']:>9.2f} {d['x_bound']:>7.3f}" if timed_none else "")
                  for d in section["duel"]]
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Step time against peak memory, a marker series per method and the lower bound, a panel per workload."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, and none on a training node
    import matplotlib.pyplot as plt

    names = [n for n, s in results.items() if isinstance(s, dict) and "rows" in s]
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5.5), squeeze=False)
    markers = {"none": "o", "checkpoint": "s", "save_on_cpu": "v", "storm": "D", "storm-budget": "^",
               "ckpt-first": "x", "plan": "*"}
    for ax, name in zip(axes[0], names):
        sec = results[name]
        for method, marker in markers.items():
            pts = [r for r in sec["rows"] if r["method"] == method and "step_ms" in r]
            if pts:
                ax.scatter([r["peak_GiB"] for r in pts], [r["step_ms"] for r in pts], marker=marker,
                           label={"storm": "storm-full", "plan": "storm.plan"}.get(method, method))
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
    p.add_argument("--workloads", nargs="+", default=["W1"], choices=["W1", "W2"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--points", type=int, default=10, help="budgets: this many fractions of the no-offload peak")
    p.add_argument("--budgets", nargs="+", type=parse_size, default=None, metavar="SIZE",
                   help="byte budgets instead of --points (bytes or e.g. 512MiB)")
    p.add_argument("--pool-size", default="24GiB")
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
    for name in args.workloads:
        print(table(name, results[name]) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
