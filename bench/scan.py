"""The one-pass scan's block size and warps, timed in alternation on one machine.

Lent machines differ by up to 20% on the same kernel, so configurations are only compared
within one run: each round measures a device copy, torch.cumsum and every configuration of
``kernels.gpu.scan`` (ONE_PASS_BLOCK, the block of 32-bit sums, 64-bit ones taking half; ONE_PASS_WARPS)
on --size-mib inputs, for int32 -> int64
(torch.cumsum's promotion), int32 -> int32 (dtype=torch.int32) and float32. Reported: the
median over rounds of each as a fraction of the copy's bandwidth (input read + output written,
against the copy's read + write), and whether every output was right.

Two clocks, each applied to the copy and the scans alike: "host", the wall time of one call
between two device synchronizations (it includes the call's host work: launches, the
allocation of the output and of the scan's flags); and "device", CUDA events around --reps
calls issued back to back, so the host's work for one call overlaps the device's for the one
before, as in a stream of work (what the device itself sustains).

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

CONFIGS = ((4096, 4), (8192, 4), (16384, 4), (8192, 8))
CASES = (("int32->int64", torch.int32, None), ("int32->int32", torch.int32, torch.int32), ("float32", torch.float32, None))


def host_seconds(fn, reps: int) -> float:
    """Median wall time of one call between device synchronizations."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def device_seconds(fn, reps: int) -> float:
    """Device time per call of ``reps`` calls queued back to back (CUDA events around them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


CLOCKS = {"host": host_seconds, "device": device_seconds}


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
    default = gscan.ONE_PASS_BLOCK, gscan.ONE_PASS_WARPS
    for _ in range(a.rounds):
        for clock, seconds in CLOCKS.items():
            copy = 2 * n * 4 / seconds(lambda: x[torch.int32].clone(), a.reps)
            for name, dtype, out in CASES:
                ref = torch.cumsum(x[dtype], 0, dtype=out)
                moved = n * 4 + ref.numel() * ref.element_size()
                frac.setdefault(f"{clock} torch.cumsum {name}", []).append(
                    moved / seconds(lambda: torch.cumsum(x[dtype], 0, dtype=out), a.reps) / copy)
                for block, warps in CONFIGS:
                    gscan.ONE_PASS_BLOCK, gscan.ONE_PASS_WARPS = block, warps
                    y = associative_scan(x[dtype], 0, dtype=out)
                    if dtype == torch.int32:
                        correct &= bool(torch.equal(y, ref))
                    frac.setdefault(f"{clock} block {block} warps {warps} {name}", []).append(
                        moved / seconds(lambda: associative_scan(x[dtype], 0, dtype=out), a.reps) / copy)
    gscan.ONE_PASS_BLOCK, gscan.ONE_PASS_WARPS = default
    res = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": provenance.commit(), "command": " ".join(["python3"] + sys.argv), "size_bytes": n * 4,
           "default": {"block": default[0], "warps": default[1]},
           "integers_identical_to_cumsum": correct,
           "fraction_of_copy": {k: {"median": round(statistics.median(v), 3), "rounds": [round(f, 3) for f in v]} for k, v in frac.items()}}
    for k, v in res["fraction_of_copy"].items():
        print(f"{k:52s} {v['median']:.3f}   {' '.join(f'{f:.3f}' for f in v['rounds'])}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
