"""W1/W2 step time and memory: no offload, checkpointing, save_on_cpu, STORM (embedded, daemon, frames, budgets, spill).

    python bench/offload.py --out bench/results/offload.json            # timings (CUDA)
    python bench/offload.py --check --out bench/results/bitexact.json   # gradients, bit for bit

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
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from storm.examples.models import same_bits  # noqa: E402
from storm.report import progress  # noqa: E402
import provenance  # noqa: E402
from daemon import start_daemon, stop_daemon  # noqa: E402
from workloads import W1, W2, Workload  # noqa: E402

GiB = 1 << 30


def cuda_device(script: str, hint: str = "") -> torch.device | None:
    """The CUDA device a benchmark that measures only there runs on; None, having said so on
    stderr (naming ``script``, then ``hint``), where torch sees none."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    print(f"bench/{script} measures on CUDA and torch sees no CUDA device here{hint}", file=sys.stderr)
    return None


def link_bandwidth(device: torch.device, nbytes: int = GiB, tries: int = 3) -> dict[str, float]:
    """Pinned D2H and H2D GB/s, measured here, now (machines drift): the best of ``tries``, each
    direction, as the link's speed is what the lower bounds need and a lent host's first
    measurement can come in low (37.8 GB/s to the host against 55.1 a minute later, ac1523d)."""
    d2h, h2d = (max(v) for v in zip(*(storm.planner.link_bandwidth(device, nbytes) for _ in range(tries))))
    return {"d2h_GBps": round(d2h, 1), "h2d_GBps": round(h2d, 1)}


def train_step(model, x, opt, method: str, opts: dict, planner: storm.Planner | None = None) -> storm.Offload | None:
    ctx = None
    if method == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            y = model(x)
    elif method == "storm":
        with storm.offload(**opts) as ctx:
            y = model(x)
    elif method == "plan":
        with planner.step() as ctx:
            y = model(x)
    else:
        y = model(x)
    y.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ctx


class Trainer:
    """One method's model, optimizer and (for "plan") planner on the device, stepped by train_step."""

    def __init__(self, w: Workload, method: str, opts: dict, device: torch.device):
        self.method, self.opts, self.device = method, opts, device
        self.model, self.x = w.build(device, ckpt=(method == "checkpoint"))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.planner = storm.plan(self.model.blocks, **opts) if method == "plan" else None
        self.last: storm.Offload | None = None

    def warm(self, steps: int) -> None:
        """``steps`` steps, and as many more (up to 50) as storm.plan needs to settle: it traces
        two steps (three with peak=), plans at the next, on CUDA measures planned steps until one
        is within its target (up to 4), resetting the peak statistics, reads a second offloading
        step's host time, and tries its plan against the best of the other kind, then in the
        other recompute form, in alternation (10 to 18 steps each trial)."""
        for _ in range(steps):
            self.step()
        for _ in range(50):
            if self.planner is None or self.planner.settled:
                break
            self.step()

    def step(self) -> float:
        """One training step, GPU work included: seconds."""
        t0 = time.perf_counter()
        self.last = train_step(self.model, self.x, self.opt, self.method, self.opts, self.planner)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()
        del self.model, self.x, self.opt, self.last
        torch.cuda.empty_cache()


def plan_summary(pl: storm.Planner) -> dict:
    """What a storm.plan chose and predicted, for a results row."""
    p = pl.plan
    return {"offloaded_blocks": p.offloaded, "recomputed_blocks": sorted(p.recomputed), "compressed": p.compressed,
            "predicted_peak_GiB": round(p.predicted_peak / GiB, 3), "predicted_cost_ms": p.predicted_cost_ms,
            "fits": p.fits, "reentrant": p.reentrant, "settled": pl.settled,
            "target_GiB": pl.target and round(pl.target / GiB, 3),
            "besides_GiB": pl.besides and round(pl.besides / GiB, 3), "kept_extra_GiB": round(pl.kept_extra / GiB, 3),
            "trial": "; ".join(t.describe() for t in pl.trials) or None}


