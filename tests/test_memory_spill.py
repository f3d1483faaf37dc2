"""Budgets: spill to disk and back when the pool is full, POOL_FULL when spill is off or full,
per-client quotas and priorities, and training through a daemon whose pool holds a quarter of a step."""

from __future__ import annotations

import copy

import pytest
import torch

import storm
from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from storm.examples.models import GPT, same_bits
from stormd.allocator import ExtentAllocator
from stormd.entries import Where
from stormd.store import Store
from stormd.store_options import ClientLimits, StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import ErrorCode, ProtocolError

KIB = 1024


def store_with(pool_bytes: int, **options) -> Store:
    pool = SharedPool.anonymous(pool_bytes)
    return Store(ExtentAllocator(pool.size), pool, StoreOptions(**options))


def put_sealed(store: Store, session: int, key: int, nbytes: int, step: int = 1) -> None:
    e = store.put(session, put_fields(key, nbytes, step=step))
    store.pool.view(e.offset, nbytes).fill_(key % 251)  # the client's copy
    store.seal(session, key, None)


def test_full_pool_spills_the_earliest_saves_and_reads_them_back_intact(spill_dir):
    store = store_with(64 * KIB, spill_dir=spill_dir, spill_limit=1 << 20)
    store.open_session(1)
    for key in range(1, 9):  # 128 KiB into a 64 KiB pool
        put_sealed(store, 1, key, 16 * KIB)
        store.allocator.check()
    node = store.node_stats()
    assert node["spilled_total"] >= 4 * 16 * KIB and node["used"] <= 64 * KIB
    assert store.session_stats(1)["spilled_bytes"] == node["spilled_bytes"] > 0
    assert store.find(1, 1).offset is None  # the first saved went first
    for key in range(8, 0, -1):  # backward: latest first
        e = store.get(1, key)
        assert e.offset is not None
        assert torch.all(store.pool.view(e.offset, 16 * KIB) == key % 251), f"key {key} came back changed"
        store.free(1, keys=[key])
        store.allocator.check()
    node = store.node_stats()
    assert node["read_back_total"] == node["spilled_total"] and node["prefetched"] > 0
    assert node["used"] == 0 and node["spilled_bytes"] == 0 and store.spiller.file.space.stats().used == 0
    store.close()


def test_fetched_tensors_are_never_moved(spill_dir):
    store = store_with(64 * KIB, spill_dir=spill_dir, spill_limit=1 << 20)
    for key in (1, 2, 3, 4):
        put_sealed(store, 1, key, 16 * KIB)
    store.spiller.reap(block=True)  # the background spill that the full pool started has finished
    offsets = {k: store.get(1, k).offset for k in (1, 2, 3, 4)}  # the client may be reading these now
    assert store.allocator.stats().used == 64 * KIB
    with pytest.raises(ProtocolError) as err:
        store.put(1, put_fields(5, 16 * KIB))  # only fetched tensors left: nothing may move
    assert err.value.code == ErrorCode.POOL_FULL and "prefetch_bytes" in err.value.message
    assert {k: store.get(1, k).offset for k in (1, 2, 3, 4)} == offsets
    store.close()


def test_spill_off_or_full_is_pool_full_with_the_fix(spill_dir):
    off = store_with(64 * KIB)
    for key in range(1, 5):
        put_sealed(off, 1, key, 16 * KIB)
    with pytest.raises(ProtocolError) as err:
        off.put(1, put_fields(9, 16 * KIB))
    assert err.value.code == ErrorCode.POOL_FULL and "spill is off" in err.value.message
    small = store_with(64 * KIB, spill_dir=spill_dir, spill_limit=32 * KIB)
    for key in range(1, 7):
        put_sealed(small, 1, key, 16 * KIB)
    with pytest.raises(ProtocolError) as err:
        small.put(1, put_fields(9, 16 * KIB))
    assert err.value.code == ErrorCode.POOL_FULL and "spill_limit" in err.value.message
    assert small.session_stats(1)["pool_full"] == 1
    small.close()


