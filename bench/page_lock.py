"""How long page-locking a pool takes, in one thread or in several at once over its parts.

    python bench/page_lock.py --size 16GiB --threads 1 2 4 8 --out bench/results/page-lock-<device>-<date>-<commit>.json

stormd page-locks its whole pool (cudaHostRegister, portable) before it serves, in one call; each
embedded store does the same for its own pool in its own process. This times the same registration
of a fresh /dev/shm pool (SharedPool.create) split into equal parts registered from N threads, to
tell whether the daemon's start can take the parallelism N processes get.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from common import write
from stormd.wire.cuda import bindings, check
from stormd.wire.pool import SharedPool
from stormd.wire.sizes import format_size, parse_size


def lock_seconds(size: int, threads: int) -> float:
    """Seconds to register a fresh pool of ``size`` bytes in ``threads`` equal parts at once."""
    rt, _ = bindings()
    check(rt.cudaFree(0)[0], "cudaFree")  # the context, outside the timing
    pool = SharedPool.create(size)
    try:
        base, part = pool.address(0, 0), size // threads
        errors: list[int] = []

        def register(i: int) -> None:
            errors.append(int(rt.cudaHostRegister(base + i * part, part, rt.cudaHostRegisterPortable)[0]))

        workers = [threading.Thread(target=register, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        if any(errors):
            raise RuntimeError(f"cudaHostRegister failed: {errors}")
        for i in range(threads):
            rt.cudaHostUnregister(base + i * part)
    finally:
        pool.close()
    return round(seconds, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="16GiB")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out")
    a = p.parse_args()
    size = parse_size(a.size)
    rows = [{"threads": n, "seconds": lock_seconds(size, n)} for n in a.threads]
    for r in rows:
        rate = size / 2**30 / r["seconds"]
        print(f"{format_size(size)} in {r['threads']} threads: {r['seconds']} s ({rate:.2f} GiB/s)")
    if a.out:
        write(a.out, {"size": size, "rows": rows}, "cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
