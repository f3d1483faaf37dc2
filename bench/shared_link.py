"""Training processes sharing one GPU and one stormd: does each get its share of the link?

    python bench/shared_link.py --procs 2 --out bench/results/shared-link-DATE.json
    python bench/shared_link.py --device cpu --tiny --procs 2 --steps 4 --out /tmp/s.json   # a smoke run

Starts one stormd; trains W1 (bench/common.py) with full offload through it in one process,
then in --procs processes at once, all on --device (independent runs, no DDP: NCCL takes one
rank per GPU). Full offload of W1 is bound by the link, so the processes compete for it.
stormd gives every session its own copy streams and queues each request's copy when it comes,
with no ordering of its own between sessions; this measures what that gives each process.

Each process times its steps (wall clock, synchronized) after --warmup steps; the processes start
their timed steps together, and each goes on stepping until every one has run --steps. Only steps
that ended by the time the last one had run its --steps count (every process was still stepping
then), so none is timed with the link to itself, and each counts at least --steps. Reported: the
single process's median step, each shared process's median step, the spread (slowest over
fastest process: 1.0 is an even share) and the throughput of all processes together over the
single one's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import storm
from common import TINY, W1, start_daemon, write


def train(index: int, a: argparse.Namespace, endpoint: str, start: Any, done: Any, procs: int,
          results: Any) -> None:
    """One process: --warmup steps, then (once every process is ready) timed steps until every
    process has run --steps of them (``done`` counts those that have)."""
    device = torch.device(a.device)
    model, x = a.workload.build(device, seed=index)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    opts = {"mode": "daemon", "socket": endpoint, "min_bytes": 0 if a.tiny else 1 << 20}

    offloaded: list[int] = []

    def step() -> tuple[float, float]:
        t0 = time.time()
        with storm.offload(**opts) as ctx:  # mode="daemon": no fallback to an embedded store
            y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        offloaded.append(ctx.stats.offloaded)
        return t0, time.time()

    for _ in range(a.warmup):
        step()
    start.wait()
    spans: list[tuple[float, float]] = []
    deadline = time.time() + a.timeout  # another process may have died: stop anyway
    while len(spans) < a.steps or (done.value < procs and time.time() < deadline):
        spans.append(step())
        if len(spans) == a.steps:
            with done.get_lock():
                done.value += 1
    results.put({"process": index, "spans": spans, "offloaded_tensors_per_step": min(offloaded[a.warmup:])})
    storm.close_all()


def run(a: argparse.Namespace, procs: int, endpoint: str) -> list[dict[str, Any]]:
    """``procs`` processes at once; each one's rows, with its median over the steps every process overlapped."""
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    start, done, results = ctx.Barrier(procs), ctx.Value("i", 0), ctx.Queue()
    workers = [ctx.Process(target=train, args=(i, a, endpoint, start, done, procs, results)) for i in range(procs)]
    for p in workers:
        p.start()
    rows = sorted((results.get(timeout=a.timeout) for _ in workers), key=lambda r: r["process"])
    for p in workers:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"a training process exited with {p.exitcode}")
    # every process steps until the last has run --steps: up to then, all compete (a process that
    # stopped at its deadline before then, another having died, leaves its later steps out)
    together = min(max(r["spans"][a.steps - 1][1] for r in rows), min(r["spans"][-1][1] for r in rows))
    for r in rows:
        inside = [t1 - t0 for t0, t1 in r.pop("spans") if t1 <= together]
        if not inside:
            raise RuntimeError(f"process {r['process']} finished no step while all processes ran")
        r["steps_counted"] = len(inside)
        r["step_ms"] = round(statistics.median(inside) * 1e3, 2)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pool-size", default="16GiB")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of W1 (smoke runs on CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a process's result")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.procs < 2:
        p.error("--procs: at least 2 (one process alone is always measured)")
    a.workload = TINY if a.tiny else W1
    tmp = Path(tempfile.mkdtemp())
    daemon, endpoint = start_daemon(tmp, a.pool_size, log=tmp / "stormd.log")
    try:
        alone = run(a, 1, endpoint)[0]
        shared = run(a, a.procs, endpoint)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
    w = a.workload
    steps = [r["step_ms"] for r in shared]
    summary = {"alone_step_ms": alone["step_ms"], "shared_step_ms": steps,
               "spread": round(max(steps) / min(steps), 3),
               "throughput_over_alone": round(sum(1 / s for s in steps) / (1 / alone["step_ms"]), 3),
               "samples_per_s_alone": round(w.batch / alone["step_ms"] * 1e3, 1),
               "samples_per_s_shared": round(sum(w.batch / s for s in steps) * 1e3, 1)}
    print(summary)
    write(a.out, {"workload": w.name, "alone": alone, "shared": shared, "summary": summary}, a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