def test_quota_and_priority_come_from_the_client_name(spill_dir):
    store = store_with(64 * KIB, spill_dir=spill_dir, spill_limit=1 << 20,
                       default_limits=ClientLimits(quota=40 * KIB, priority=0),
                       clients={"big": ClientLimits(quota=0, priority=5)})
    store.open_session(1, "big")
    store.open_session(2)
    put_sealed(store, 2, 1, 16 * KIB)
    put_sealed(store, 2, 2, 16 * KIB)
    with pytest.raises(ProtocolError) as err:
        store.put(2, put_fields(3, 16 * KIB))
    assert err.value.code == ErrorCode.QUOTA and "client_quota" in err.value.message
    assert store.session_stats(2)["quota_refused"] == 1
    for key in range(1, 4):
        put_sealed(store, 1, key, 16 * KIB)  # the pool is full now: the low-priority client spills first
    store.spiller.reap(block=True)
    assert store.session_stats(2)["spilled_bytes"] >= 16 * KIB and store.session_stats(1)["spilled_bytes"] == 0
    st = store.session_stats(1)
    assert (st["name"], st["quota"], st["priority"]) == ("big", 0, 5)
    store.drop_session(1)
    store.drop_session(2)
    assert store.node_stats()["used"] == 0 and store.spiller.file.space.stats().used == 0
    store.close()


def test_a_session_s_spilled_tensors_take_of_the_spill_file_what_its_quota_counts(spill_dir):
    """A session of one-byte tensors at its quota (each charged a pool extent) spills them all: they
    take as much of the spill file, which every session shares, and no more, so a trainer without a
    quota still finds spill room (before: each took a page of the file, 16 times its charge)."""
    quota = 16 * KIB
    store = store_with(64 * KIB, spill_dir=spill_dir, spill_limit=256 * KIB,
                       clients={"small": ClientLimits(quota=quota)})
    store.open_session(1, "small")
    store.open_session(2)
    for key in range(64):  # 64 extents of the pool's alignment: the quota
        put_sealed(store, 1, key, 1, step=0)
    assert store.held_bytes(1) == quota
    for key in range(12):  # 192 KiB through a 64 KiB pool
        put_sealed(store, 2, key, 16 * KIB)
    store.spiller.reap(block=True)
    assert all(store.find(1, key).where == Where.SPILLED for key in range(64))
    assert store.spiller.file.space.stats().used <= quota + store.held_bytes(2)
    store.close()


def step_grads(model, idx, opts):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    if opts is None:
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    else:
        with storm.offload(**opts) as ctx:
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        ctx.synchronize()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], (None if opts is None else ctx.stats)


def test_training_with_the_pool_at_a_quarter_of_a_step_spills_and_stays_bit_exact(tmp_path, spill_dir):
    torch.manual_seed(0)
    # Many layers of small tensors: the largest saved tensor is a few percent of a quarter-step pool.
    model = GPT(seq_len=32, d_model=64, n_heads=4, n_layers=8, dropout=0.1)
    idx = torch.randint(0, 256, (4, 33))
    _, measured = step_grads(copy.deepcopy(model), idx, {"mode": "embedded", "min_bytes": 0})
    step_bytes = measured.offloaded_bytes
    pool = step_bytes // 4
    d = start_daemon(tmp_path, "--pool-size", str(pool), "--spill", "--spill-dir", spill_dir,
                     "--spill-limit", str(4 * step_bytes), "--no-metrics")
    try:
        # Fetched tensors stay put until freed, so the prefetch window and the copies in flight
        # must fit in the pool next to each other.
        opts = {"mode": "daemon", "socket": d.endpoint, "min_bytes": 0,
                "prefetch_bytes": pool // 8, "max_held_bytes": pool // 8}
        plain, offloaded = copy.deepcopy(model), copy.deepcopy(model)
        for _ in range(2):  # the second step also runs with a learnt plan
            want, _ = step_grads(plain, idx, None)
            got, stats = step_grads(offloaded, idx, opts)
            for (name, _), a, b in zip(model.named_parameters(), want, got):
                assert same_bits(a, b), f"gradient of {name} differs with offload through a spilling daemon"
            assert stats.offloaded_bytes > 2 * pool, stats  # far more than the pool went through the store
        storm.close_all()  # BYE: the session's last keys are freed
        c = RawClient(d.endpoint)
        c.hello()
        node = c.call("STATS")["node"]
        c.close()
        print(f"\npool {pool} bytes for a step of {step_bytes}: spilled {node['spilled_total']}, read back "
              f"{node['read_back_total']} ({node['prefetched']} prefetched, {node['read_back_on_get']} on GET)")
        assert node["spilled_total"] > step_bytes // 2 and node["read_back_total"] > 0
        assert node["used"] == 0 and node["spilled_bytes"] == 0
    finally:
        storm.close_all()
        stop_daemon(d)
    assert d.proc.returncode == 0, d.output()
