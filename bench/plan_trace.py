"""Record what storm.plan traced on a workload: the data its cost model plans from.

    python bench/plan_trace.py --workloads W1 W2 --out bench/results/plan-trace.json   # CUDA

Per workload: the no-offload step's peak GPU memory above its start, then storm.plan with
peak= each --fractions of it (with bench/frontier.py's options), stepped until it has traced
(offload trace, compute trace, and with peak= the kept-extra trace) and settled; the JSON holds, per cap, the Trace
(dataclasses.asdict), what the planner measured beside it (besides, kept_extra, target) and
the plan it kept. tests/planner/data/ holds such traces for the golden test of the
cost model. Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from common import W1, W2, Trainer, cuda_device, plan_summary, run, write


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=["W1", "W2"])
    p.add_argument("--fractions", nargs="+", type=float, default=[0.5],
                   help="storm.plan's peak= as fractions of the no-offload peak (default 0.5)")
    p.add_argument("--pool-size", default="24GiB", help="the embedded store's pool, as bench/frontier.py's")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("plan_trace.py")
    if device is None:
        return 2
    opts = {"mode": "embedded", "min_bytes": 1 << 20, "pool_size": args.pool_size}  # as bench/frontier.py's
    results: dict = {}
    for w in (w for w in (W1, W2) if w.name in args.workloads):
        none = run(w, "none", steps=3, warmup=2, opts={}, device=device)
        peak = int(none["peak_extra_GiB"] * (1 << 30))
        rows = []
        for f in args.fractions:
            t = Trainer(w, "plan", {"peak": int(peak * f), **opts}, device)
            try:
                t.warm(4)
                pl = t.planner
                rows.append({"fraction": f, "peak": int(peak * f), "trace": dataclasses.asdict(pl.trace),
                             "besides": pl.besides, "kept_extra": pl.kept_extra, "start_extra": pl.start_extra,
                             "target": pl.target,
                             "plan": plan_summary(pl), "explain": pl.explain()})
                print(pl.explain(), flush=True)
            finally:
                t.close()
        results[w.name] = {"none": none, "plans": rows}
        write(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
