"""bench/frontier.py's verdicts, computed from measured rows alone (so --plot-only redoes them on
any machine): the budgets and the blocks checkpointing must recompute for each, the lower bound
of a step at a budget, the fastest other method that fits a cap, the planner's rows against
both, the duel's interval, issue 40's must-show ratios, and the table that prints them."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

from common import GiB


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
    """The fastest measured method other than the planner whose peak fits total_bytes - budget;
    compiled rows are left out (the planner's rows it is compared with run eagerly)."""
    cap = m.total_bytes - budget
    fits = [r for r in m.rows if "step_ms" in r and r["method"] != "plan" and not r.get("compiled")
            and peak_bytes(r) <= cap]
    return min(fits, key=lambda r: r["step_ms"], default=None)


def peak_bytes(row: dict) -> int:
    """A row's measured peak in bytes: exact where the row has it, else from its GiB (rounded to
    3 decimals, a MiB either way: too coarse for a cap taken from another row's peak)."""
    return row["peak_bytes"] if "peak_bytes" in row else math.ceil(row["peak_GiB"] * GiB)


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
        # and by the planner's own account: a plan that says it does not fit fell back to its least
        # peak, so a row that measured less than the cap for it measured something else, not a fit
        fits = bool(mine) and peak_bytes(mine) <= cap and mine.get("plan", {}).get("fits", True)
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
    if section.get("must_show"):
        lines += ["", "issue 40's must-show, from this run:", *must_show_lines(section["must_show"])]
    return "\n".join(lines)


def must_show(section: dict) -> dict:
    """Issue 40's verdicts on one run of a Llama workload (rows measured side by side): the
    planner's worst ratio to the best other method that fits its cap; its step against
    checkpointing's at checkpointing's peak (at most 1x) and at half of it (at most 1.05x), each
    with the least peak any other eager method measured (a cap below it no method reached); with
    blocks compiled, against torch's activation_memory_budget=0.1 at that method's peak (at
    most 1x); and what full offload of the model compiled as one graph removes from the compiled
    model's peak, or whether that row warned. Where the planner was timed in alternation with the
    other method (the duel), the duel's ratio decides. A verdict whose rows are missing or failed
    says so (None)."""
    rows = {r["label"]: r for r in section["rows"] if "step_ms" in r}
    planner = {p["budget_bytes"]: p for p in section["planner"]}
    ckpt = rows.get("checkpoint")
    # where the planner was also timed in alternation with that method (frontier.py --duel), the
    # duel's ratio decides: rows measured minutes apart compare the machine's drift too
    dueled = {d["budget_bytes"]: d for d in section.get("duel", [])}
    fitting = [dueled[p["budget_bytes"]]["ratio"] if p["budget_bytes"] in dueled else p["x_other"]
               for p in section["planner"] if p.get("x_other") is not None]
    # a cap another method fits and the plan does not counts against it as much as a slower plan
    missed = [p["peak_cap_GiB"] for p in section["planner"] if p.get("best_other") and not p["fits_cap"]]
    out: dict = {"plan_vs_best_other": {"worst_x_other": max(fitting, default=None), "caps_missed_GiB": missed,
                                        "holds": bool(fitting) and max(fitting) <= 1.0 and not missed}}
    # the least peak any method other than the planner measured, eager: below it no method goes
    least = min((r["peak_GiB"] for r in rows.values() if r["method"] != "plan" and not r.get("compiled")),
                default=None)
    for key, limit in (("checkpoint", 1.0), ("half_checkpoint", 1.05)):
        p = planner.get(section.get("ckpt_budgets", {}).get(key))
        x = round(p["step_ms"] / ckpt["step_ms"], 3) if p and p["fits_cap"] and ckpt else None
        # a duel against checkpointing every block (Hugging Face's, or the bench's own per block)
        d = dueled.get(p and p["budget_bytes"])
        if d is not None and d["other"] not in ("checkpoint", f"ckpt-first-{section.get('layers')}"):
            d = None
        held = x is not None and (d["ratio"] if d else x) <= limit
        out[f"plan_at_{key}_peak"] = {"cap_GiB": p and p["peak_cap_GiB"], "plan_ms": p and p["step_ms"],
                                      "checkpoint_ms": ckpt and ckpt["step_ms"], "x_checkpoint": x,
                                      "duel": d and {"other": d["other"], "ratio": d["ratio"],
                                                     "ratio_95": d.get("ratio_95")},
                                      "limit": limit, "holds": held,
                                      "least_other_peak_GiB": least,
                                      "reached_by_any": bool(p) and (p["fits_cap"] or (least is not None
                                                                                       and least <= p["peak_cap_GiB"]))}
    budget = rows.get("compiled budget 0.1")
    mine = next((r for r in rows.values() if r.get("compiled") == "blocks" and r["method"] == "plan"), None)
    x = round(mine["step_ms"] / budget["step_ms"], 3) if mine and budget else None
    fits = bool(mine and budget) and mine["peak_GiB"] <= budget["peak_GiB"]
    out["blocks_compiled_plan_vs_budget_0.1"] = {"plan_ms": mine and mine["step_ms"],
                                                 "budget_0.1_ms": budget and budget["step_ms"], "x": x,
                                                 "fits_cap": fits, "holds": fits and x <= 1.0}
    whole, offload, graph = rows.get("compiled"), rows.get("compiled storm-full"), rows.get("compiled storm-graph")

    def removed(row: dict | None) -> float | None:
        return round(1 - row["peak_GiB"] / whole["peak_GiB"], 3) if whole and row and "peak_GiB" in row else None

    lowered, graph_lowered = removed(offload), removed(graph)
    graph_x = round(graph["step_ms"] / whole["step_ms"], 3) if whole and graph and "step_ms" in graph else None
    # issue 40 accepts the warning that names per-block compile in place of a lower peak
    warned = bool(offload) and any("compiled as one graph" in m for m in offload.get("warnings", []))
    out["graph_compiled_full_offload"] = {"peak_GiB": offload and offload["peak_GiB"],
                                          "compiled_peak_GiB": whole and whole["peak_GiB"],
                                          "fraction_removed": lowered, "warned": warned,
                                          "partitioner_peak_GiB": graph and graph.get("peak_GiB"),
                                          "partitioner_fraction_removed": graph_lowered,
                                          "partitioner_x_compiled": graph_x,
                                          "holds": warned or any(x is not None and x >= 0.5
                                                                 for x in (lowered, graph_lowered))}
    return out


def must_show_lines(verdicts: dict) -> list[str]:
    """must_show's verdicts, a line each."""
    return [f"{name}: " + ", ".join(f"{k} {v}" for k, v in v.items()) for name, v in verdicts.items()]
