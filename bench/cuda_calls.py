"""Host time of the CUDA runtime calls stormd's copier makes for every CUDA request, through
cuda.bindings (what stormd and the client use) and through ctypes on libcudart directly.

    python bench/cuda_calls.py --out bench/results/cuda-calls-<device>-<date>.json

Each call runs --calls times in a loop on events and a stream of this process; the figure is the
loop's wall time over the calls (microseconds), the GPU idle. What a request costs the daemon's
event loop is this times the calls it makes, plus Python; STATUS says the whole (busy_s / requests).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time
from typing import Callable

import torch

from common import write
from stormd.wire.cuda import bindings


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(min(calls, 1000)):  # warm
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return round(1e6 * (time.perf_counter() - t0) / calls, 3)


def libcudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its own, so the handles match)."""
    for path in (ctypes.util.find_library("cudart"), "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        if path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise OSError("no libcudart to load")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--out")
    a = p.parse_args()
    torch.cuda.init()
    rt, drv = bindings()
    src = torch.empty(4096, dtype=torch.uint8, device="cuda")
    dst = torch.empty(4096, dtype=torch.uint8).pin_memory()
    err, stream = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
    err, event = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
    err, ipc = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventInterprocess)
    err, context = drv.cuCtxGetCurrent()
    rt.cudaEventRecord(event, stream)
    rt.cudaEventRecord(ipc, stream)
    torch.cuda.synchronize()
    s, d, n, kind = src.data_ptr(), dst.data_ptr(), 256, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    figures = {"bindings": {
        "cudaEventQuery": per_call_us(lambda: rt.cudaEventQuery(event), a.calls),
        "cudaEventQuery (interprocess event)": per_call_us(lambda: rt.cudaEventQuery(ipc), a.calls),
        "cudaEventRecord": per_call_us(lambda: rt.cudaEventRecord(event, stream), a.calls),
        "cudaStreamWaitEvent": per_call_us(lambda: rt.cudaStreamWaitEvent(stream, event, 0), a.calls),
        "cudaMemcpyAsync 256 B to pinned host": per_call_us(lambda: rt.cudaMemcpyAsync(d, s, n, kind, stream),
                                                            a.calls // 4),
        "cuCtxSetCurrent": per_call_us(lambda: drv.cuCtxSetCurrent(context), a.calls),
        "int(err) of a reply": per_call_us(lambda: int(rt.cudaEventQuery(event)[0]), a.calls),
    }}
    torch.cuda.synchronize()
    lib = libcudart()
    ev, st = ctypes.c_void_p(int(event)), ctypes.c_void_p(int(stream))
    figures["ctypes"] = {
        "cudaEventQuery": per_call_us(lambda: lib.cudaEventQuery(ev), a.calls),
        "cudaEventRecord": per_call_us(lambda: lib.cudaEventRecord(ev, st), a.calls),
        "cudaMemcpyAsync 256 B to pinned host": per_call_us(
            lambda: lib.cudaMemcpyAsync(ctypes.c_void_p(d), ctypes.c_void_p(s), ctypes.c_size_t(n), 2, st),
            a.calls // 4),
    }
    torch.cuda.synchronize()
    for lib_name, calls in figures.items():
        for call, us in calls.items():
            print(f"{lib_name:>9}  {call:<40} {us:8.3f} us")
    if a.out:
        write(a.out, {"calls": a.calls, "us_per_call": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
