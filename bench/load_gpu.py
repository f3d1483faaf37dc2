"""Training load through one stormd: N client processes train a small GPT at once, every step's gradients
compared bit for bit with the same step without offload.

    python bench/load_gpu.py                                   # 2 x 200 steps on CUDA: bench/results/load-gpu-DATE.json
    python bench/load_gpu.py --procs 4 --steps 500 --kill-one  # and a fifth worker SIGKILLed mid-forward
    python bench/load_gpu.py --device cpu --steps 30 --kill-one --kill-at 3 --out /tmp/x.json
    python bench/load_gpu.py --socket ipc:///run/stormd/stormd.sock   # a running daemon instead of a fresh one

Each worker runs every step twice from the same state and the same dropout masks: once under
storm.offload(mode="daemon", min_bytes=0), once without, then compares every parameter's gradient
with same_bits and applies the same SGD update to both copies. Throughput counts the tensors offloaded
and the bytes moved to the host plus back, over the wall time of the offloaded steps only.
--kill-one adds a victim worker, SIGKILLed while it is paused in the middle of a forward holding extents
in the pool; stormd must notice (by heartbeat, within 15 s) and free them: once every worker is done, the
pool's use, client count and the GPU segments stormd has open (CUDA IPC) must be back where they were
before the run. Exit 1 on a mismatch or a leak.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initialises CUDA, here and in workers

import argparse  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

import storm  # noqa: E402
from common import REPO, percentile, start_daemon, write  # noqa: E402
from storm.examples.models import GPT, same_bits  # noqa: E402
from stormd.ctl import request  # noqa: E402
from stormd.wire.endpoint import normalize_endpoint  # noqa: E402

MODEL = {"seq_len": 128, "d_model": 256, "heads": 4, "layers": 4, "batch": 8}  # defaults, sized for the GPU
RECLAIM_WAIT_S = 15.0  # the default --client-timeout (10 s) plus one reaper period, plus slack


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(wid: int, cfg: dict[str, Any], endpoint: str, start: Any, out: Any, victim: bool) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    device = torch.device(cfg["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # the workers share the cores; oversubscribed threads only add noise
    seed = 1000 + wid
    torch.manual_seed(seed)
    model = GPT(256, cfg["seq_len"], cfg["d_model"], cfg["heads"], cfg["layers"]).to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    data_gen = torch.Generator().manual_seed(seed)
    out.put(("ready", wid, os.getpid()))
    start.wait()
    times: list[float] = []
    tensors = moved = 0
    mismatches: list[int] = []  # steps whose gradients differed
    for step in range(cfg["kill_at"] + 1 if victim else cfg["steps"]):
        batch = torch.randint(256, (cfg["batch"], cfg["seq_len"] + 1), generator=data_gen).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        if victim and step == cfg["kill_at"]:
            def pause(*_: Any) -> None:  # hold still halfway through forward, extents in the pool, until killed
                out.put(("paused", wid, step))
                time.sleep(3600)

            model.blocks[len(model.blocks) // 2].register_forward_hook(pause)
        torch.manual_seed(seed * 100_003 + step)  # the same dropout masks in both runs
        sync(device)
        t0 = time.perf_counter()
        with storm.offload(mode="daemon", socket=endpoint, min_bytes=0) as ctx:
            loss = model.loss(x, y)
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        tensors += ctx.stats.offloaded
        moved += ctx.stats.offloaded_bytes + ctx.stats.fetched_bytes
        torch.manual_seed(seed * 100_003 + step)
        ref.loss(x, y).backward()
        if any(not same_bits(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())):
            mismatches.append(step)
        opt.step()
        with torch.no_grad():  # the update of the reference, copied: both stay identical even after a mismatch
            for p, q in zip(model.parameters(), ref.parameters()):
                p.copy_(q)
                p.grad = q.grad = None
    wall = sum(times)
    return {"worker": wid, "steps": len(times), "mismatches": len(mismatches), "mismatch_steps": mismatches,
            "offloaded_tensors": tensors,
            "moved_bytes": moved, "offload_wall_s": round(wall, 3), "tensors_per_s": round(tensors / wall, 1),
            "GB_per_s": round(moved / wall / 1e9, 4), "step_ms_p50": round(percentile(times, 0.5) * 1e3, 2),
            "step_ms_p99": round(percentile(times, 0.99) * 1e3, 2)}


def worker(wid: int, cfg: dict[str, Any], endpoint: str, start: Any, out: Any, victim: bool) -> None:
    try:
        out.put(("done", wid, train(wid, cfg, endpoint, start, out, victim)))
    except BaseException:
        out.put(("error", wid, traceback.format_exc()))


def node(endpoint: str) -> dict[str, Any]:
    return request(endpoint, "STATUS", 5.0)["node"]


def client_pids(endpoint: str) -> dict[int, dict[str, Any]]:
    return {c["pid"]: c for c in request(endpoint, "CLIENTS", 5.0)["clients"]}


def wait_until(cond: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until cond() held, or None if it did not within timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.05)
    return round(time.monotonic() - t0, 3)


def next_message(out: Any, want: str, results: dict[int, Any], errors: list[str], procs: list[Any]) -> tuple:
    """Messages until one of kind ``want`` or an error; results and errors are filed on the way."""
    while True:
        try:
            msg = out.get(timeout=5)
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                raise RuntimeError(f"the workers exited without reporting {want}") from None
            continue
        if msg[0] == "done":
            results[msg[1]] = msg[2]
        elif msg[0] == "error":
            errors.append(f"worker {msg[1]}: {msg[2]}")
        if msg[0] in (want, "error"):
            return msg


def kill_victim(endpoint: str, victim: Any, step: int, running: int) -> dict[str, Any]:
    before, held = node(endpoint), client_pids(endpoint)[victim.pid]["held_bytes"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join()
    reclaimed = wait_until(lambda: victim.pid not in client_pids(endpoint), RECLAIM_WAIT_S)
    after = node(endpoint)
    return {"killed_at_step": step, "survivors_running": running, "victim_held_bytes": held,
            "pool_used_before_kill": before["used"], "clients_before_kill": before["clients"],
            "reclaimed_after_s": reclaimed, "pool_used_after_reclaim": after["used"],
            "clients_after_reclaim": after["clients"]}


def run(a: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no CUDA or ZeroMQ state shared across fork
    start, out = ctx.Event(), ctx.Queue()
    cfg = {k: getattr(a, k) for k in ("device", "steps", "kill_at", *MODEL)}
    base = node(endpoint)
    n = a.procs + int(a.kill_one)
    procs = [ctx.Process(target=worker, args=(w, cfg, endpoint, start, out, w == a.procs)) for w in range(n)]
    results: dict[int, Any] = {}
    errors: list[str] = []
    kill = None
    for p in procs:
        p.start()
    try:
        for _ in range(n):
            next_message(out, "ready", results, errors, procs)
        start.set()
        if a.kill_one and next_message(out, "paused", results, errors, procs)[0] == "paused":
            kill = kill_victim(endpoint, procs[-1], a.kill_at, a.procs - len(results))
        while len(results) < a.procs and not errors:
            next_message(out, "done", results, errors, procs)
        for p in procs[:a.procs]:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()

    def at_baseline() -> bool:
        now = node(endpoint)
        return (now["used"], now["clients"], now.get("cuda_segments", 0)) == \
            (base["used"], base["clients"], base.get("cuda_segments", 0))

    back = wait_until(at_baseline, RECLAIM_WAIT_S)
    final = node(endpoint)
    rows = [results[w] for w in sorted(results)]
    if kill is not None:
        kill.update(pool_back_to_baseline=back is not None, survivor_mismatches=sum(r["mismatches"] for r in rows))
    return {"procs": a.procs, "steps_per_proc": a.steps, "errors": errors, "workers": rows,
            "totals": {"tensors_per_s": round(sum(r["tensors_per_s"] for r in rows), 1),
                       "GB_per_s": round(sum(r["GB_per_s"] for r in rows), 4),
                       "mismatches": sum(r["mismatches"] for r in rows)},
            "pool": {"baseline_used": base["used"], "baseline_clients": base["clients"], "final_used": final["used"],
                     "final_clients": final["clients"], "final_cuda_segments": final.get("cuda_segments", 0),
                     "back_to_baseline_after_s": back},
            "kill_one": kill}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pool-size", default="4GiB")
    p.add_argument("--socket", help="a running stormd; default: start one for the run")
    p.add_argument("--kill-one", action="store_true", help="also run a victim worker and SIGKILL it mid-forward")
    p.add_argument("--kill-at", type=int, default=20, help="the victim's step that is killed (default 20)")
    for name, default in MODEL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--out", type=Path, help="default bench/results/load-gpu-DATE.json")
    a = p.parse_args(argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = a.out or REPO / "bench" / "results" / f"load-gpu-{now.date().isoformat()}.json"
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--no-metrics", "--log-level", "INFO")
        daemon, endpoint = (None, normalize_endpoint(a.socket)) if a.socket else \
            start_daemon(Path(tmp), a.pool_size, *flags, log=Path(tmp) / "stormd.log")
        try:
            result = run(a, endpoint)
            if daemon is not None:
                log = (Path(tmp) / "stormd.log").read_text().splitlines()
                result["daemon_disconnects"] = [line for line in log if "client disconnected" in line]
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)
    write(out, result, a.device, model={k: getattr(a, k) for k in MODEL})

    cols = ("worker", "steps", "mismatches", "tensors_per_s", "GB_per_s", "step_ms_p50", "step_ms_p99")
    totals = result["totals"]
    for r in [dict(zip(cols, cols)), *result["workers"], {"worker": "total", **totals}]:
        print(" ".join(f"{r.get(c, ''):>{len(c)}}" for c in cols))
    kill = result["kill_one"]
    print(f"pool: {result['pool']}" + (f"\nkill-one: {kill}" if kill else ""))
    if result["errors"]:
        print(*result["errors"], sep="\n", file=sys.stderr)
    ok = (not result["errors"] and len(result["workers"]) == a.procs and totals["mismatches"] == 0
          and result["pool"]["back_to_baseline_after_s"] is not None
          and (not a.kill_one or (kill is not None and kill["reclaimed_after_s"] is not None)))
    print(f"{'OK' if ok else 'FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
