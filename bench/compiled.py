"""torch.compile's own memory answers against STORM's, at each of them (issue 52) (CUDA).

    python bench/compiled.py --workloads W3 --modes graph --out bench/results/compiled.json --resume
    python bench/compiled.py --summary bench/results/compiled.json      # any machine: tables, verdicts

Two runs on two GPUs of one host at once (one per GPU, each its own --out) share its CPUs, and a
graph run's compiles take many of them (inductor's compile workers): give each run its own, e.g.
``TORCHINDUCTOR_COMPILE_THREADS=8 CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 python bench/compiled.py ...``,
since STORM's rows do host work each step that a busy host slows.

Per workload (W1 to W3 of bench/common.py, or a bench/zoo.py cell) and compile mode ("graph": the
model compiled as one graph; "blocks": each block compiled by itself), rows measured one after
the other (common.run: median step, peak above the step's start):

- "compiled": no offload;
- "amb B" for each --memory-budgets B: torch's activation_memory_budget=B, its selective
  recompute. Each row compiles with it through storm.partitioner(memory_budget=B, budget=0), which
  offloads nothing: a global config change is not part of dynamo's cache key, so a row's model
  could run a graph another row compiled under another budget;
- at each amb row's measured peak P, STORM's candidates: torch's recompute at the next larger
  budget and at none, with STORM taking off the rest. As one graph, storm.partitioner at that
  budget offloading the bytes its row peaked above P (the earliest saves), and where that peaked
  above P, once more sending twice the miss more (at least an eighth more); per block,
  storm.enable(model, peak=P) over the blocks compiled at that budget, and
  storm.enable(model, peak=P, compile_blocks=True) over the blocks uncompiled, whose planner chooses
  their budget with the plan (--storm says which of the two kinds run). The fastest that fits P is
  STORM's at P;
- STORM's least: full offload (storm.partitioner's every save but the last held_bytes; per block,
  storm.enable(model)) over torch's recompute at the least budget and at none; the lower peak;
- STORM "under": its candidates as at an amb peak, within LEAST_UNDER under the least budget's
  peak, over torch's recompute at that budget and at none: where full offload is bound by the link,
  the plan that reaches the issue's "15% under" with the least step.

Then duels in alternation (zoo.duel: both on the device at once, warmed, --rounds rounds of
--round-steps steps each): STORM at each P against amb B, and STORM's least against the least
budget's row, and STORM "under" against it too. The verdicts are issue 52's must-show: STORM fits
each amb peak at most at 1.00x its step, and its least peak (full offload; "under" judged alike) is
at least 15% under the least budget's at most at 1.20x its step.
--resume keeps the rows and duels an earlier call wrote to --out, so that a workload whose compiles
take longer than a device call goes on in the next.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hf import HF
from zoo import CELLS, duel

from common import WORKLOADS, GiB, Llama, Variant, Workload, cuda_device, run, workloads, write

STORM = {"mode": "embedded", "min_bytes": 1 << 20}
MEMORY_BUDGETS = (0.7, 0.5, 0.3, 0.1)
MODES = ("graph", "blocks")
Base = Workload | Llama | HF  # what a Variant builds on
FITS_X = 1.00  # STORM at an amb row's peak: at most its step
LEAST_UNDER, LEAST_X = 0.15, 1.20  # STORM's least peak: this much under the least budget's, at most this x its step
UNDER = "under"  # chosen's key for STORM's plan at LEAST_UNDER under the least budget's peak


@dataclass(frozen=True)
class Row:
    """One method on one workload, as common.run and zoo.duel take it."""

    label: str
    variant: Variant
    method: str
    opts: dict

    @property
    def spec(self) -> tuple[Variant, str, dict]:
        return self.variant, self.method, self.opts


def amb(b: float | None) -> str:
    return "compiled" if b is None else f"amb {b:g}"


def torch_rows(w: Base, mode: str, budgets: list[float]) -> list[Row]:
    """No offload, and torch's selective recompute at each budget."""
    return [Row(amb(b), Variant(w, compile=mode, memory_budget=b), "none", {}) for b in [None, *budgets]]


def storm_at(w: Base, mode: str, at: float | None, cap: int, send: int, again: bool = False) -> Row:
    """STORM within ``cap`` bytes over torch's recompute at budget ``at`` (None: none); as one graph,
    offloading ``send`` bytes of its saves (``again``: a second try, sending more)."""
    label = f"storm {cap / GiB:.3f}GiB over {amb(at)}" + " (again)" * again
    if mode == "graph":
        return Row(label, Variant(w, compile="graph", memory_budget=at, partitioner={**STORM, "budget": send}),
                   "none", {})
    return Row(label, Variant(w, compile="blocks", memory_budget=at), "enable", {**STORM, "peak": cap})


