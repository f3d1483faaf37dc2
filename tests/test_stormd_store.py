"""The store's lifecycle driven through its seams: an allocator of the test's own (stormd.allocator.Allocator)
stands in for the extent allocator, so what the store takes and gives back is seen call by call."""

from __future__ import annotations

import pytest

from helpers import put_fields
from stormd.allocator import AllocatorStats
from stormd.store import Store
from stormd.store_options import ClientLimits, StoreOptions
from stormd.wire.protocol import ErrorCode, ProtocolError

ALIGN = 256


class RecordingAllocator:
    """A fake allocator: extents one after the other, never reused, at most ``capacity`` bytes live;
    it records every extent handed out and every one given back."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.taken: list[tuple[int, int]] = []  # (offset, size), in order
        self.given_back: list[int] = []
        self._live: dict[int, int] = {}
        self._next = 0

    def aligned(self, nbytes: int) -> int:
        return -(-max(nbytes, 1) // ALIGN) * ALIGN

    def alloc(self, nbytes: int) -> int | None:
        size = self.aligned(nbytes)
        if sum(self._live.values()) + size > self.capacity:
            return None
        offset, self._next = self._next, self._next + size
        self._live[offset] = size
        self.taken.append((offset, size))
        return offset

    def free(self, offset: int) -> int:
        self.given_back.append(offset)
        return self._live.pop(offset)

    def size_of(self, offset: int) -> int:
        return self._live[offset]

    def stats(self) -> AllocatorStats:
        used = sum(self._live.values())
        return AllocatorStats(self.capacity, used, used, 1, self.capacity - used, len(self._live))


def test_every_extent_the_store_takes_goes_back_once_the_tensors_and_sessions_are_gone():
    """General extents on the recorded step, one planned region per later step (the placement takes it
    from the same allocator, of the recorded step's footprint), everything given back by FREE and BYE."""
    allocator = RecordingAllocator(1 << 20)
    store = Store(allocator)
    sizes = [4096, 1000, 8192]
    for step in (1, 2, 3):
        for i, n in enumerate(sizes):
            store.put(1, put_fields(10 * step + i, n, step=step))
        store.free(1, step=step)
    footprint = store.session_stats(1)["planned_footprint"]
    assert footprint == sum(map(allocator.aligned, sizes))  # all three alive at once: no overlap possible
    assert [size for _, size in allocator.taken] == [*map(allocator.aligned, sizes), footprint, footprint]
    store.put(1, put_fields(40, 4096, step=4))
    store.put(2, put_fields(1, 512))
    assert store.drop_session(1) == 1 and store.drop_session(2) == 1
    assert sorted(allocator.given_back) == sorted(offset for offset, _ in allocator.taken)
    assert allocator.stats().used == 0


def test_a_full_allocator_is_pool_full_saying_what_it_has_left_and_why_nothing_moved():
    allocator = RecordingAllocator(8192)
    store = Store(allocator, options=StoreOptions(spill_off="spill is off here"))
    store.put(1, put_fields(1, 6000))
    with pytest.raises(ProtocolError) as refused:
        store.put(1, put_fields(2, 4096))
    assert refused.value.code == ErrorCode.POOL_FULL
    assert refused.value.message == ("no free extent of 4096 bytes (2048 bytes free, largest extent 2048); "
                                     "spill is off here")
    assert store.find(1, 2) is None and store.session_stats(1)["pool_full"] == 1
    assert store.held_bytes(1) == allocator.aligned(6000) and len(allocator.taken) == 1  # the refused PUT took nothing


def test_the_quota_counts_what_each_extent_takes_not_the_bytes_asked_for():
    """1-byte PUTs each take an extent of the alignment: counted by nbytes, a client with a 4 KiB
    quota held 256 times that in the pool."""
    allocator = RecordingAllocator(1 << 20)
    store = Store(allocator, options=StoreOptions(default_limits=ClientLimits(quota=4096)))
    stored = 0
    with pytest.raises(ProtocolError) as refused:
        for key in range(1, 4097):
            store.put(1, put_fields(key, 1))
            stored += 1
    assert refused.value.code == ErrorCode.QUOTA
    assert stored == 4096 // allocator.aligned(1) and allocator.stats().used <= 4096 == store.held_bytes(1)


def test_the_quota_counts_the_planned_region_a_session_holds_not_only_its_tensors_in_it():
    """A planned step takes a region of the recorded step's footprint at its first PUT and holds it
    while a tensor lives there: small tensors at their planned offsets hold the whole region, so a
    tensor outside it that fits the quota by the tensors' count is refused, naming the region
    (before: the session took the region and that tensor too, about twice its quota of the pool)."""
    quota = 8 * 1024
    allocator = RecordingAllocator(1 << 20)
    store = Store(allocator, options=StoreOptions(default_limits=ClientLimits(quota=quota)))
    store.put(1, put_fields(1, 4096, step=1))  # the recorded step: two 4 KiB tensors at once
    store.put(1, put_fields(2, 4096, step=1))
    store.free(1, step=1)
    store.put(1, put_fields(3, 1, step=2))  # planned: the 8 KiB region is taken
    store.put(1, put_fields(4, 1, step=2))
    with pytest.raises(ProtocolError) as refused:
        store.put(1, put_fields(5, quota - 512, step=2))  # no gap of the region takes it
    assert refused.value.code == ErrorCode.QUOTA and "planned region" in refused.value.message
    assert allocator.stats().used <= quota
    store.free(1, step=2)
    store.put(1, put_fields(6, quota - 512, step=3))  # no region held: the tensor fits the quota
    assert allocator.stats().used <= quota


def test_keys_past_max_keys_are_pool_full_whatever_room_the_pool_has():
    """Each key costs daemon memory beside its pool bytes: without a bound, 1-byte PUTs grew the
    daemon by the pool's size over 256 entries."""
    store = Store(RecordingAllocator(1 << 20), options=StoreOptions(max_keys=3))
    for key in (1, 2, 3):
        store.put(key % 2, put_fields(key, 1))  # two sessions: the bound is the daemon's
    with pytest.raises(ProtocolError) as refused:
        store.put(1, put_fields(4, 1))
    assert refused.value.code == ErrorCode.POOL_FULL and "max_keys" in refused.value.message
    assert store.session_stats(1)["pool_full"] == 1
    store.free(0, keys=[2])
    store.put(0, put_fields(4, 1))  # room again once one goes
    assert store.node_stats()["keys"] == 3
