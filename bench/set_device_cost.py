"""What switching the current GPU costs a plain process (cuda.bindings): cudaSetDevice to the same
device, alternating between devices, and binding their primary contexts with cuCtxSetCurrent.

    python bench/set_device_cost.py     # needs two GPUs to alternate
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from cuda.bindings import driver, runtime


def per_call_us(f: Callable[[int], object], reps: int = 2000) -> float:
    t0 = time.perf_counter()
    for k in range(reps):
        f(k)
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    n = torch.cuda.device_count()
    contexts = []
    for i in range(n):
        runtime.cudaSetDevice(i)
        runtime.cudaFree(0)  # initialises the device's primary context
        contexts.append(driver.cuCtxGetCurrent()[1])
    print("devices", n)
    print("cudaSetDevice same     us", round(per_call_us(lambda k: runtime.cudaSetDevice(0)), 2))
    print("cudaSetDevice alternate us", round(per_call_us(lambda k: runtime.cudaSetDevice(k % n)), 2))
    print("cuCtxSetCurrent alternate us", round(per_call_us(lambda k: driver.cuCtxSetCurrent(contexts[k % n])), 2))
    driver.cuCtxSetCurrent(contexts[n - 1])
    print("cudaGetDevice after binding the last context:", runtime.cudaGetDevice())


if __name__ == "__main__":
    main()
