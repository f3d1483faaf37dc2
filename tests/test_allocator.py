"""The pool's extent allocator under random traffic, with its invariants checked after every operation."""

from __future__ import annotations

import random

import pytest

from stormd.allocator import ExtentAllocator


def test_fuzz_100k_operations_keep_invariants():
    rng = random.Random(42)
    a = ExtentAllocator(64 << 20, alignment=256)
    live: dict[int, int] = {}
    for i in range(100_000):
        if live and (rng.random() < 0.5 or len(live) > 200):
            off = rng.choice(list(live))
            assert a.free(off) == live.pop(off)
        else:
            n = rng.choice([1, 255, 256, 257, 4096, rng.randrange(1, 1 << 20)])
            off = a.alloc(n)
            if off is not None:
                assert off % 256 == 0
                for o, s in live.items():  # no overlap with anything live
                    assert off + n <= o or o + s <= off
                live[off] = a.size_of(off)
        if i % 10 == 0 or len(live) < 3:
            a.check()
    for off in list(live):
        a.free(off)
    a.check()
    st = a.stats()
    assert st.used == 0 and st.free_extents == 1 and st.largest_free == a.capacity
    assert st.fragmentation == 0.0


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
