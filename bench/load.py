"""Load on stormd's CPU path: N client processes x S steps of PUT / copy in / SEAL / GET / copy out
and compare / FREE, with random tensor sizes; every byte fetched is compared with what was stored.

    python bench/load.py                                  # 8 x 2000, writes bench/results/load-cpu-DATE.json
    python bench/load.py --procs 2 --steps 100 --out /tmp/x.json
    python bench/load.py --socket ipc:///run/stormd/stormd.sock   # a running daemon instead of a fresh one

Clients speak the protocol directly (no torch), so the figures are the daemon's and the socket's,
not autograd's. Throughput counts the tensors stored and the bytes copied in plus out, over the wall
time of the whole run; latency is one request's round trip, seen by the client. ``daemon`` is the
daemon's own cost per request over the run: ``busy_us`` what its loop spent answering one (STATUS'
traffic, from request received to reply sent); where this run started the daemon, ``cpu_us`` its
whole process's CPU time over the requests (ZeroMQ's I/O thread, the loop's waits and wakeups
included) and ``loop_cpu_us`` its main thread's, the event loop's, alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import multiprocessing
import os
import platform
import queue
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash
import zmq

from common import REPO, percentile, start_daemon, write
from stormd.ctl import request
from stormd.wire.protocol import PROTOCOL_VERSION, pack, unpack

MAX_BYTES = 1 << 16


def client(endpoint: str, seed: int, steps: int, ready: Any, start: Any) -> dict[str, Any]:
    """One client process: ``steps`` tensors through the daemon, every one checked byte for byte."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    ids = iter(range(1, 1 << 62))
    latencies: dict[str, list[float]] = {op: [] for op in ("PUT", "SEAL", "GET", "FREE")}
    auth: dict[str, Any] = {}
    errors: list[str] = []

    def call(op: str, **fields: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        sock.send(pack({"op": op, "id": next(ids), **auth, **fields}))
        while (r := unpack(sock.recv())).get("probe"):
            pass  # the daemon asking whether this socket is still there (another client left): dropped
        if op in latencies:
            latencies[op].append(time.perf_counter() - t0)
        if not r["ok"]:
            errors.append(f"{op}: {r['error']} {r['message']}")
        return r

    hello = call("HELLO", version=PROTOCOL_VERSION, pid=os.getpid(), host=platform.node())
    auth.update(session=hello["session"], token=hello["token"])
    rng = random.Random(seed)
    noise = rng.randbytes(2 * MAX_BYTES)
    mismatches = nbytes = 0
    ready.put(seed)  # connected, its session open
    start.wait()
    with open(hello["pool"]["path"], "r+b") as f, mmap.mmap(f.fileno(), 0) as pool:
        for step in range(steps):
            n = rng.randrange(1, MAX_BYTES + 1)
            # distinct per client and step, so a byte of anyone else's tensor would not compare equal
            data = (f"{seed}:{step}:".encode() + noise[rng.randrange(MAX_BYTES):])[:n]
            r = call("PUT", key=step, step=step, nbytes=len(data), dtype="uint8", shape=[len(data)], strides=[1],
                     storage_offset=0, codec="raw")
            if not r["ok"]:
                continue
            pool[r["offset"]:r["offset"] + len(data)] = data
            call("SEAL", key=step, checksum=xxhash.xxh3_64_intdigest(data))
            g = call("GET", key=step)
            back = pool[g["offset"]:g["offset"] + g["nbytes"]] if g["ok"] else b""
            if back != data or g.get("checksum") != xxhash.xxh3_64_intdigest(back):
                mismatches += 1
            call("FREE", keys=[step])
            nbytes += 2 * len(data)
    call("BYE")
    return {"mismatches": mismatches, "errors": errors, "tensors": steps, "bytes": nbytes, "latencies": latencies}


def cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """User plus system CPU seconds so far of process ``pid`` (all its threads) and of its main
    thread; None without a process."""
    if pid is None:
        return None

    def seconds(stat: str) -> float:
        fields = Path(stat).read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15
    return seconds(f"/proc/{pid}/stat"), seconds(f"/proc/{pid}/task/{pid}/stat")


def wait_ready(ready: Any, pending: list[Any]) -> None:
    """Until every client has said it is connected (its HELLO answered): the daemon's figures count
    from then on. A client that ended first (it waits for the start otherwise) raises its error here."""
    for _ in pending:
        while True:
            try:
                ready.get(timeout=0.1)
                break
            except queue.Empty:
                for p in pending:
                    if p.ready():
                        p.get()


def run(procs: int, steps: int, endpoint: str, daemon_pid: int | None = None) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no ZeroMQ state shared across fork
    manager = ctx.Manager()
    ready, start = manager.Queue(), manager.Event()
    with ctx.Pool(procs) as pool:
        pending = [pool.apply_async(client, (endpoint, seed, steps, ready, start)) for seed in range(procs)]
        wait_ready(ready, pending)  # the clock starts when all are released together
        before, cpu0 = request(endpoint, "STATUS", timeout=30)["traffic"], cpu_seconds(daemon_pid)
        t0 = time.perf_counter()
        start.set()
        results = [p.get(timeout=600) for p in pending]
        wall = time.perf_counter() - t0
        cpu1, after = cpu_seconds(daemon_pid), request(endpoint, "STATUS", timeout=30)["traffic"]
    all_lat = {op: [x for r in results for x in r["latencies"][op]] for op in ("PUT", "SEAL", "GET", "FREE")}
    every = [x for v in all_lat.values() for x in v]
    tensors = sum(r["tensors"] for r in results)
    moved = sum(r["bytes"] for r in results)
    return {
        "procs": procs, "steps_per_proc": steps, "tensor_bytes": f"uniform 1..{MAX_BYTES}",
        "tensors": tensors, "requests": len(every), "bytes_copied_in_and_out": moved, "wall_s": round(wall, 3),
        "tensors_per_s": round(tensors / wall, 1), "requests_per_s": round(len(every) / wall, 1),
        "GB_per_s": round(moved / wall / 1e9, 4),
        "latency_ms": {"all": {"p50": round(percentile(every, 0.5) * 1e3, 4),
                               "p99": round(percentile(every, 0.99) * 1e3, 4)},
                       **{op: {"p50": round(percentile(v, 0.5) * 1e3, 4), "p99": round(percentile(v, 0.99) * 1e3, 4)}
                          for op, v in all_lat.items()}},
        "daemon": daemon_cost(before, after, cpu0, cpu1),
        "mismatches": sum(r["mismatches"] for r in results),
        "errors": [e for r in results for e in r["errors"]][:20],
    }


def daemon_cost(before: dict[str, Any], after: dict[str, Any], cpu0: tuple[float, float] | None,
                cpu1: tuple[float, float] | None) -> dict[str, Any]:
    """The daemon's time per request between two STATUS replies (the BYEs and the STATUS itself
    included), and its process's and its loop thread's CPU time per request where known."""
    requests = after["requests"] - before["requests"]
    per = {"busy_us": after["busy_s"] - before["busy_s"]}
    if cpu0 is not None and cpu1 is not None:
        per.update(cpu_us=cpu1[0] - cpu0[0], loop_cpu_us=cpu1[1] - cpu0[1])
    return {"requests": requests, **{k: round(v / requests * 1e6, 2) for k, v in per.items()}}


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--socket", help="a running stormd; default: start one for the run")
    p.add_argument("--out", type=Path, help="default bench/results/load-cpu-DATE.json")
    a = p.parse_args(argv)
    today = datetime.date.today().isoformat()
    out = a.out or REPO / "bench" / "results" / f"load-cpu-{today}.json"
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--no-metrics", "--log-level", "WARNING")
        proc, endpoint = (None, a.socket) if a.socket else start_daemon(Path(tmp), "256MiB", *flags)
        try:
            result = run(a.procs, a.steps, endpoint, proc.pid if proc is not None else None)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    write(out, {"machine": machine(), **result}, "cpu")
    print(json.dumps({k: result[k] for k in ("tensors", "wall_s", "tensors_per_s", "GB_per_s", "latency_ms",
                                             "daemon", "mismatches")}, indent=1))
    return 0 if result["mismatches"] == 0 and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
