"""The pool's extent allocator under random traffic, with its invariants checked after every operation."""

from __future__ import annotations

import bisect
import random

import pytest

from stormd.allocator import ExtentAllocator


def test_fuzz_100k_operations_with_check_after_every_one():
    """100k random allocs and frees, check() after each; an independent oracle (the live extents
    sorted by offset) asserts no overlap and no lost bytes; all freed leaves one free extent."""
    rng = random.Random(42)
    a = ExtentAllocator(64 << 20, alignment=256)
    live: dict[int, int] = {}
    starts: list[int] = []  # offsets of live extents, sorted: the oracle for overlap
    failed = 0
    for _ in range(100_000):
        if live and (rng.random() < 0.5 or len(live) >= 100):
            off = starts.pop(rng.randrange(len(starts)))
            assert a.free(off) == live.pop(off)
        else:
            n = rng.choice([1, 255, 256, 257, 4096, rng.randrange(1, 1 << 20), rng.randrange(1, 4 << 20)])
            off = a.alloc(n)
            if off is None:
                failed += 1
                assert a.stats().largest_free < n, "alloc failed although a large enough extent is free"
            else:
                assert off % 256 == 0 and a.size_of(off) >= n
                i = bisect.bisect_left(starts, off)
                assert i == 0 or starts[i - 1] + live[starts[i - 1]] <= off, "overlaps the extent before it"
                assert i == len(starts) or off + a.size_of(off) <= starts[i], "overlaps the extent after it"
                starts.insert(i, off)
                live[off] = a.size_of(off)
        a.check()
        assert a.stats().used == sum(live.values()), "bytes lost or double counted"
    assert failed > 0, "the fuzz never filled the pool, so the full-pool path went untested"
    for off in list(live):
        a.free(off)
        a.check()
    st = a.stats()
    assert st.used == 0 and st.free_extents == 1 and st.largest_free == a.capacity
    assert st.fragmentation == 0.0


def test_check_catches_a_corrupted_index():
    a = ExtentAllocator(1 << 20)
    off = a.alloc(4096)
    a._used[off] += 256  # an extent that now overlaps the free space after it
    with pytest.raises(AssertionError, match="gap or overlap|used byte count"):
        a.check()


def test_full_pool_returns_none_and_recovers():
    a = ExtentAllocator(4096, alignment=256)
    offs = [a.alloc(1024) for _ in range(4)]
    assert None not in offs and a.alloc(1) is None
    a.free(offs[1])
    a.free(offs[2])
    assert a.alloc(2048) == offs[1]  # the two freed neighbours were merged
    a.check()


def test_errors():
    a = ExtentAllocator(4096)
    with pytest.raises(KeyError):
        a.free(256)
    with pytest.raises(ValueError):
        ExtentAllocator(4096, alignment=100)
    with pytest.raises(ValueError):
        ExtentAllocator(10, alignment=256)


def test_grow_adds_free_space_at_the_end_that_no_extent_spans_and_moves_nothing():
    """Each growth of the pool is page-locked on its own, and CUDA refuses a copy whose host range
    runs from one locked range into the next (on a lent H100, once a free tail merged with the new
    space: cudaMemcpyAsync, cudaErrorInvalidValue). So the old end stays a border."""
    a = ExtentAllocator(4096, alignment=256)
    kept = a.alloc(1024)
    tail = a.alloc(3072)
    a.free(tail)  # a free extent ends at the old capacity
    a.grow(8192)
    a.check()
    assert a.capacity == 8192 and a.size_of(kept) == 1024
    assert a.alloc(7168) is None  # the free tail and the new bytes are not one extent
    assert a.alloc(4096) == 4096 and a.alloc(3072) == 1024
    a.check()
    for off in (4096, 1024, kept):  # freed neighbours merge, but not across the border
        a.free(off)
        a.check()
    assert a.stats().free_extents == 2 and a.stats().largest_free == 4096
    with pytest.raises(ValueError, match="only grows"):
        a.grow(4096)


def test_fuzz_with_growths_no_extent_ever_spans_where_the_pool_grew():
    rng = random.Random(7)
    a = ExtentAllocator(1 << 20, alignment=256)
    live: list[int] = []
    for i in range(20_000):
        if i % 2_000 == 1_999:
            a.grow(a.capacity + rng.choice([256, 4096, 1 << 20]))
        elif live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        elif (off := a.alloc(rng.randrange(1, 256 << 10))) is not None:
            live.append(off)
        a.check()  # asserts that no extent spans a growth's border
    for off in live:
        a.free(off)
    a.check()
    assert a.stats().free_extents == 11  # the first pool and each growth: one free extent each