def storm_planned(w: Base, cap: int) -> Row:
    """STORM within ``cap`` bytes per block, its planner compiling the blocks and choosing their budget."""
    return Row(f"storm {cap / GiB:.3f}GiB, planner's budget", Variant(w, compile="planner"), "enable",
               {**STORM, "peak": cap, "compile_blocks": True})


def storm_full(w: Base, mode: str, at: float | None) -> Row:
    """STORM's full offload over torch's recompute at budget ``at``."""
    label = f"storm full over {amb(at)}"
    if mode == "graph":
        return Row(label, Variant(w, compile="graph", memory_budget=at, partitioner=dict(STORM)), "none", {})
    return Row(label, Variant(w, compile="blocks", memory_budget=at), "enable", dict(STORM))


def fitting(rows: dict, labels: list[str], cap: int) -> str | None:
    """Of ``labels``, the fastest row whose peak fits ``cap``; None where none does."""
    fit = [lb for lb in labels if "peak_bytes" in rows[lb] and rows[lb]["peak_bytes"] <= cap]
    return min(fit, key=lambda lb: rows[lb]["step_ms"], default=None)


def measure(w: Base, mode: str, budgets: list[float], sec: dict, run_row: Callable[[Row], dict],
            duel_rows: Callable[[list[Row]], dict], save: Callable[[], None], kinds: str = "both") -> None:
    """Fill ``sec`` (one workload and mode; rows and duels already there are kept): the rows, STORM's
    choice at each amb peak and its least, and their duels against torch's rows. ``kinds``, per
    block: STORM's candidates over torch's budgets ("over-budgets"), its planner's budgets
    ("planner"), or both."""
    rows: dict = sec.setdefault("rows", {})
    made: dict[str, Row] = {}

    def add(row: Row) -> str:
        made[row.label] = row
        if row.label not in rows:
            rows[row.label] = run_row(row)
            save()
        return row.label

    def fit(cap: int, ats: list[float | None]) -> str | None:
        """STORM within ``cap`` over torch's recompute at each budget of ``ats`` (None: none) whose row
        ran: the fastest that fits, or None."""
        labels = [add(storm_planned(w, cap))] if mode == "blocks" and kinds != "over-budgets" else []
        for at in ats if mode == "graph" or kinds != "planner" else []:
            if "peak_bytes" not in rows[amb(at)]:
                continue
            send = max(0, rows[amb(at)]["peak_bytes"] - cap)  # what torch's row at `at` peaked above the cap
            labels.append(add(storm_at(w, mode, at, cap, send)))
            miss = rows[labels[-1]].get("peak_bytes", cap) - cap
            if mode == "graph" and miss > 0:  # the peak fell less than the bytes sent: send more, twice the
                # miss and at least an eighth of what went (the partitioner sends whole saves: a miss of a
                # few MB moves nothing until the next save goes too)
                labels.append(add(storm_at(w, mode, at, cap, send + max(2 * miss, send // 8), again=True)))
        return fitting(rows, labels, cap)

    for row in torch_rows(w, mode, budgets):
        add(row)
    order = sorted(budgets)
    chosen: dict = sec.setdefault("chosen", {})
    for b in order:
        if "peak_bytes" in rows[amb(b)]:
            chosen[amb(b)] = fit(rows[amb(b)]["peak_bytes"], [x for x in order if x > b][:1] + [None])
    least = [lb for lb in (add(storm_full(w, mode, at)) for at in (order[0], None)) if "peak_bytes" in rows[lb]]
    chosen["least"] = min(least, key=lambda lb: rows[lb]["peak_bytes"], default=None)
    if "peak_bytes" in rows[amb(order[0])]:  # full offload aside: STORM's plan as far under the least budget's peak
        chosen[UNDER] = fit(int(rows[amb(order[0])]["peak_bytes"] * (1 - LEAST_UNDER)), [order[0], None])
    save()
    duels: dict = sec.setdefault("duels", {})
    pairs = [(mine, theirs) for theirs, mine in chosen.items() if theirs.startswith("amb ") and mine is not None]
    pairs += [(chosen[k], amb(order[0])) for k in ("least", UNDER) if chosen.get(k) is not None]
    for mine, theirs in pairs:
        key = f"{mine} | {theirs}"
        if key not in duels:
            duels[key] = duel_rows([made[mine], made[theirs]])
            save()


def verdicts(sec: dict) -> dict:
    """Issue 52's must-show on one workload and mode, from its rows and duels (a duel's median
    decides where there is one)."""
    rows, chosen, duels = sec.get("rows", {}), sec.get("chosen", {}), sec.get("duels", {})

    def ratio(mine: str, theirs: str) -> tuple[float | None, list | None]:
        d = duels.get(f"{mine} | {theirs}", {})
        if "first_over" in d:
            return d["first_over"][0], d["first_over_95"][0]
        if "step_ms" in rows.get(mine, {}) and "step_ms" in rows.get(theirs, {}):
            return round(rows[mine]["step_ms"] / rows[theirs]["step_ms"], 3), None
        return None, None

    at_peaks = []
    for theirs, mine in chosen.items():
        if not theirs.startswith("amb "):
            continue
        x, x95 = ratio(mine, theirs) if mine else (None, None)
        at_peaks.append({"amb": theirs, "cap_GiB": round(rows[theirs]["peak_bytes"] / GiB, 3), "storm": mine,
                         "x_amb": x, "x_amb_95": x95, "holds": x is not None and x <= FITS_X})
    out: dict = {"at_amb_peaks": {"holds": bool(at_peaks) and all(v["holds"] for v in at_peaks), "caps": at_peaks}}
    lowest = min((k for k in rows if k.startswith("amb ")), key=lambda k: float(k.split()[1]), default=None)
    for key in ("least", UNDER):  # full offload, then the plan at LEAST_UNDER under (runs before it had none)
        mine = chosen.get(key)
        if mine and lowest and "peak_bytes" in rows.get(lowest, {}):
            under = 1 - rows[mine]["peak_bytes"] / rows[lowest]["peak_bytes"]
            x, x95 = ratio(mine, lowest)
            out[key] = {"storm": mine, "versus": lowest, "under": round(under, 3), "x": x, "x_95": x95,
                        "holds": under >= LEAST_UNDER and x is not None and x <= LEAST_X}
    return out


def table(name: str, sec: dict) -> str:
    lines = [f"{name}", f"{'row':52} {'step ms':>9} {'peak GiB':>9}"]
    for label, r in sec.get("rows", {}).items():
        shown = (f"{r['step_ms']:9.2f} {r['peak_bytes'] / GiB:9.3f}" if "step_ms" in r else f"  {r.get('error')}")
        lines.append(f"{label:52} {shown}")
    v = verdicts(sec)
    for c in v["at_amb_peaks"]["caps"]:
        storm = f"{c['storm']}, {c['x_amb']}x {c['x_amb_95'] or ''}" if c["storm"] else "nothing of STORM fits"
        lines.append(f"at {c['amb']}'s peak {c['cap_GiB']} GiB: {storm}: {'holds' if c['holds'] else 'FAILS'}")
    for key, what in (("least", "least"), (UNDER, f"{LEAST_UNDER:.0%} under")):
        if key in v:
            lc = v[key]
            lines.append(f"{what}: {lc['storm']} {lc['under']:.1%} under {lc['versus']}, {lc['x']}x "
                         f"{lc['x_95'] or ''}: {'holds' if lc['holds'] else 'FAILS'}")
    return "\n".join(lines)


def workload(name: str, layers: int | None) -> Base:
    """W1 to W3 (at ``layers`` where given) or a zoo cell, by name."""
    return workloads([name], layers=layers)[0] if name in WORKLOADS else CELLS[name]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["W3"], choices=[*WORKLOADS, *CELLS], metavar="NAME",
                   help="W1, W2, W3 or a bench/zoo.py cell")
    p.add_argument("--layers", type=int, help="W1 to W3 at this many layers (W3 compiles faster at 8)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--memory-budgets", nargs="+", type=float, default=list(MEMORY_BUDGETS))
    p.add_argument("--storm", choices=("over-budgets", "planner", "both"), default="both",
                   help="per block, STORM's candidates: over torch's budgets, its planner's own, or both")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (a plan also until it settles)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each duel")
    p.add_argument("--round-steps", type=int, default=3, help="steps of each method per round")
    p.add_argument("--out", help="results JSON, rewritten after each row and duel")
    p.add_argument("--resume", action="store_true", help="keep what --out holds and measure the rest")
    p.add_argument("--summary", metavar="RESULTS.json", help="measure nothing: the tables and verdicts of a run")
    args = p.parse_args()
    if args.summary:
        for name, sec in json.loads(Path(args.summary).read_text())["workloads"].items():
            print(table(name, sec), end="\n\n")
        return 0
    if not args.out:
        p.error("--out is required to measure")
    device = cuda_device("compiled.py")
    if device is None:
        return 2
    results = {"workloads": {}}
    if args.resume and Path(args.out).exists():
        results["workloads"] = json.loads(Path(args.out).read_text()).get("workloads", {})
    order = random.Random(0)
    for name in args.workloads:
        w = workload(name, args.layers)
        for mode in args.modes:
            sec = results["workloads"].setdefault(f"{w.name} {mode}", {})
            measure(w, mode, args.memory_budgets, sec,
                    run_row=lambda row: run(row.variant, row.method, args.steps, args.warmup, row.opts, device),
                    duel_rows=lambda these: duel([r.spec for r in these], args, device, order),
                    save=lambda: write(args.out, results, device), kinds=args.storm)
            print(table(f"{w.name} {mode}", sec), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
