"""Where a STORM step's time goes: host against GPU time per phase, and a profiler trace.

    python bench/profile_step.py --out bench/results/profile-w1.json [--trace-dir DIR]

For each variant (no offload; hooks with nothing offloaded, a 1-byte budget; the budget that fits
forward's link time, or --budget bytes, which keeps runs comparable; full offload; with --daemon
the budget and full offload through a stormd that copies by CUDA IPC; --only picks some) it
reports, as medians over --steps steps in each of --rounds rounds (the variants run in turn, one
model, so machine drift hits all alike): the step's wall time; how long forward and backward
took on the host (the Python calls returning) and on the compute stream (events recorded on it).
A host phase much longer than its GPU phase means STORM's host work is the
bottleneck; a GPU phase longer than without offload means the compute stream
waited for copies. With --trace-dir, one step of each variant is written as a
gzipped Chrome trace; with --cprofile the first round runs under cProfile (the Python
functions that took the host's time are printed, and that round's steps are not counted).
With --daemon-cores N, stormd runs on N physical cores of its own and this process on the others
(through stormd W1's step was 1.01x the embedded one in one run and 1.11x in the next, each
run's rounds agreeing to 1 ms: where the processes' threads land may be what differs).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import gzip
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from daemon import physical_cores, split_cores, start_daemon, thread_cpus  # noqa: E402
from offload import link_bandwidth, write  # noqa: E402
from workloads import W1, W2  # noqa: E402


def step(model, x, opt, opts: dict | None) -> dict[str, float]:
    """One training step under storm.offload(**opts) (None: none); see timed_step."""
    return timed_step(model, x, opt, None if opts is None else lambda: storm.offload(**opts))


def timed_step(model, x, opt, scope: Callable[[], contextlib.AbstractContextManager] | None) -> dict[str, float]:
    """One training step, forward under the context ``scope()`` makes (made inside the timed
    step, as a training loop makes it each step); host and compute-stream durations of forward
    and backward (ms)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    t0 = time.perf_counter()
    ev[0].record()
    with scope() if scope is not None else contextlib.nullcontext():
        y = model(x)
    ev[1].record()
    t1 = time.perf_counter()
    y.float().pow(2).mean().backward()
    ev[2].record()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return {"step_ms": (t3 - t0) * 1e3, "host_fwd_ms": (t1 - t0) * 1e3, "host_bwd_ms": (t2 - t1) * 1e3,
            "gpu_fwd_ms": ev[0].elapsed_time(ev[1]), "gpu_bwd_ms": ev[1].elapsed_time(ev[2])}


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per key of timed_step's (or any) samples, the median, in ms to 0.01."""
    return {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1", choices=["W1", "W2"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variants this many times in turn, --steps steps each; medians over all")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", default="8GiB")
    p.add_argument("--budget", type=int, default=None,
                   help="bytes for the budget-fit variants (default: what the link carries while forward runs, "
                        "measured in the first round; fix it to compare runs)")
    p.add_argument("--only", default=None, help="comma-separated variants to run (default: all)")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--cprofile", action="store_true", help="print the Python functions that took the host's time")
    p.add_argument("--daemon", action="store_true",
                   help="also the budget-fit and full variants through a stormd (its own copies, CUDA IPC); with "
                        "--cprofile, stormd runs under cProfile too and its functions are printed at the end")
    p.add_argument("--daemon-cores", type=int, default=None,
                   help="with --daemon: stormd runs on this many physical cores of its own (SMT siblings "
                        "included), this process on the others (default: both anywhere)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cpus = None
    if args.daemon_cores is not None:
        if not args.daemon:
            p.error("--daemon-cores needs --daemon")
        cores = physical_cores()
        try:
            daemon_cpus, own_cpus = split_cores(cores, args.daemon_cores)
        except ValueError as e:
            p.error(f"--daemon-cores: {e}")
        # before CUDA, the mover and the connection start threads: a thread's affinity is its own,
        # and threads started later inherit it
        os.sched_setaffinity(0, own_cpus)
        cpus = {"cores": [sorted(c) for c in cores], "stormd": sorted(daemon_cpus), "client": sorted(own_cpus)}
    w = {"W1": W1, "W2": W2}[args.workload]
    device = torch.device("cuda")
    bw = link_bandwidth(device)
    model, x = w.build(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    base = {"mode": "embedded", "pool_size": args.pool_size, "min_bytes": 1 << 20}
    rows: dict = {}
    variants = [("none", None), ("hooks-only", {**base, "budget": 1}), ("budget-fit", base), ("full", base),
                ("full-lowmem", base)]
    daemon = None
    if args.daemon:
        tmp = Path(tempfile.mkdtemp())
        daemon_profile = tmp / "stormd.prof" if args.cprofile else None
        daemon, endpoint = start_daemon(tmp, args.pool_size, cprofile=daemon_profile,
                                        cpus=set(cpus["stormd"]) if cpus is not None else None)
        through = {**base, "mode": "daemon", "socket": endpoint}
        variants += [("daemon-budget-fit", through), ("daemon-full", through)]
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {name for name, _ in variants}
        if unknown:
            p.error(f"--only: no variant {sorted(unknown)} (they are {[name for name, _ in variants]})")
        variants = [v for v in variants if v[0] in wanted]
        if args.budget is None and "none" not in wanted and any(w.endswith("budget-fit") for w in wanted):
            p.error("--only: the budget-fit variants size their budget from none's forward: add none, or --budget")
    samples: dict[str, list[dict[str, float]]] = {}
    profiled: dict[str, list[dict[str, float]]] = {}
    fit_budget: int | None = args.budget
    for rnd in range(args.rounds):  # the variants in alternation, so a drifting machine drifts for all
        for name, opts in variants:
            if name.endswith("budget-fit"):  # what the link carries while forward runs, fixed at the first round's
                if fit_budget is None:
                    fwd_ms = statistics.median(s["gpu_fwd_ms"] for s in samples.get("none") or profiled["none"])
                    fit_budget = int(bw["d2h_GBps"] * 1e9 * fwd_ms / 1e3)
                opts = {**opts, "budget": fit_budget}
            if name == "full-lowmem":
                opts = {**base, "max_held_bytes": 256 << 20, "prefetch_bytes": 256 << 20}
            for _ in range(args.warmup):
                step(model, x, opt, opts)
            prof = cProfile.Profile() if args.cprofile and rnd == 0 else None
            if prof is not None:
                prof.enable()
            got = [step(model, x, opt, opts) for _ in range(args.steps)]
            if prof is not None:  # steps timed under cProfile are not reported (its overhead is in them)
                prof.disable()
                profiled[name] = got
                print(f"--- {name}: Python time over {args.steps} steps")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(r"client|stormd|cuda|futures|threading", 30)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                continue
            samples.setdefault(name, []).extend(got)
            rows[name] = medians(samples[name])
            if opts is not None:
                rows[name]["budget"] = opts.get("budget")
            if args.trace_dir and rnd == 0:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as tprof:
                    step(model, x, opt, opts)
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                tmp = Path(args.trace_dir) / f"{name}.json"
                tprof.export_chrome_trace(str(tmp))
                with open(tmp, "rb") as f, gzip.open(f"{tmp}.gz", "wb") as g:
                    g.write(f.read())
                tmp.unlink()
            print(f"round {rnd + 1}", name, rows[name], flush=True)
    for name, row in rows.items():
        row["steps"] = len(samples[name])
        if name != "none" and "none" in rows:
            row["over_none"] = round(row["step_ms"] / rows["none"]["step_ms"], 3)
    if cpus is not None:  # a thread started before the split, or that set its own, would run anywhere
        cpus["threads_elsewhere"] = {
            who: sum(allowed != set(cpus[who]) for allowed in thread_cpus(pid).values())
            for who, pid in (("client", os.getpid()), ("stormd", daemon.pid))}
    if daemon is not None:
        storm.close_all()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        if daemon_profile is not None:
            print("--- stormd: Python time over all daemon variants")
            pstats.Stats(str(daemon_profile)).sort_stats("tottime").print_stats(30)
            pstats.Stats(str(daemon_profile)).sort_stats("cumulative").print_stats(r"stormd", 30)
    write(args, {"link": bw, args.workload: rows, **({"cpus": cpus} if cpus is not None else {})})
    return 0


if __name__ == "__main__":
    sys.exit(main())
