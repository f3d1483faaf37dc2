"""The eviction policy: stormd's order (SpillOrder), and the store spilling whatever victim a policy of the
test's own (stormd.eviction.EvictionPolicy) chooses, having told it which tensors may move."""

from __future__ import annotations

from helpers import put_fields
from stormd.allocator import ExtentAllocator
from stormd.entries import Entry, Where
from stormd.eviction import SpillOrder
from stormd.store import Store
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import ProtocolError

KIB = 1024


def entry(key: int, step: int) -> Entry:
    return Entry(key, step, 0, 16, "uint8", [16], [1], 0, "raw", 16)


def test_spill_order_picks_the_lowest_priority_then_the_oldest_step_then_the_earliest_key():
    order = SpillOrder()
    order.add(1, 5, entry(1, step=1))   # a client of higher priority: last
    order.add(2, 0, entry(9, step=2))
    order.add(2, 0, entry(3, step=2))
    order.add(3, 0, entry(7, step=1))
    order.add(2, 0, entry(4, step=2))
    order.discard(2, 0, entry(4, step=2))  # fetched: no longer movable
    order.discard(2, 0, entry(5, step=2))  # never added: nothing happens
    assert len(order) == 4
    assert [order.pop_victim(1 << 20) for _ in range(5)] == [(3, 7), (2, 3), (2, 9), (1, 1), None]


def test_spill_order_passes_over_tensors_larger_than_the_spill_file_has_room_for():
    order = SpillOrder()
    big = Entry(1, 1, 0, 4096, "uint8", [4096], [1], 0, "raw", 4096)
    order.add(1, 0, big)              # first in rank, and too large
    order.add(2, 0, entry(3, step=2))
    assert order.pop_victim(1024) == (2, 3)
    assert order.pop_victim(1024) is None and len(order) == 1
    assert order.pop_victim(4096) == (1, 1)


class NewestFirst:
    """A fake policy: the tensor made movable last goes first; it keeps what it was told."""

    def __init__(self) -> None:
        self.movable: list[tuple[int, int]] = []

    def add(self, session: int, priority: int, e: Entry) -> None:
        self.movable.append((session, e.key))

    def discard(self, session: int, priority: int, e: Entry) -> None:
        if (session, e.key) in self.movable:
            self.movable.remove((session, e.key))

    def pop_victim(self, at_most: int) -> tuple[int, int] | None:
        return self.movable.pop() if self.movable else None

    def __len__(self) -> int:
        return len(self.movable)


def test_the_store_spills_the_victim_its_policy_chooses_and_tells_it_what_may_move(spill_dir):
    policy = NewestFirst()
    pool = SharedPool.anonymous(64 * KIB)
    store = Store(ExtentAllocator(pool.size), pool, StoreOptions(spill_dir=spill_dir, spill_limit=1 << 20),
                  eviction=policy)
    for key in (1, 2, 3):
        store.put(1, put_fields(key, 16 * KIB))
        store.seal(1, key, None)
    store.put(1, put_fields(4, 16 * KIB))
    assert policy.movable == [(1, 1), (1, 2), (1, 3)]  # PUT alone does not make a tensor movable
    store.get(1, 2)
    assert policy.movable == [(1, 1), (1, 3)]  # fetched: stays put until FREE
    store.seal(1, 4, None)  # the pool is full now: background spill takes the policy's victim, key 4
    store.spiller.reap(block=True)
    where = {key: store.find(1, key).where for key in (1, 2, 3, 4)}
    assert where == {1: Where.POOL, 2: Where.POOL, 3: Where.POOL, 4: Where.SPILLED}
    assert policy.movable == [(1, 1), (1, 3)]
    store.free(1, keys=[3])
    assert policy.movable == [(1, 1)]
    store.close()


def test_a_tensor_too_large_for_the_spill_file_leaves_the_smaller_ones_behind_it_free_to_spill(spill_dir):
    """The first in the spill order is larger than the spill file: a PUT that needs room spills the
    tensors behind it that fit; once none fits, the refusal says the spill file lacks room for them."""
    pool = SharedPool.anonymous(64 * KIB)
    store = Store(ExtentAllocator(pool.size), pool, StoreOptions(spill_dir=spill_dir, spill_limit=32 * KIB))
    store.open_session(1)
    store.open_session(2)
    store.put(1, put_fields(1, 40 * KIB, step=0))  # the oldest step: first to go, and too large
    store.seal(1, 1, None)
    for key in range(3):
        store.put(2, put_fields(key, 8 * KIB, step=1))
        store.seal(2, key, None)
    store.spiller.reap(block=True)
    store.put(2, put_fields(10, 8 * KIB, step=1))  # room made by spilling one of session 2's
    assert store.find(1, 1).where == Where.POOL
    assert sum(store.find(2, key).where == Where.SPILLED for key in range(3)) >= 1
    store.seal(2, 10, None)
    for key in range(11, 20):  # the spill file fills: the refusal names it
        try:
            store.put(2, put_fields(key, 8 * KIB, step=1))
        except ProtocolError as e:
            assert "larger than the spill file has room for" in str(e) or "spill file is full" in str(e), str(e)
            break
        store.seal(2, key, None)
    else:
        raise AssertionError("a 64 KiB pool and a 32 KiB spill file took 80 KiB more")
    store.close()
