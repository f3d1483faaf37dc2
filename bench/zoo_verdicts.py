"""The zoo's verdicts from its rows and duels alone (bench/zoo.py --summary recomputes them from a
results JSON on any machine): the caps a cell's plans are measured at, the fastest other method
that fits each, every must-show with its numbers, the table that prints them, and --merge's check
that files merged are one run's.
"""

from __future__ import annotations

from common import GiB
from summary import peak_bytes

MiB = 1 << 20

# The methods a user picks, as the rows name them; each one's peak is a cap for storm.enable(peak=)
OTHERS = ("none", "checkpoint", "save_on_cpu", "torchtune", "torchtune-checkpoint", "storm-enable")


def caps(rows: list[dict]) -> list[dict]:
    """The caps X for storm.enable(peak=X), least first: each other method's measured peak, and
    three between checkpointing's and no offload's; caps within 0.5% of one another are one, the
    least, with every source named."""
    measured = {r["method"]: peak_bytes(r) for r in rows if r["method"] in OTHERS and "step_ms" in r}
    found = sorted((b, m) for m, b in measured.items())
    if "none" in measured and "checkpoint" in measured:
        lo, hi = measured["checkpoint"], measured["none"]
        found = sorted(found + [(lo + (hi - lo) * k // 4, f"checkpoint + {k}/4 to none") for k in (1, 2, 3)])
    out: list[dict] = []
    for b, source in found:
        if out and b <= out[-1]["cap_bytes"] * 1.005:
            out[-1]["sources"].append(source)
        else:
            out.append({"cap_bytes": b, "sources": [source]})
    return out


def best_other(rows: list[dict], cap: int) -> dict | None:
    """The fastest of the other methods' rows whose measured peak fits ``cap``."""
    fits = [r for r in rows if r["method"] in OTHERS and "step_ms" in r and peak_bytes(r) <= cap]
    return min(fits, key=lambda r: r["step_ms"], default=None)


def verdicts(cell: dict) -> dict:
    """The cell's must-show, each with its numbers and ``holds`` (false where a row or duel it
    needs is missing or failed, or the cell was cut off), from the rows and duels alone."""
    rows = cell["rows"]
    by = {r["label"]: r for r in rows if "step_ms" in r}
    duels = {d["cap_bytes"]: d for d in cell.get("duels", []) if "ms" in d}
    alone = cell.get("mode") == "caps"  # no other method measured: nothing to hold the plan's step to
    # a cell cut off in its plan rows holds no verdict: its caps with a row so far are shown (older files
    # named a cap's plan only once its row was measured)
    caps = [c for c in cell.get("caps", []) if c.get("plan") in {r["label"] for r in rows}]
    per_cap = [_at_cap(c, by.get(c["plan"]), best_other(rows, c["cap_bytes"]), duels.get(c["cap_bytes"]), alone)
               for c in caps]
    predicted = [_prediction(c, by[c["plan"]]) for c in caps
                 if by.get(c["plan"], {}).get("predicted_step_peak_bytes") is not None]
    out: dict = {"per_cap": {"holds": None if alone else bool(per_cap) and all(v["holds"] for v in per_cap),
                             "caps": per_cap}}

    least = cell["caps"][0] if cell.get("caps") else {"cap_bytes": 0, "plan": None, "sources": None}
    mine, d = by.get(least.get("plan")), duels.get(least["cap_bytes"])
    # checkpointing timed in the same duel (measure_cell adds it at the least cap)
    x_ckpt = d["first_over"][d["versus"].index("checkpoint")] if d and "checkpoint" in d["versus"] else None
    within = mine is not None and peak_bytes(mine) <= 1.01 * least["cap_bytes"]
    out["least_cap"] = {"cap_GiB": round(least["cap_bytes"] / GiB, 3), "sources": least["sources"],
                        "plan_peak_GiB": mine and mine["peak_GiB"], "within_1pct": within, "x_checkpoint": x_ckpt,
                        "limit": 1.10, "holds": bool(within and x_ckpt is not None and x_ckpt <= 1.10)}

    full, tt, ttc = by.get("storm-enable"), by.get("torchtune"), by.get("torchtune-checkpoint")
    fd = cell.get("full_duel", {})
    x_tt, x_tt_95 = (fd["first_over"][0], fd["first_over_95"][0]) if "ms" in fd else (None, None)
    peak_x = round(peak_bytes(full) / peak_bytes(tt), 4) if full and tt else None
    out["full_offload"] = {"peak_GiB": full and full["peak_GiB"], "torchtune_peak_GiB": tt and tt["peak_GiB"],
                           "peak_x_torchtune": peak_x, "x_torchtune": x_tt, "x_torchtune_95": x_tt_95, "limit": 0.65,
                           "torchtune_checkpoint": ttc and {"step_ms": ttc["step_ms"], "peak_GiB": ttc["peak_GiB"]},
                           "holds": bool(peak_x is not None and peak_x <= 1.01 and x_tt is not None and x_tt <= 0.65)}
    out["predicted_peak"] = {"holds": bool(predicted) and all(v["holds"] for v in predicted), "plans": predicted}
    if not cell.get("complete"):  # cut off: what was measured is shown, and nothing holds until the rest is
        for v in out.values():
            v["holds"] = None if v["holds"] is None else False
    return out


def _at_cap(c: dict, mine: dict | None, other: dict | None, d: dict | None, alone: bool = False) -> dict:
    """At cap X: the plan's peak within X, and its step over the best other's in their duel
    (``alone``: no other method was measured, and ``holds`` is None). The duel plans afresh, and
    its trials, decided by step times, may keep another plan than the row's: that plan must fit
    too, by the planner's own measure of its step (``duel_plan_over_MiB``)."""
    fits = mine is not None and peak_bytes(mine) <= c["cap_bytes"]
    duel_plan = (d or {}).get("chosen")
    other_plan = bool(duel_plan and mine and mine.get("plan")) and _shape(duel_plan) != _shape(mine["plan"])
    duel_over = _measured_over(duel_plan) if other_plan else None
    if other_plan and (duel_over is None or duel_over > 0):
        fits = False
    return {"cap_GiB": round(c["cap_bytes"] / GiB, 3), "sources": c["sources"], "plan_ms": mine and mine["step_ms"],
            "plan_peak_GiB": mine and mine["peak_GiB"], "fits": fits, "best_other": other and other["label"],
            "best_other_ms": other and other["step_ms"], "x_best_other": d and d["first_over"][0],
            "x_best_other_95": d and d["first_over_95"][0], "duel_plan_differs": other_plan,
            "duel_plan_over_MiB": duel_over,
            "holds": None if alone else bool(fits and d and d["first_over"][0] <= 1.0)}


def _shape(plan: dict) -> tuple:
    """What a plan summary's step does with the blocks and its copies (common.plan_summary; files
    written before it kept the copy queue and prefetch window have None for them)."""
    return (plan["full_offload"], plan["offloaded_blocks"], tuple(plan["recomputed_blocks"]),
            plan["inputs_offloaded_blocks"], plan["compressed"], plan.get("max_held_bytes"),
            plan.get("prefetch_bytes"))


def _measured_over(plan: dict) -> float | None:
    """MiB the plan's own measured step went over its target: as recorded, or (files written before
    plan summaries kept it) from the one measured plan of its shape; None where unknown."""
    if "over_bytes" in plan:  # None: the planner did not measure it
        return None if plan["over_bytes"] is None else plan["over_bytes"] / MiB
    alike = [m for m in plan.get("measured", []) if (m["full_offload"], m["offloaded_blocks"], m["recomputed"],
                                                     m["inputs_offloaded_blocks"], m["compressed"])
             == (plan["full_offload"], plan["offloaded_blocks"], len(plan["recomputed_blocks"]),
                 plan["inputs_offloaded_blocks"], plan["compressed"])]
    return alike[0]["over_MiB"] if len(alike) == 1 else None


def _prediction(c: dict, mine: dict) -> dict:
    """The plan's predicted step peak against its row's measured one: within 3%, or 64 MiB."""
    p, m = mine["predicted_step_peak_bytes"], peak_bytes(mine)
    return {"cap_GiB": round(c["cap_bytes"] / GiB, 3), "predicted_GiB": round(p / GiB, 3),
            "measured_GiB": mine["peak_GiB"], "off_MiB": round((p - m) / MiB, 1),
            "off_pct": round(100 * (p - m) / m, 2) if m else None, "from": mine["predicted_from"],
            "holds": abs(p - m) <= max(0.03 * m, 64 * MiB)}


def short_commit(commit: object) -> str:
    """A commit as the tables name it: its first 7 digits, and what common.commit() added to it
    (+uncommitted: code that no commit holds)."""
    head, plus, rest = str(commit or "?").partition("+")
    return head[:7] + plus + rest


def table(name: str, cell: dict, markdown: bool = False) -> str:
    """A cell's rows (method, step, peak), its duels and verdicts: plain text, or the Markdown of
    docs/results.md."""
    w = cell["workload"]
    where = "; ".join(sorted({f"{m.get('device', '?')}, {m.get('date', '?')[:10]}, {short_commit(m.get('commit'))}"
                              for m in cell.get("calls", [cell.get("meta", {})])}))
    head = (f"{name}: {w['arch']} {w['layers']} layers, hidden {w['hidden']}, batch {w['batch']} x {w['seq']} "
            f"({where})")
    if not cell.get("complete"):
        head += "; cut off before its end (resume it with --resume): no verdict holds yet"
    lines = [f"**{head}**" if markdown else head, ""]
    lines += ["| method | step ms | peak GiB | plan |", "| --- | --- | --- | --- |"] if markdown else \
        [f"{'method':<28} {'step ms':>9} {'peak GiB':>9}  plan"]
    for r in cell["rows"]:
        step, peak = (f"{r['step_ms']:.2f}", f"{r['peak_GiB']:.3f}") if "step_ms" in r else (r.get("error", "?"), "")
        note = _plan_note(r)
        lines.append(f"| {r['label']} | {step} | {peak} | {note} |" if markdown
                     else f"{r['label']:<28} {step:>9} {peak:>9}  {note}")
    v = cell.get("verdicts") or verdicts(cell)
    lines += ["", "in alternation, at each cap: the plan against the best other that fits"]
    for c in v["per_cap"]["caps"]:
        held = "n/a (no other method measured)" if c["holds"] is None else "holds" if c["holds"] else "FAILS"
        timed = (f"{c['x_best_other']}x {c['best_other']} {c['x_best_other_95']}" if c["x_best_other"] is not None
                 else f"not timed against {c['best_other']}")
        over = c.get("duel_plan_over_MiB")
        duel = ("" if not c.get("duel_plan_differs") else " (the duel kept another plan than the row's, "
                + ("not measured by the planner)" if over is None else
                   f"its own step {abs(over):.1f} MiB {'over' if over > 0 else 'within'} its target)"))
        lines.append(f"{'- ' if markdown else ''}{c['cap_GiB']} GiB ({', '.join(c['sources'])}): plan "
                     f"{c['plan_peak_GiB']} GiB {'fits' if c['fits'] else 'does NOT fit'}{duel}, {timed}: {held}")
    d = cell.get("codec_duel")
    if d and "ms" in d:
        lines.append(f"{'- ' if markdown else ''}full offload's codecs in alternation: {d['ms']} ms; the first over "
                     + ", ".join(f"{who} {x}x {x95}" for who, x, x95 in zip(d["versus"], d["first_over"],
                                                                              d["first_over_95"])))
    for key in ("per_cap", "least_cap", "full_offload", "predicted_peak"):
        items = ", ".join(f"{k} {x}" for k, x in v[key].items() if k not in ("caps", "plans"))
        lines.append(f"{'- ' if markdown else ''}{key}: {items}")
    lines += [f"{'- ' if markdown else ''}  predicted {p['predicted_GiB']} GiB, measured {p['measured_GiB']} GiB at "
              f"cap {p['cap_GiB']}: {p['off_MiB']} MiB ({p['off_pct']}%) {'holds' if p['holds'] else 'FAILS'}"
              for p in v["predicted_peak"]["plans"]]
    return "\n".join(lines)


def _plan_note(r: dict) -> str:
    """What a plan row's plan did, in a few words; where storm.enable found its blocks."""
    p = r.get("plan")
    if not p:
        return ""
    if p.get("full_offload"):
        return "full offload (no plan of the blocks measured within the cap)" + ("" if p["fits"] else ", does NOT fit")
    return (f"{len(p['recomputed_blocks'])} recomputed, {p['offloaded_blocks']} offloaded, "
            f"{p['inputs_offloaded_blocks']} inputs offloaded, of {r.get('blocks')} at {r.get('blocks_at')}"
            + ("" if p["fits"] else ", does NOT fit"))


def merge(runs: list[dict], names: list[str]) -> dict:
    """The cells of ``runs`` (read from the files ``names``) as one run's: ValueError, naming the
    files, where a cell is in two of them, or their cells were measured at other commits or on
    other kinds of device (rows of two runs do not compare)."""
    cells: dict[str, dict] = {}
    where: dict[str, str] = {}
    for results, name in zip(runs, names):
        for cell, measured in results.get("cells", {}).items():
            if cell in cells:
                raise ValueError(f"{cell} is in both {where[cell]} and {name}: keep one")
            cells[cell], where[cell] = measured, name
    # every call that measured a cell (a cell resumed at another commit is not one run's either)
    calls = {cell: {(m.get("commit"), m.get("device")) for m in c.get("calls") or [c.get("meta", {})]}
             for cell, c in cells.items()}
    if len(set().union(*calls.values())) > 1:
        found = ", ".join(f"{cell} ({', '.join(f'{commit} on {device}' for commit, device in sorted(seen, key=str))}, "
                          f"{where[cell]})" for cell, seen in calls.items())
        raise ValueError(f"the cells were measured at more than one commit or on more than one kind of device, "
                         f"so they are not one run: {found}")
    return {"cells": cells}
