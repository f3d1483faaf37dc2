"""No two live pool extents overlap, whatever the step planner did: the sequence that made a planned
slot land past its region onto another session's tensor."""

from __future__ import annotations

from stormd.allocator import ExtentAllocator
from stormd.pool import SharedPool
from stormd.store import Store
from tests.helpers import put_fields

A, B = 1, 2


def write(store: Store, session: int, key: int, value: int) -> None:
    e = store.find(session, key)
    store.pool.view(e.offset, e.nbytes).fill_(value)


def test_planned_slot_never_lands_past_its_region_onto_another_sessions_extent():
    """The issue's sequence: A's small plan keeps its region because one planned tensor stays alive,
    B takes the extent right after that region, A learns a larger step and is planned again. On main
    A's second slot was placed past the old region's end, over B's sealed tensor, and A's write
    changed B's bytes."""
    store = Store(ExtentAllocator(1 << 20), SharedPool.anonymous(1 << 20))  # as stormd runs: no ledger
    small, large = 4096, 8192
    store.put(A, put_fields(10, small, step=1))  # step 1: one small tensor, the recorded step
    store.free(A, step=1)
    store.put(A, put_fields(20, small, step=2))  # planned: the region of step 1's footprint is taken
    store.put(A, put_fields(21, small, step=2))  # two slots the plan does not have: misses
    store.put(A, put_fields(22, small, step=2))
    assert store.session_stats(A)["plan_hits"] == 1 and store.session_stats(A)["plan_misses"] == 2
    region = store.find(A, 20).offset
    store.free(A, keys=[21, 22])  # key 20 stays alive (its graph was kept), so does the region
    store.put(B, put_fields(1, 4 * large))  # right after A's region
    assert store.find(B, 1).offset == region + small
    write(store, B, 1, 0xBB)
    store.seal(B, 1, None)
    for k in (30, 31):  # step 3 (the plan was dropped: more misses than hits): two large tensors
        store.put(A, put_fields(k, large, step=3))
    store.free(A, step=3)
    store.put(A, put_fields(40, large, step=4))  # planned again; slot 0 is still held by key 20
    store.put(A, put_fields(41, large, step=4))  # slot 1's planned offset lies past the old region
    write(store, A, 41, 0xAA)
    b = store.find(B, 1)
    assert bool((store.pool.view(b.offset, b.nbytes) == 0xBB).all()), "A's write changed B's stored bytes"
    a = store.find(A, 41)
    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    store.drop_session(A)
    store.drop_session(B)
    store.allocator.check()
    assert store.allocator.stats().used == 0
