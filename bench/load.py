"""Load on stormd's CPU path: N client processes x S steps of PUT / copy in / SEAL / GET / copy out
and compare / FREE, with random tensor sizes; every byte fetched is compared with what was stored.

    python bench/load.py                                  # 8 x 2000, writes bench/results/load-cpu-DATE.json
    python bench/load.py --procs 2 --steps 100 --out /tmp/x.json
    python bench/load.py --socket ipc:///run/stormd/stormd.sock   # a running daemon instead of a fresh one

Clients speak the protocol directly (no torch), so the figures are the daemon's and the socket's,
not autograd's. Throughput counts the tensors stored and the bytes copied in plus out, over the wall
time of the whole run; latency is one request's round trip, seen by the client.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xxhash
import zmq

from common import REPO, percentile, start_daemon, write
from stormd.wire.protocol import PROTOCOL_VERSION, pack, unpack

MAX_BYTES = 1 << 16


def client(endpoint: str, seed: int, steps: int, start: Any) -> dict[str, Any]:
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


def run(procs: int, steps: int, endpoint: str) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no ZeroMQ state shared across fork
    start = ctx.Manager().Event()
    with ctx.Pool(procs) as pool:
        pending = [pool.apply_async(client, (endpoint, seed, steps, start)) for seed in range(procs)]
        time.sleep(0.5)  # let them connect; the clock starts when all are released together
        t0 = time.perf_counter()
        start.set()
        results = [p.get(timeout=600) for p in pending]
        wall = time.perf_counter() - t0
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
        "mismatches": sum(r["mismatches"] for r in results),
        "errors": [e for r in results for e in r["errors"]][:20],
    }


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
            result = run(a.procs, a.steps, endpoint)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    write(out, {"machine": machine(), **result}, "cpu")
    print(json.dumps({k: result[k] for k in ("tensors", "wall_s", "tensors_per_s", "GB_per_s", "latency_ms",
                                             "mismatches")}, indent=1))
    return 0 if result["mismatches"] == 0 and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
