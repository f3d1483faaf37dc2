"""The one-pass scan's block size and warps, timed in alternation on one machine.

Lent machines differ by up to 20% on the same kernel, so configurations are only compared
within one run: each round measures a device copy, torch.cumsum and every configuration of
``kernels.gpu.scan`` (ONE_PASS_BLOCK, ONE_PASS_WARPS) on --size-mib inputs, for int32 -> int64
(torch.cumsum's promotion), int32 -> int32 (dtype=torch.int32) and float32. Reported: the
median over rounds of each as a fraction of the copy's bandwidth (input read + output written,
against the copy's read + write), and whether every output was right.

    python bench/scan.py --rounds 5 --out bench/results/scan-sweep-h100-DATE.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import provenance
import storm.kernels.gpu.scan as gscan
from storm.kernels import associative_scan

CONFIGS = ((8192, 4), (8192, 8), (4096, 4), (16384, 8))
CASES = (("int32->int64", torch.int32, None), ("int32->int32", torch.int32, torch.int32), ("float32", torch.float32, None))


def seconds(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    n = (a.size_mib << 20) // 4
    x = {torch.int32: torch.randint(-50, 50, (n,), device="cuda", dtype=torch.int32)}
    x[torch.float32] = x[torch.int32].float()
    frac: dict[str, list[float]] = {}
    correct = True
    for _ in range(a.rounds):
        copy = 2 * n * 4 / seconds(lambda: x[torch.int32].clone(), a.reps)
        for name, dtype, out in CASES:
            ref = torch.cumsum(x[dtype], 0, dtype=out)
            moved = n * 4 + ref.numel() * ref.element_size()
            frac.setdefault(f"torch.cumsum {name}", []).append(moved / seconds(lambda: torch.cumsum(x[dtype], 0, dtype=out), a.reps) / copy)
            for block, warps in CONFIGS:
                gscan.ONE_PASS_BLOCK, gscan.ONE_PASS_WARPS = block, warps
                y = associative_scan(x[dtype], 0, dtype=out)
                if dtype == torch.int32:
                    correct &= bool(torch.equal(y, ref))
                frac.setdefault(f"block {block} warps {warps} {name}", []).append(
                    moved / seconds(lambda: associative_scan(x[dtype], 0, dtype=out), a.reps) / copy)
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": provenance.commit(), "command": " ".join(["python3"] + sys.argv), "size_bytes": n * 4,
           "integers_identical_to_cumsum": correct,
           "fraction_of_copy": {k: {"median": round(statistics.median(v), 3), "rounds": [round(f, 3) for f in v]} for k, v in frac.items()}}
    for k, v in res["fraction_of_copy"].items():
        print(f"{k:36s} {v['median']:.3f}   {' '.join(f'{f:.3f}' for f in v['rounds'])}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
