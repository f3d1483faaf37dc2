"""How long storm.plan's cost model takes to choose a plan for a deep model, on the CPU.

    python bench/plan_time.py --out bench/results/plan-time-cpu-<date>-<commit>.json

The planner chooses on the training thread, from the trace of one step, each time it plans
(a few times before it settles). Its work grows with the blocks: a plan per blocks offloaded
and blocks recomputed with their inputs offloaded, each recomputing blocks until it fits. This
times choose() over a recorded trace (default: W2's, recorded on the lent H100 for the golden
test of the cost model) with its blocks repeated --repeat times, on every --every-th case of
that test's grid (budgets, codecs, kinds of plan), and records the median per case of --rounds
rounds. No GPU is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from common import write
from storm.planner import BlockTrace, Scenario, Trace, choose

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "planner" / "data" / "w2-h100.json"


def repeated(recorded: dict, times: int) -> Trace:
    """The recorded Trace with its blocks repeated ``times`` times, as a model that many times as deep."""
    blocks = [BlockTrace(**{"input_tensors": int(b["input_bytes"] > 0), **b}) for b in recorded["blocks"]] * times
    offloaded_before = [recorded["before_bytes"]]
    for b in blocks[:-1]:
        offloaded_before.append(offloaded_before[-1] + b.saved_bytes)
    lead = recorded["lead_ms"]  # per block, then at forward's end
    return Trace(**{**recorded, "blocks": [dataclasses.replace(b) for b in blocks],
                    "offloaded_before": offloaded_before, "lead_ms": lead[:-1] * times + lead[-1:]})


def time_choices(trace: Trace, cases: list[dict]) -> float:
    """Seconds choose() took for ``cases``, all of them."""
    start = time.perf_counter()
    for case in cases:
        t = dataclasses.replace(trace, store_bytes=case["store_bytes"])
        choose(Scenario(t, case["budget"], held_bytes=case["held_bytes"], offload_margin=case["offload_margin"],
                        grads=case["grads"], codec=case["codec"], offload=case["offload"],
                        kept_extra=case["kept_extra"]))
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(GOLDEN), help="a recorded trace with its grid of cases (the golden test's)")
    p.add_argument("--repeat", nargs="+", type=int, default=[1, 2, 4], help="the trace's blocks repeated this often")
    p.add_argument("--every", type=int, default=200, help="every n-th case of the grid")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    recorded = json.loads(Path(args.trace).read_text())
    cases = [dict(zip(recorded["case"], values)) for *values, _ in recorded["cases"][::args.every]]
    rows = []
    for times in args.repeat:
        trace = repeated(recorded["trace"], times)
        seconds = [time_choices(trace, cases) for _ in range(args.rounds)]
        rows.append({"blocks": len(trace.blocks), "cases": len(cases),
                     "ms_per_choice": round(statistics.median(seconds) / len(cases) * 1e3, 1),
                     "ms_per_choice_each_round": [round(s / len(cases) * 1e3, 1) for s in seconds]})
        print(rows[-1], flush=True)
    write(args.out, {"trace": Path(args.trace).name, "rows": rows}, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