def run(w: Workload, method: str, steps: int, warmup: int, opts: dict, device: torch.device) -> dict:
    t = Trainer(w, method, opts, device)
    try:
        t.warm(warmup)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        times = [t.step() for _ in range(steps)]
        r = {"step_ms": round(statistics.median(times) * 1e3, 2),
             "step_ms_min": round(min(times) * 1e3, 2),
             "samples_per_s": round(w.batch / statistics.median(times), 2),
             "peak_extra_GiB": round((torch.cuda.max_memory_allocated(device) - base) / GiB, 3)}
        if method == "none":  # forward alone: how many bytes its duration could carry to the host
            fwd = []
            for _ in range(3):
                t0 = time.perf_counter()
                y = t.model(t.x)
                torch.cuda.synchronize(device)
                fwd.append(time.perf_counter() - t0)
                del y
            r["forward_ms"] = round(statistics.median(fwd) * 1e3, 2)
        if t.last is not None:
            t.last.synchronize()
            st = t.last.stats
            ratio = st.offloaded_bytes / st.stored_bytes if st.stored_bytes else 1.0
            # fetched_bytes counts tensors' sizes; each comes back as it was stored
            r.update(to_host_GiB=round(st.stored_bytes / GiB, 3), to_device_GiB=round(st.fetched_bytes / ratio / GiB, 3),
                     offloaded_GiB=round(st.offloaded_bytes / GiB, 3), ratio=round(ratio, 3),
                     frame_overflows=st.frame_overflows, offloaded_tensors=st.offloaded, kept=dict(st.kept),
                     fetch_wait_ms=round(st.fetch_wait_s * 1e3, 2), backend=t.last.backend_name)
        if t.planner is not None:
            r.update(plan=plan_summary(t.planner), explain=t.planner.explain())
    except torch.OutOfMemoryError:
        r = {"error": "OOM"}
    t.close()
    return r


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


def workloads(args: argparse.Namespace) -> list[Workload]:
    chosen = [w for w in (W1, W2) if w.name in args.workloads]
    if args.batch:  # e.g. W1 at a batch whose activations do not fit on the GPU
        chosen = [dataclasses.replace(w, name=f"{w.name}_B{args.batch}", batch=args.batch) for w in chosen]
    return chosen


def timings(args: argparse.Namespace, device: torch.device) -> dict:
    bw = link_bandwidth(device)
    print(f"link: {bw}", flush=True)
    results: dict = {"link": bw}
    write(args, results)
    daemons = []  # (process, endpoint): stormd copying CUDA tensors itself, and one leaving that to clients
    endpoint = client_endpoint = None
    if {"daemon", "daemon-frames"} & set(args.methods):
        daemons.append(start_daemon(Path(tempfile.mkdtemp()), args.pool_size))
        endpoint = daemons[-1][1]
    if "daemon-client-copies" in args.methods:
        daemons.append(start_daemon(Path(tempfile.mkdtemp()), args.pool_size, "--no-cuda-ipc"))
        client_endpoint = daemons[-1][1]
    try:
        for w in workloads(args):
            rows: dict = {}
            base_opts = {"mode": "embedded", "min_bytes": args.min_bytes, "pool_size": args.pool_size,
                         "max_held_bytes": args.max_held, "prefetch_bytes": args.prefetch, "budget": args.budget}
            plan = []
            for m in args.methods:
                if m in ("none", "checkpoint", "save_on_cpu"):
                    plan.append((m, m, {}))
                elif m == "embedded":
                    plan.append(("storm-embedded", "storm", base_opts))
                elif m == "embedded-lowmem":  # a smaller copy queue and prefetch window: less memory held
                    plan.append(("storm-embedded-lowmem", "storm",
                                 {**base_opts, "max_held_bytes": 256 << 20, "prefetch_bytes": 256 << 20}))
                elif m == "daemon":
                    plan.append(("storm-daemon", "storm", {**base_opts, "mode": "daemon", "socket": endpoint}))
                elif m == "daemon-client-copies":  # stormd with cuda_ipc off: the client copies into its pool
                    plan.append(("storm-daemon-client-copies", "storm",
                                 {**base_opts, "mode": "daemon", "socket": client_endpoint}))
                elif m == "embedded-frames":
                    plan.append(("storm-embedded-frames", "storm", {**base_opts, "codec": "ancf_exp"}))
                elif m == "daemon-frames":
                    plan.append(("storm-daemon-frames", "storm",
                                 {**base_opts, "mode": "daemon", "socket": endpoint, "codec": "ancf_exp"}))
                elif m == "budgets":
                    plan += [(f"storm-budget-{int(f * 100)}%", "storm", {**base_opts, "budget": f})
                             for f in (0.25, 0.5, 0.75, 1.0)]
                if m in ("budgets", "budget-fit"):
                    plan.append(("storm-budget-fit", "storm", base_opts))
                if m in ("plan", "plan-raw"):  # storm.plan at --budget; plan-raw: frames not allowed
                    opts = {k: base_opts[k] for k in ("mode", "min_bytes", "pool_size")}
                    plan.append((f"storm-{m}", "plan", {**opts, "budget": plan_budget(args.budget)}
                                 | ({"codec": "raw"} if m == "plan-raw" else {})))
            if "spill" in args.methods:
                plan.append(("storm-daemon-spill", "storm", {**base_opts, "mode": "daemon"}))
            with progress(len(plan), w.name) as advance:
                for name, method, opts in plan:
                    if name == "storm-daemon-spill":
                        rows[name] = spill_run(w, rows, opts, args, device)
                        advance(f"{w.name} {name}: {rows[name]}")
                        continue
                    if name == "storm-budget-fit":  # the bytes the link carries during forward
                        fwd_ms = rows.get("none", {}).get("forward_ms")
                        if fwd_ms is None:
                            continue
                        opts = {**opts, "budget": int(bw["d2h_GBps"] * 1e9 * fwd_ms / 1e3)}
                    r = run(w, method, args.steps, args.warmup, opts, device)
                    rows[name] = r
                    advance(f"{w.name} {name}: {r}")
                    write(args, {**results, w.name: rows})  # what is done survives a time limit
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

    from storm.report import BACKWARD, FORWARD, memory_timeline, plot_memory

    w = workloads(args)[0]
    opts = {"mode": "embedded", "min_bytes": args.min_bytes, "pool_size": args.pool_size,
            "max_held_bytes": args.max_held, "prefetch_bytes": args.prefetch, "budget": args.budget}
    lines = []
    for label, offload in (("without STORM", None), ("with STORM (embedded)", opts)):
        model, x = w.build(device)

        def step() -> None:
            with record_function(FORWARD), (storm.offload(**offload) if offload else contextlib.nullcontext()):
                y = model(x)
            with record_function(BACKWARD):
                y.float().pow(2).mean().backward()

        step()  # warm-up: the pool is pinned and the allocator's caches are filled outside the picture
        lines.append(memory_timeline(label, step, device))
        del model, x
        torch.cuda.empty_cache()
    plot_memory(lines, args.plot, f"GPU memory over one {w.name} step (batch {w.batch}, seq {w.seq})")


