"""Step time and memory per method: no offload, checkpointing, save_on_cpu, torchtune, STORM (embedded, daemon,
plan...).

    python bench/offload.py --out bench/results/offload.json            # W1, W2 timings (CUDA)
    python bench/offload.py --check --out bench/results/bitexact.json   # gradients, bit for bit
    python bench/offload.py --check --device cpu --workloads tiny --pool-size 256MiB --min-bytes 0 --out x.json
    python bench/offload.py --workloads W3L --methods checkpoint embedded plan --peak 40GiB --pool-size grow \
        --steps 5 --warmup 2 --out bench/results/w3l.json                # W3L: samples/s, STORM beside checkpointing

The workloads are bench/common.py's: W1, W2, W3 (issue 40's Hugging Face Llama), W3L (W3 at a batch
that does not fit an 80 GB GPU without help) and their smoke sizes tiny and W3-tiny.

Per method: median step time over --steps steps after --warmup, peak GPU memory
above the model's (activations and what offload holds), bytes moved each way,
host time waiting for fetches, link utilization ((bytes to host / measured D2H
bandwidth + bytes to device / measured H2D bandwidth) / step time) and the
lower bound of DESIGN.md: max(no-offload step, to-host / D2H, to-device / H2D).
The "-frames" methods store bf16 saves as frames (codec="ancf_exp", encoded on the
GPU): their bytes moved are the encoded ones. The "daemon" methods go through a
stormd that copies CUDA tensors itself (CUDA IPC, its own streams);
"daemon-client-copies" through one started with --no-cuda-ipc, whose clients
copy into the pool on their own streams.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch

import storm
from common import (
    WORKLOADS,
    GiB,
    Variant,
    Workload,
    cuda_device,
    link_bandwidth,
    run,
    start_daemon,
    stop_daemon,
    workloads,
    write,
)
from storm.examples.models import same_bits
from storm.report import progress


def spill_run(w: Workload, rows: dict, opts: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """STORM through a daemon whose pool holds a quarter of a step's offloaded bytes, spill on:
    the rest goes to a file on local disk and is read back ahead of backward. Reports the
    bytes spilled per step and the cost per spilled GB against the daemon without spill."""
    ref = rows.get("storm-daemon") or rows.get("storm-embedded")
    if ref is None or "to_host_GiB" not in ref:
        return {"error": "run after 'daemon' or 'embedded': the pool is sized from their bytes"}
    pool = max(int(ref["to_host_GiB"] * GiB * args.spill_fraction), 64 << 20)
    spill_dir = tempfile.mkdtemp(dir=args.spill_dir)
    daemon, endpoint = start_daemon(Path(tempfile.mkdtemp()), str(pool), "--spill", "--spill-dir", spill_dir,
                                    "--spill-limit", "32GiB")
    try:
        # What a step holds in the pool at once (copies in flight, fetched and not yet freed)
        # must fit beside what is being spilled and read back.
        opts = {**opts, "socket": endpoint, "max_held_bytes": pool // 4, "prefetch_bytes": pool // 4}
        node = storm.stats(mode="daemon", socket=endpoint)["node"]
        try:
            r = run(w, "storm", args.steps, args.warmup, opts, device)
        except storm.StormError as e:
            return {"error": str(e), "pool_bytes": pool}
        after = storm.stats(mode="daemon", socket=endpoint)["node"]
    finally:
        stop_daemon(daemon)
    steps = args.steps + args.warmup
    spilled = (after["spilled_total"] - node["spilled_total"]) / steps
    r.update(pool_bytes=pool, spilled_GB_per_step=round(spilled / 1e9, 3),
             read_back_GB_per_step=round((after["read_back_total"] - node["read_back_total"]) / steps / 1e9, 3),
             read_back_waited_on_get=after["read_back_on_get"] - node["read_back_on_get"])
    if "step_ms" in r and "step_ms" in ref and spilled:
        r["ms_per_spilled_GB"] = round((r["step_ms"] - ref["step_ms"]) / (spilled / 1e9), 2)
    return r


def timings(args: argparse.Namespace, device: torch.device) -> dict:
    bw = link_bandwidth(device)
    print(f"link: {bw}", flush=True)
    results: dict = {"link": bw}
    write(args.out, results)
    daemons = []  # (process, endpoint): stormd copying CUDA tensors itself, and one leaving that to clients
    endpoint = client_endpoint = None
    if {"daemon", "daemon-frames"} & set(args.methods):
        daemons.append(start_daemon(Path(tempfile.mkdtemp()), args.pool_size))
        endpoint = daemons[-1][1]
    if "daemon-client-copies" in args.methods:
        daemons.append(start_daemon(Path(tempfile.mkdtemp()), args.pool_size, "--no-cuda-ipc"))
        client_endpoint = daemons[-1][1]
    try:
        for w in workloads(args.workloads, args.batch, args.layers):
            rows: dict = {}
            base_opts = {"mode": "embedded", "min_bytes": args.min_bytes, **pool(args),
                         "max_held_bytes": args.max_held, "prefetch_bytes": args.prefetch, "budget": args.budget}
            plan = []
            for m in args.methods:
                if m in ("none", "checkpoint", "save_on_cpu", "torchtune"):
                    plan.append((m, w, m, {}))
                elif m == "torchtune-checkpoint":  # OffloadActivations over the checkpointed blocks' inputs
                    plan.append((m, Variant(w, ckpt=True), "torchtune", {}))
                elif m == "embedded":
                    plan.append(("storm-embedded", w, "storm", base_opts))
                elif m == "embedded-lowmem":  # a smaller copy queue and prefetch window: less memory held
                    plan.append(("storm-embedded-lowmem", w, "storm",
                                 {**base_opts, "max_held_bytes": 256 << 20, "prefetch_bytes": 256 << 20}))
                elif m == "daemon":
                    plan.append(("storm-daemon", w, "storm", {**base_opts, "mode": "daemon", "socket": endpoint}))
                elif m == "daemon-client-copies":  # stormd with cuda_ipc off: the client copies into its pool
                    plan.append(("storm-daemon-client-copies", w, "storm",
                                 {**base_opts, "mode": "daemon", "socket": client_endpoint}))
                elif m == "embedded-frames":
                    plan.append(("storm-embedded-frames", w, "storm", {**base_opts, "codec": "ancf_exp"}))
                elif m == "daemon-frames":
                    plan.append(("storm-daemon-frames", w, "storm",
                                 {**base_opts, "mode": "daemon", "socket": endpoint, "codec": "ancf_exp"}))
                elif m == "budgets":
                    plan += [(f"storm-budget-{int(f * 100)}%", w, "storm", {**base_opts, "budget": f})
                             for f in (0.25, 0.5, 0.75, 1.0)]
                if m in ("budgets", "budget-fit"):
                    plan.append(("storm-budget-fit", w, "storm", base_opts))
                if m in ("plan", "plan-raw"):  # storm.plan at --budget; plan-raw: frames not allowed
                    opts = {k: base_opts[k] for k in ("mode", "min_bytes", "pool_size") if k in base_opts}
                    plan.append((f"storm-{m}", w, "plan", {**opts, **plan_target(args)}
                                 | ({"codec": "raw"} if m == "plan-raw" else {})))
            if "spill" in args.methods:
                plan.append(("storm-daemon-spill", w, "storm", {**base_opts, "mode": "daemon"}))
            with progress(len(plan), w.name) as advance:
                for name, workload, method, opts in plan:
                    if name == "storm-daemon-spill":
                        rows[name] = spill_run(w, rows, opts, args, device)
                        advance(f"{w.name} {name}: {rows[name]}")
                        continue
                    if name == "storm-budget-fit":  # the bytes the link carries during forward
                        fwd_ms = rows.get("none", {}).get("forward_ms")
                        if fwd_ms is None:
                            continue
                        opts = {**opts, "budget": int(bw["d2h_GBps"] * 1e9 * fwd_ms / 1e3)}
                    r = run(workload, method, args.steps, args.warmup, opts, device)
                    rows[name] = r
                    advance(f"{w.name} {name}: {r}")
                    write(args.out, {**results, w.name: rows})  # what is done survives a time limit
            c = rows.get("none", {}).get("step_ms")
            for r in rows.values():
                if "to_host_GiB" in r:
                    th, td = r["to_host_GiB"] * GiB / 1e9, r["to_device_GiB"] * GiB / 1e9
                    link_s = th / bw["d2h_GBps"] + td / bw["h2d_GBps"]
                    r["link_utilization"] = round(link_s / (r["step_ms"] / 1e3), 3)
                    if c:
                        bound = max(c / 1e3, th / bw["d2h_GBps"], td / bw["h2d_GBps"])
                        r["lower_bound_ms"] = round(bound * 1e3, 2)
                        r["over_bound"] = round(r["step_ms"] / (bound * 1e3), 3)
                if c and "step_ms" in r:
                    r["over_no_offload"] = round(r["step_ms"] / c, 3)
            results[w.name] = rows
    finally:
        for daemon, _ in daemons:
            stop_daemon(daemon)
    return results


def plot(args: argparse.Namespace, device: torch.device) -> None:
    """GPU memory over one step of the first workload, without and with STORM, into args.plot."""
    from torch.autograd.profiler import record_function

    from storm.report import BACKWARD, FORWARD, Timeline, memory_timeline, plot_memory

    w = workloads(args.workloads, args.batch, args.layers)[0]
    opts = {"mode": "embedded", "min_bytes": args.min_bytes, **pool(args),
            "max_held_bytes": args.max_held, "prefetch_bytes": args.prefetch, "budget": args.budget}

    def timeline(label: str, offload: dict | None) -> Timeline:
        """One variant's step; its model and input are freed on return, before the next is built."""
        model, x = w.build(device)

        def step() -> None:
            with record_function(FORWARD), (storm.offload(**offload) if offload else contextlib.nullcontext()):
                y = w.forward(model, x)
            with record_function(BACKWARD):
                w.objective(y).backward()

        step()  # warm-up: the pool is pinned and the allocator's caches are filled outside the picture
        return memory_timeline(label, step, device)

    lines = []
    for label, offload in (("without STORM", None), ("with STORM (embedded)", opts)):
        lines.append(timeline(label, offload))
        torch.cuda.empty_cache()
    plot_memory(lines, args.plot, f"GPU memory over one {w.name} step (batch {w.batch}, seq {w.seq})")


