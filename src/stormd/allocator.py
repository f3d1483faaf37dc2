"""Extent allocator for the host pool: best fit, O(log n) alloc and free, coalescing.

The pool is one contiguous segment; the allocator only does arithmetic on
offsets and never touches the memory. It may grow at its end (the embedded
store's pool grows on demand, growth.py); extents never move, and none spans
the offset where the pool grew: each growth is page-locked on its own
(cudaHostRegister), and CUDA refuses a copy whose host range runs from one
locked range into the next. Free extents
are indexed twice: by (size, offset) to find the best fit, and by offset to
merge neighbours. ``Allocator`` is what the store and the step placement need
of one, so a test can hand the store an allocator of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sortedcontainers import SortedDict, SortedList

DEFAULT_ALIGNMENT = 256  # a cache line multiple and enough for every dtype and for vector copies


@dataclass(frozen=True)
class AllocatorStats:
    capacity: int
    used: int
    peak: int
    free_extents: int
    largest_free: int
    allocations: int

    @property
    def fragmentation(self) -> float:
        """1 - largest free extent / free bytes: 0 when all free space is one extent."""
        free = self.capacity - self.used
        return 0.0 if free == 0 else 1.0 - self.largest_free / free


class Allocator(Protocol):
    capacity: int

    def aligned(self, nbytes: int) -> int:
        """The bytes an extent of ``nbytes`` takes."""

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes``, or None when none is free."""

    def free(self, offset: int) -> int:
        """Return the extent at ``offset``; returns its size."""

    def size_of(self, offset: int) -> int:
        """The size of the live extent at ``offset``."""

    def grow(self, capacity: int) -> None:
        """Add [old capacity, ``capacity``) as free space; extents already handed out stay where they are."""

    def stats(self) -> AllocatorStats: ...


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < alignment:
            raise ValueError(f"capacity {capacity} is smaller than the alignment {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._by_size: SortedList = SortedList([(self.capacity, 0)])
        self._by_offset: SortedDict = SortedDict({0: self.capacity})
        self._used: dict[int, int] = {}  # offset -> aligned size
        self._used_bytes = 0
        self._peak = 0
        self._bounds: set[int] = set()  # the capacities it grew from: no extent spans one

    def aligned(self, nbytes: int) -> int:
        """The bytes an extent of ``nbytes`` takes: rounded up to the alignment."""
        return -(-max(nbytes, 1) // self.alignment) * self.alignment

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes``, or None when none is free."""
        size = self.aligned(nbytes)
        i = self._by_size.bisect_left((size, -1))
        if i == len(self._by_size):
            return None
        free_size, offset = self._by_size.pop(i)
        del self._by_offset[offset]
        if free_size > size:
            self._insert_free(offset + size, free_size - size)
        self._used[offset] = size
        self._used_bytes += size
        self._peak = max(self._peak, self._used_bytes)
        return offset

    def free(self, offset: int) -> int:
        """Return an extent; merges it with free neighbours. Returns its size."""
        size = self._used.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not an allocated extent")
        self._used_bytes -= size
        start, end = offset, offset + size
        i = self._by_offset.bisect_left(offset)
        if i > 0 and start not in self._bounds:
            prev_off, prev_size = self._by_offset.peekitem(i - 1)
            if prev_off + prev_size == start:
                self._remove_free(prev_off, prev_size)
                start = prev_off
        nxt = None if end in self._bounds else self._by_offset.get(end)
        if nxt is not None:
            self._remove_free(end, nxt)
            end += nxt
        self._insert_free(start, end - start)
        return size

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def grow(self, capacity: int) -> None:
        """Add [old capacity, ``capacity``) as free space, a free extent of its own that no later
        free merges across (see the module's docstring); extents already handed out keep their
        offsets."""
        capacity -= capacity % self.alignment
        if capacity < self.capacity:
            raise ValueError(f"an allocator only grows: {capacity} is below its capacity {self.capacity}")
        if capacity == self.capacity:
            return
        self._bounds.add(self.capacity)
        self._insert_free(self.capacity, capacity - self.capacity)
        self.capacity = capacity

    def _insert_free(self, offset: int, size: int) -> None:
        self._by_offset[offset] = size
        self._by_size.add((size, offset))

    def _remove_free(self, offset: int, size: int) -> None:
        del self._by_offset[offset]
        self._by_size.remove((size, offset))

    def stats(self) -> AllocatorStats:
        largest = self._by_size[-1][0] if self._by_size else 0
        return AllocatorStats(self.capacity, self._used_bytes, self._peak,
                              len(self._by_offset), largest, len(self._used))

    def check(self) -> None:
        """Verify the invariants; raises AssertionError naming the first one broken.

        One pass over the extents in offset order (free extents are already sorted;
        used ones are sorted here), so checking after every operation stays cheap
        while the number of live extents is moderate."""
        by_offset, by_size = self._by_offset, self._by_size
        assert len(by_size) == len(by_offset), "the two free indexes disagree in length"
        align = self.alignment
        free_iter = iter(by_offset.items())
        used_iter = iter(sorted(self._used.items()))
        nf, nu = next(free_iter, None), next(used_iter, None)
        pos, prev_free, used_sum = 0, False, 0
        while nf is not None or nu is not None:
            is_free = nu is None or (nf is not None and nf[0] < nu[0])
            off, size = nf if is_free else nu
            assert off == pos, f"gap or overlap at offset {pos} (next extent starts at {off})"
            assert size > 0 and size % align == 0 and off % align == 0, f"misaligned extent ({off}, {size})"
            assert not any(off < b < off + size for b in self._bounds), f"extent ({off}, {size}) spans a growth"
            if is_free:
                assert not prev_free or off in self._bounds, f"free extents not coalesced at {off}"
                assert (size, off) in by_size, f"free extent ({off}, {size}) missing from the size index"
                nf = next(free_iter, None)
            else:
                used_sum += size
                nu = next(used_iter, None)
            pos, prev_free = off + size, is_free
        assert pos == self.capacity, f"extents cover {pos} bytes of {self.capacity}"
        assert self._used_bytes == used_sum, "used byte count drifted"
        assert self._peak >= self._used_bytes, "peak is below the bytes in use"
