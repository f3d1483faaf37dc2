"""Step-lifetime planning: packing quality on a real model's saved-tensor trace, and the plan
at work in the store (hits once a step has been learnt, fallbacks when a step differs)."""

from __future__ import annotations

import weakref

import torch

from helpers import put_fields
from storm.examples.models import GPT
from stormd.allocator import ExtentAllocator
from stormd.placement import Lifetime, first_fit_footprint, pack_lifetimes, peak_live_bytes
from stormd.store import Store
from stormd.wire.pool import SharedPool


class _Saved:
    """What pack returns; autograd drops it when backward no longer needs the tensor."""


def gpt_step_trace() -> list[Lifetime]:
    """Saved storages of one GPT training step on CPU, as the client would offload them (parameters
    stay, a storage saved twice is stored once), with lifetimes from save to release by autograd."""
    torch.manual_seed(0)
    model = GPT(seq_len=64, d_model=128, n_heads=4, n_layers=4, dropout=0.1)
    idx = torch.randint(0, 256, (8, 65))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    clock = [0]
    lives: list[list[int]] = []   # [size, start, end, holders] per stored storage
    current: dict[int, int] = {}  # storage address -> its index in lives while held

    def dropped(i: int) -> None:
        clock[0] += 1
        lives[i][3] -= 1
        if lives[i][3] == 0:
            lives[i][2] = clock[0]

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in params:
            return t
        clock[0] += 1
        i = current.get(ptr)
        if i is None or lives[i][3] == 0:  # a new storage (an address may be reused once freed)
            i = current[ptr] = len(lives)
            lives.append([t.untyped_storage().nbytes(), clock[0], -1, 0])
        lives[i][3] += 1
        h = _Saved()
        weakref.finalize(h, dropped, i)
        return (h, t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x[1] if isinstance(x, tuple) else x):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    del loss
    align = ExtentAllocator(1 << 30).aligned
    return [Lifetime(align(size), start, end) for size, start, end, _ in lives]


def test_plan_of_the_gpt_trace_is_within_5_percent_of_peak_live_bytes():
    trace = gpt_step_trace()
    assert len(trace) > 50 and all(t.end > t.start for t in trace)
    offsets, planned = pack_lifetimes(trace)
    peak = peak_live_bytes(trace)
    first_fit = first_fit_footprint(trace)
    for i, a in enumerate(trace):  # the plan is valid: tensors alive together never share bytes
        for j in range(i):
            b = trace[j]
            if a.start < b.end and b.start < a.end:
                assert offsets[i] + a.size <= offsets[j] or offsets[j] + b.size <= offsets[i]
    print(f"\nGPT step: {len(trace)} tensors; planned footprint {planned} bytes, using {planned} of peak live "
          f"{peak} ({planned / peak:.4f}x); first fit without planning {first_fit} ({first_fit / peak:.4f}x)")
    assert peak <= planned <= 1.05 * peak
    assert first_fit >= peak


def test_store_places_later_steps_by_the_plan_and_falls_back_when_sizes_change():
    pool = SharedPool.anonymous(1 << 20)
    store = Store(ExtentAllocator(pool.size), pool)
    store.open_session(1)
    sizes = [5000, 300, 70_000, 4096, 12_345]

    def step(n: int, sizes: list[int]) -> list[int]:
        keys = [n * 100 + i for i in range(len(sizes))]
        offs = [store.put(1, put_fields(k, size, step=n)).offset for k, size in zip(keys, sizes)]
        for k in keys:
            store.seal(1, k, None)
        for k in reversed(keys):  # backward frees in reverse
            assert store.get(1, k).nbytes == sizes[keys.index(k)]
            store.free(1, keys=[k])
        store.allocator.check()
        assert store.allocator.stats().used == 0  # the plan's region goes with the step's last tensor
        return offs

    step(1, sizes)
    assert store.session_stats(1)["plan"] == "no plan yet"  # planned when the next step begins
    second, third = step(2, sizes), step(3, sizes)
    st = store.session_stats(1)
    assert st["plan_peak_live"] == sum(map(store.allocator.aligned, sizes))
    assert st["planned_footprint"] == st["plan_peak_live"]  # a stack of saves packs perfectly
    assert st["plan"].startswith(f"using {st['planned_footprint']} of {st['plan_peak_live']}")
    assert second == third  # same sizes, same places
    assert store.session_stats(1)["plan_hits"] == 2 * len(sizes)
    step(4, [s * 2 for s in sizes])  # larger than planned: every tensor goes to the general allocator
    st = store.session_stats(1)
    assert st["plan_misses"] == len(sizes) and store.node_stats()["plan_hits"] == 2 * len(sizes)


def test_slot_still_held_by_the_previous_step_falls_back():
    pool = SharedPool.anonymous(1 << 20)
    store = Store(ExtentAllocator(pool.size), pool)
    for n in (1, 2):
        store.put(7, put_fields(n * 10, 4096, step=n))
        store.put(7, put_fields(n * 10 + 1, 4096, step=n))
        if n == 2:
            break
        store.free(7, step=1)
    assert store.session_stats(7)["plan_hits"] == 2
    store.put(7, put_fields(30, 4096, step=3))  # step 2 still holds slot 0's bytes
    assert store.session_stats(7)["plan_misses"] == 1
    store.drop_session(7)
    store.allocator.check()
    assert store.allocator.stats().used == 0


def test_a_tensor_that_misses_its_slot_takes_a_free_gap_of_the_region_in_a_tight_pool():
    """The region is the recorded step's footprint. A later step that saves other sizes (a plan
    that recomputes blocks and offloads only their inputs saves fewer, smaller tensors) used to
    send every miss to the general allocator, which a pool as tight as the footprint has no room
    in: POOL_FULL with the region mostly unused. Misses now take the region's free gaps."""
    sizes = [64 << 10] * 4
    pool = SharedPool.anonymous(sum(sizes) + (16 << 10))
    store = Store(ExtentAllocator(pool.size), pool)
    store.open_session(1)
    for n, step_sizes in enumerate([sizes, sizes, [64 << 10, 100 << 10, 30 << 10, 30 << 10]], start=1):
        keys = [n * 100 + i for i in range(len(step_sizes))]
        for k, size in zip(keys, step_sizes):
            store.put(1, put_fields(k, size, step=n))  # raises ProtocolError (POOL_FULL) where it has no room
            store.seal(1, k, None)
        for k in reversed(keys):
            store.free(1, keys=[k])
        store.allocator.check()
        assert store.allocator.stats().used == 0
    st = store.session_stats(1)
    assert st["plan_hits"] == 4 + 1 and st["plan_misses"] == 3  # step 3: slot 0 hits, the rest take gaps
