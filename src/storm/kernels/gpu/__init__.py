"""Triton kernels for CUDA tensors. Imported lazily: the CPU package never needs Triton.

Set STORM_KERNELS_NO_TRITON=1 to force the torch-op path on CUDA (the tests use
it to check that both GPU paths produce the same bytes).

The atomics in these kernels are ``sem="relaxed"`` where each one is a ticket, a count or an
OR whose value is all that is read (within a launch: the look-back's words carry their values;
across launches: stream order). Triton's default, acq_rel, puts a MEMBAR.ALL.GPU (the thread waits
for its stores) before each and a CCTL.IVALL after, which empties the SM's L1 under every program
on it. Only the frame dictionary's (a few programs once an encode) keep acq_rel: there the last
program to count itself done reads the histogram the others added to.
"""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    if os.environ.get("STORM_KERNELS_NO_TRITON") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` lives on CUDA and the Triton kernels can run there."""
    return t.is_cuda and triton_available()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grid sizes: ``triton.cdiv`` is a jit function, and calling one
    from Python costs about as much host time as a launch, on a small tensor's encode's path."""
    return -(-a // b)


def current_stream(index: int) -> int:
    """The handle of device ``index``'s current CUDA stream, read as Triton's launcher reads it:
    torch.cuda.current_stream builds a Stream object, host time on every call that the raw handle saves."""
    return torch._C._cuda_getCurrentRawStream(index)
