"""Host pool figures on this machine: pool start-up time and hot-path alloc/free latency.

    python bench/pool.py [--pool-size 1GiB] [--out bench/results/pool-cpu-DATE.json]

Start-up: SharedPool.create (posix_fallocate of the /dev/shm segment, then mmap), the
same call stormd makes once. Hot path: the allocator's alloc + free pair and the store's
PUT + SEAL + GET + FREE of one small tensor, with and without a step plan, timed in a
loop on a pool already holding a realistic number of live extents.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from common import write
from stormd.allocator import ExtentAllocator
from stormd.store import Store
from stormd.wire.pool import SharedPool
from stormd.wire.sizes import parse_size


def _put(key: int, nbytes: int, step: int) -> dict:
    return {"key": key, "step": step, "nbytes": nbytes, "dtype": "uint8", "shape": [nbytes], "strides": [1],
            "storage_offset": 0, "codec": "raw"}


def startup(size: int, directory: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool = SharedPool.create(size, directory)
        times.append(time.perf_counter() - t0)
        pool.close()
    return times


def alloc_free_us(live: int, n: int) -> dict[str, float]:
    """alloc + free of one extent next to ``live`` others of mixed sizes (microseconds per op)."""
    rng = random.Random(0)
    a = ExtentAllocator(1 << 44)  # arithmetic only: no memory behind it
    placed = [a.alloc(rng.randrange(1, 64 << 20)) for _ in range(2 * live)]
    for off in placed[::2]:  # every other one freed: ``live`` free holes and ``live`` used extents
        a.free(off)
    sizes = [rng.randrange(1, 16 << 20) for _ in range(n)]
    t_alloc = t_free = 0.0
    for s in sizes:
        t0 = time.perf_counter()
        off = a.alloc(s)
        t1 = time.perf_counter()
        a.free(off)
        t_free += time.perf_counter() - t1
        t_alloc += t1 - t0
    return {"alloc_us": 1e6 * t_alloc / n, "free_us": 1e6 * t_free / n}


def store_step_us(tensors: int, steps: int) -> dict[str, float]:
    """PUT + SEAL + GET + FREE per tensor through the store, a step at a time (microseconds per tensor).
    The first step is learnt; the rest are placed by the plan."""
    pool = SharedPool.anonymous(1 << 30)
    store = Store(ExtentAllocator(pool.size), pool)
    store.open_session(1)
    rng = random.Random(1)
    sizes = [rng.randrange(1 << 10, 1 << 20) for _ in range(tensors)]
    per_step = []
    for step in range(1, steps + 1):
        keys = range(step * tensors, (step + 1) * tensors)
        t0 = time.perf_counter()
        for k, s in zip(keys, sizes):
            store.put(1, _put(k, s, step))
            store.seal(1, k, None)
        for k in reversed(keys):
            store.get(1, k)
            store.free(1, keys=[k])
        per_step.append(time.perf_counter() - t0)
    st = store.session_stats(1)
    return {"tensors_per_step": tensors,
            "first_step_us_per_tensor": 1e6 * per_step[0] / tensors,
            "second_step_ms_including_planning": 1e3 * per_step[1],
            "planned_step_us_per_tensor": 1e6 * sum(per_step[2:]) / ((steps - 2) * tensors),
            "plan_hits": st["plan_hits"], "plan_misses": st["plan_misses"], "plan": st["plan"]}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-size", default="1GiB")
    p.add_argument("--pool-dir", default="/dev/shm")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    size = parse_size(a.pool_size)
    boot = startup(size, a.pool_dir, 3)
    result = {
        "machine": {"host": platform.node(), "cpu": _cpu_model(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "pool_startup_s": {"pool_bytes": size, "min": min(boot), "all": boot},
        "allocator": {f"live_{n}": alloc_free_us(n, 20_000) for n in (10, 100, 1000)},
        "store_put_seal_get_free": store_step_us(300, 20),
    }
    print(json.dumps(result, indent=2))
    if a.out:
        write(a.out, result, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
