"""Writes tests/planner/data/<workload>-h100.json: a Trace storm.plan recorded on the lent H100
(bench/plan_trace.py) and the plan the cost model chooses from it for each case of a grid of
budgets and options. test_planner_golden.py asserts the same choices; run this again only when
the cost model is meant to choose differently, and say why in the commit.

    python tests/planner/make_golden.py bench/results/plan-trace-h100-2026-11-26-d17fd9e.json
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from storm.planner import BlockTrace, Scenario, Trace, choose

DATA = Path(__file__).resolve().parent / "data"
MiB = 1 << 20
FRACTIONS = [i / 10 for i in range(11)]  # budgets, as fractions of the trace's offloadable bytes
CASE = ("budget", "grads", "codec", "offload", "kept_extra", "held_bytes", "offload_margin", "store_bytes")
PLAN = ("offloaded", "recomputed", "offload_budget", "max_held_bytes", "prefetch_bytes", "predicted_peak",
        "predicted_cost_ms", "fits", "in_flight_bytes", "compressed", "inputs_offloaded")


def trace_of(recorded: dict) -> Trace:
    """The recorded Trace. Traces recorded before the input's tensors were counted lack them:
    W1's and W2's blocks are called with one tensor, which no other block is called with."""
    return Trace(**{**recorded, "blocks": [BlockTrace(**{"input_tensors": int(b["input_bytes"] > 0), **b})
                                           for b in recorded["blocks"]]})


def cases(trace: Trace, kept_extra: int) -> list[dict]:
    """The grid: every budget with and without gradients counted, each codec choice, each kind of
    plan, the traced kept_extra or none, the plan's own copy queue or a given one with a margin for
    plans that offload; and the same with a store that took half of the trace."""
    grid = itertools.product(FRACTIONS, (False, True), (None, "raw", "ancf_exp"), (None, True, False),
                             (0, kept_extra), ((None, 0), (256 * MiB, 64 * MiB)), (None, trace.total_bytes // 2))
    return [dict(zip(CASE, (int(f * trace.total_bytes), grads, codec, offload, extra, held, margin, store)))
            for f, grads, codec, offload, extra, (held, margin), store in grid]


def decision(trace: Trace, case: dict) -> list | None:
    """choose()'s plan for ``case``, its fields in PLAN's order (None: no plan of that kind)."""
    t = Trace(**{**trace.__dict__, "store_bytes": case["store_bytes"]})
    p = choose(Scenario(t, case["budget"], held_bytes=case["held_bytes"], offload_margin=case["offload_margin"],
                        grads=case["grads"], codec=case["codec"], offload=case["offload"],
                        kept_extra=case["kept_extra"]))
    if p is None:
        return None
    return [p.offloaded, sorted(p.recomputed), p.offload_budget, p.max_held_bytes, p.prefetch_bytes,
            p.predicted_peak, p.predicted_cost_ms, p.fits, p.in_flight_bytes, p.compressed, p.inputs_offloaded]


def main(path: str) -> None:
    recorded = json.loads(Path(path).read_text())
    for name in ("W1", "W2"):
        row = recorded[name]["plans"][0]
        trace = trace_of(row["trace"])
        golden = {"source": f"{Path(path).name} ({recorded['meta']['device']}, {recorded['meta']['commit']}), "
                            f"{name} at peak= {row['fraction']} of no offload's",
                  "trace": row["trace"], "case": CASE, "plan": PLAN,
                  "cases": [[*case.values(), decision(trace, case)] for case in cases(trace, row["kept_extra"])]}
        (DATA / f"{name.lower()}-h100.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