def bitexact(args: argparse.Namespace, device: torch.device) -> dict:
    """Gradients of one step, no offload twice, then the STORM rows of --methods (embedded and daemon,
    raw and in frames, with a budget), compared bit for bit."""
    torch.use_deterministic_algorithms(True)
    results: dict = {"deterministic_algorithms": True}
    daemon, endpoint = start_daemon(Path(tempfile.mkdtemp()), args.pool_size)
    try:
        for w in workloads(args.workloads, args.batch, args.layers):
            ref = None
            row = {}
            embedded = {"mode": "embedded", "min_bytes": args.min_bytes, **pool(args)}
            daemon_opts = {"mode": "daemon", "socket": endpoint, "min_bytes": args.min_bytes}
            storm_rows = {"embedded": embedded, "daemon": daemon_opts,
                          "embedded-frames": {**embedded, "codec": "ancf_exp"},
                          "daemon-frames": {**daemon_opts, "codec": "ancf_exp"},
                          # one step: a byte budget (a fraction's first step offloads all)
                          "embedded-budget": {**embedded, "budget": args.budget},
                          "daemon-budget": {**daemon_opts, "budget": args.budget}}
            for name, opts in (("none", None), ("none-again", None),
                               *((f"storm-{m}", storm_rows[m]) for m in args.methods if m in storm_rows)):
                model, x = w.build(device)
                if opts is None:
                    y = w.forward(model, x)
                else:
                    with storm.offload(**opts) as ctx:
                        y = w.forward(model, x)
                w.objective(y).backward()
                grads = [p.grad for p in model.parameters()]
                if ref is None:
                    ref = [g.clone() for g in grads]
                    row[name] = "reference"
                else:
                    differ = sum(not same_bits(a, b) for a, b in zip(ref, grads))
                    row[name] = {"differing_gradients": differ, "of": len(ref)}
                    if opts is not None:
                        st = ctx.stats
                        row[name].update(offloaded_tensors=st.offloaded, frame_overflows=st.frame_overflows,
                                         ratio=round(st.offloaded_bytes / max(st.stored_bytes, 1), 3))
                print(f"{w.name} {name}: {row[name]}", flush=True)
                del model, x, y, grads
                torch.cuda.empty_cache()
            results[w.name] = row
            del ref
    finally:
        stop_daemon(daemon)
    return results