def bitexact(args: argparse.Namespace, device: torch.device) -> dict:
    """Gradients of one step, no offload twice, then the STORM rows of --methods (embedded and daemon,
    raw and in frames, with a budget), compared bit for bit."""
    torch.use_deterministic_algorithms(True)
    results: dict = {"deterministic_algorithms": True}
    daemon, endpoint = start_daemon(Path(tempfile.mkdtemp()), args.pool_size)
    try:
        for w in workloads(args):
            ref = None
            row = {}
            embedded = {"mode": "embedded", "min_bytes": args.min_bytes, "pool_size": args.pool_size}
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
                    y = model(x)
                else:
                    with storm.offload(**opts) as ctx:
                        y = model(x)
                y.float().pow(2).mean().backward()
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
        raise SystemExit("the plan methods need --budget (a fraction such as 0.3, or bytes such as 6GiB)")
    try:
        return float(budget)
    except ValueError:
        return budget


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"])
    p.add_argument("--methods", nargs="+", default=None,
                   help="timings: none checkpoint save_on_cpu embedded embedded-lowmem daemon budgets (the "
                        "default), daemon-client-copies, embedded-frames, daemon-frames, budget-fit, spill, "
                        "plan and plan-raw (storm.plan at --budget; plan-raw without frames); "
                        "--check: embedded daemon embedded-frames daemon-frames (the default), embedded-budget, "
                        "daemon-budget (with --budget in bytes)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", default="24GiB")
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--max-held", type=int, default=512 << 20)
    p.add_argument("--prefetch", type=int, default=512 << 20)
    p.add_argument("--batch", type=int, default=None, help="override the workloads' batch size")
    p.add_argument("--spill-fraction", type=float, default=0.25,
                   help="spill method: the daemon's pool as a fraction of a step's offloaded bytes")
    p.add_argument("--spill-dir", default="/var/tmp", help="spill method: where the spill file goes (local disk)")
    p.add_argument("--budget", default=None, help="storm.offload(budget=...) for the embedded/daemon methods")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw GPU memory over one step of the first workload, without and with STORM")
    p.add_argument("--check", action="store_true", help="compare gradients bit for bit instead of timing")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.methods is None:
        args.methods = (["embedded", "daemon", "embedded-frames", "daemon-frames"] if args.check else
                        ["none", "checkpoint", "save_on_cpu", "embedded", "embedded-lowmem", "daemon", "budgets"])
    if args.check and any(m.endswith("-budget") for m in args.methods) and args.budget is None:
        p.error("--check with a budget row needs --budget (bytes, e.g. 2GiB)")
    device = torch.device("cuda")
    write(args, bitexact(args, device) if args.check else timings(args, device))
    if args.plot:
        plot(args, device)
    return 0


def write(args: argparse.Namespace, results: dict) -> None:
    results = {**results}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results["meta"] = {"device": device, "torch": torch.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "commit": provenance.commit(), "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                       "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
