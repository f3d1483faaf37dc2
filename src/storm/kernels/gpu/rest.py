"""Work buffers the kernels leave as they found them, kept for the next call on the same stream.

Some kernels need memory in a known state before they start: counters that hand out
tickets, look-back words, counts added by atomics. A zeroed allocation for each call costs
the host time ahead of the first kernel (a fill launch, and views carved out of it), time
the device waits. So the kernels that use such a buffer put it back
in that state as they finish with it, and the buffer is kept for the next call on the same
stream, whose kernels run after them: the state is there when they start (the frame encoder's
scratch: its dictionary's histogram and count; its first launch sets up the rest). A buffer goes
back into the pool only when the caller's block ends normally, once every kernel that
uses it is queued; a call cut short drops it.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Generic, Iterator, TypeVar

import torch

from . import current_stream

T = TypeVar("T")


def _queue(device: torch.device) -> tuple:
    """The queue kernels launched now go to: the current stream of a CUDA device, or the CPU
    (TRITON_INTERPRET), which runs each kernel as it is launched."""
    if device.type != "cuda":
        return (device.type,)
    index = torch.cuda.current_device() if device.index is None else device.index
    return device.type, index, current_stream(index)


class AtRest(Generic[T]):
    """A pool, per stream, of buffers at rest. ``make(device, size)`` allocates one (in its state
    at rest) that holds ``size`` (``size_of`` of one says how much it holds); ``kept`` are kept
    a stream (more than one: threads may share a stream)."""

    def __init__(self, make: Callable[[torch.device, int], T], size_of: Callable[[T], int], kept: int = 2) -> None:
        self.make, self.size_of, self.kept = make, size_of, kept
        self.pools: dict[tuple, list[T]] = {}

    @contextlib.contextmanager
    def take(self, device: torch.device, size: int) -> Iterator[T]:
        """A buffer at rest holding at least ``size``, for kernels queued on the current stream."""
        rest = self.pools.setdefault(_queue(device), [])
        buf = None
        while rest and buf is None:
            buf = rest.pop()
            if self.size_of(buf) < size:
                buf = None  # too small: dropped (the allocator reuses it only in this stream's order)
        if buf is None:
            buf = self.make(device, size)
        yield buf
        if len(rest) < self.kept:
            rest.append(buf)