def plan_budget(budget: str | None) -> float | str:
    """--budget for storm.plan: a fraction of a step's offloadable bytes ("0.3") or bytes ("6GiB")."""
    if budget is None:
        raise SystemExit("the plan methods need --budget (a fraction such as 0.3, or bytes such as 6GiB) or --peak")
    try:
        return float(budget)
    except ValueError:
        return budget


def plan_target(args: argparse.Namespace) -> dict:
    """storm.plan's target: peak=--peak where given, else budget=--budget."""
    return {"peak": args.peak} if args.peak is not None else {"budget": plan_budget(args.budget)}


def pool(args: argparse.Namespace) -> dict:
    """The embedded store's pool_size option: none for --pool-size grow (the pool grows on demand)."""
    return {} if args.pool_size == "grow" else {"pool_size": args.pool_size}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=list(WORKLOADS),
                   help="W1, W2, tiny (a smoke run's), W3 (issue 40's Llama; W3L at batch 24, W3-tiny)")
    p.add_argument("--device", default="cuda", help="--check compares gradients on cpu too; the timings need CUDA")
    p.add_argument("--methods", nargs="+", default=None,
                   help="timings: none checkpoint save_on_cpu embedded embedded-lowmem daemon budgets (the "
                        "default), daemon-client-copies, embedded-frames, daemon-frames, budget-fit, spill, "
                        "torchtune and torchtune-checkpoint (torchtune's OffloadActivations), "
                        "plan and plan-raw (storm.plan at --peak or --budget; plan-raw without frames); "
                        "--check: embedded daemon embedded-frames daemon-frames (the default), embedded-budget, "
                        "daemon-budget (with --budget in bytes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", default="24GiB",
                   help="the stores' pool; grow: the embedded store's default, a pool that grows on demand")
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--max-held", type=int, default=512 << 20)
    p.add_argument("--prefetch", type=int, default=512 << 20)
    p.add_argument("--batch", type=int, default=None, help="override the workloads' batch size")
    p.add_argument("--layers", type=int, default=None, help="override the workloads' depth (smoke runs)")
    p.add_argument("--spill-fraction", type=float, default=0.25,
                   help="spill method: the daemon's pool as a fraction of a step's offloaded bytes")
    p.add_argument("--spill-dir", default="/var/tmp", help="spill method: where the spill file goes (local disk)")
    p.add_argument("--budget", default=None, help="storm.offload(budget=...) for the embedded/daemon methods")
    p.add_argument("--peak", default=None, help="plan methods: storm.plan(peak=...) instead of --budget (e.g. 60GiB)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw GPU memory over one step of the first workload, without and with STORM")
    p.add_argument("--check", action="store_true", help="compare gradients bit for bit instead of timing")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.methods is None:
        args.methods = (["embedded", "daemon", "embedded-frames", "daemon-frames"] if args.check else
                        ["none", "checkpoint", "save_on_cpu", "embedded", "embedded-lowmem", "daemon", "budgets"])
    if args.pool_size == "grow" and any(m.startswith("daemon") or m == "spill" for m in args.methods):
        p.error("--pool-size grow sizes the embedded store's pool only; a stormd's pool needs a size")
    if args.check and any(m.endswith("-budget") for m in args.methods) and args.budget is None:
        p.error("--check with a budget row needs --budget (bytes, e.g. 2GiB)")
    if args.device == "cuda":
        device = cuda_device("offload.py", "; --check --device cpu compares gradients on the CPU")
        if device is None:
            return 2
    elif args.check:
        device = torch.device(args.device)
    else:
        p.error("the timings measure on CUDA; only --check runs on another --device")
    write(args.out, bitexact(args, device) if args.check else timings(args, device), device)
    if args.plot:
        plot(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
