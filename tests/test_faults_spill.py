"""Issue 38, item 3: spill I/O that fails as disks do (full, unreadable) costs the tensors it
touches at most, never the daemon or other sessions: a failed write leaves its tensor in the pool,
a failed read-back fails that key's GET only, BYE always frees, and the server keeps serving."""

from __future__ import annotations

import asyncio
import errno
import logging
import os

import pytest
import pytest_asyncio
import torch
import zmq
from test_server_async import AsyncClient

from helpers import put_fields
from stormd.allocator import ExtentAllocator
from stormd.config import DaemonConfig
from stormd.entries import Where
from stormd.server import Server
from stormd.service import Service
from stormd.spill import SpillIO
from stormd.store import Store
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import ErrorCode, ProtocolError, pack

KIB = 1024
SESSION_END_DEADLINE = 60.0  # seconds; only a daemon that stopped serving comes near it


class FailingDisk(SpillIO):
    """The real file, but writes fail with ENOSPC while ``full`` and reads of ``bad`` offsets with EIO."""

    def __init__(self) -> None:
        self.full = False
        self.bad: set[int] = set()

    def write(self, fd: int, src: torch.Tensor, where: int) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write(fd, src, where)

    def read(self, fd: int, dst: torch.Tensor, where: int) -> None:
        if where in self.bad:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().read(fd, dst, where)


def store_on(disk: FailingDisk, spill_dir: str, pool_bytes: int = 64 * KIB) -> Store:
    pool = SharedPool.anonymous(pool_bytes)
    options = StoreOptions(spill_dir=spill_dir, spill_limit=1 << 20, spill_io=disk)
    return Store(ExtentAllocator(pool.size), pool, options)


def put_sealed(store: Store, session: int, key: int, nbytes: int = 16 * KIB) -> None:
    e = store.put(session, put_fields(key, nbytes))
    store.pool.view(e.offset, nbytes).fill_(key)
    store.seal(session, key, None)


def intact(store: Store, session: int, key: int, nbytes: int = 16 * KIB) -> bool:
    e = store.get(session, key)
    return bool(torch.all(store.pool.view(e.offset, nbytes) == key))


def test_a_failed_spill_write_keeps_the_tensor_in_the_pool_logs_once_and_refuses_the_put_saying_why(
        spill_dir, caplog):
    disk = FailingDisk()
    store = store_on(disk, spill_dir)
    disk.full = True
    caplog.set_level(logging.WARNING, logger="stormd")
    for key in range(1, 5):  # fills the pool: background spill tries, and fails, from the fourth
        put_sealed(store, 1, key)
    for key in (5, 6, 7):  # each needs room that only a spill could make
        with pytest.raises(ProtocolError) as err:
            store.put(1, put_fields(key, 16 * KIB))
        assert err.value.code == ErrorCode.POOL_FULL
        assert spill_dir in err.value.message and "No space left on device" in err.value.message
    assert all(store.find(1, key).where == Where.POOL and store.find(1, key).io is None for key in range(1, 5))
    assert store.spiller.file.space.stats().used == 0  # the failed writes' file space was given back
    assert store.node_stats()["spill_write_errors"] >= 3
    failed = [r for r in caplog.records if "spill write failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].spill_dir == spill_dir  # once, not per write
    assert all(intact(store, 1, key) for key in range(1, 5))  # GET never raised: every byte still there
    store.free(1, keys=[1, 2, 3, 4])
    for key in range(1, 5):
        put_sealed(store, 1, key)
    disk.full = False  # room on the disk again: the next PUT that needs room spills, and spill resumes
    put_sealed(store, 1, 5)
    assert store.node_stats()["spilled_total"] > 0 and store.spiller.failure is None
    assert any("spill writes succeed again" in r.getMessage() for r in caplog.records)
    for key in range(5, 0, -1):  # backward: fetched tensors stay put until freed
        assert intact(store, 1, key)
        store.free(1, keys=[key])
    assert store.node_stats()["used"] == 0 and store.spiller.file.space.stats().used == 0
    store.close()


def test_a_failed_read_back_fails_that_keys_get_only(spill_dir):
    disk = FailingDisk()
    store = store_on(disk, spill_dir)
    for key in range(1, 7):  # 96 KiB into 64: the earliest saved go to the file
        put_sealed(store, 1, key)
    put_sealed(store, 2, 1, 4 * KIB)  # another session, in the pool
    store.spiller.reap(block=True)
    spilled = [e for e in (store.find(1, key) for key in range(1, 7)) if e.where == Where.SPILLED]
    assert len(spilled) >= 2
    bad = spilled[0]
    disk.bad.add(bad.file_offset)
    with pytest.raises(ProtocolError) as err:
        store.get(1, bad.key)
    assert err.value.code == ErrorCode.SPILL_FAILED
    assert f"key {bad.key}" in err.value.message and "lost" in err.value.message
    assert spill_dir in err.value.message and "Input/output error" in err.value.message
    with pytest.raises(ProtocolError) as again:  # it stays lost (no second read of a bad place)
        store.get(1, bad.key)
    assert again.value.code == ErrorCode.SPILL_FAILED
    for key in range(6, 0, -1):
        if key != bad.key:
            assert intact(store, 1, key)
            store.free(1, keys=[key])
    assert intact(store, 2, 1, 4 * KIB)
    assert store.node_stats()["spill_read_errors"] == 1
    assert store.free(1) == 1 and store.free(2) == 1  # the lost key is freed like any other
    assert store.node_stats()["used"] == 0 and store.spiller.file.space.stats().used == 0
    store.close()


def test_a_spill_file_cut_short_loses_the_spilled_keys_only_and_the_store_goes_on(spill_dir):
    store = store_on(FailingDisk(), spill_dir)  # a disk that works: the file itself is cut short
    for key in range(1, 7):
        put_sealed(store, 1, key)
    store.spiller.reap(block=True)
    spilled = {key for key in range(1, 7) if store.find(1, key).where == Where.SPILLED}
    assert spilled
    os.ftruncate(store.spiller.file.fd, 0)
    for key in range(6, 0, -1):
        if key in spilled:
            with pytest.raises(ProtocolError) as err:
                store.get(1, key)
            assert err.value.code == ErrorCode.SPILL_FAILED and "spill file ended" in err.value.message
        else:
            assert intact(store, 1, key)
        store.free(1, keys=[key])
    assert store.node_stats()["spill_read_errors"] == len(spilled)
    for key in range(1, 7):  # the file takes writes again (it grows back), and reads them back intact
        put_sealed(store, 1, key)
    for key in range(6, 0, -1):
        assert intact(store, 1, key)
        store.free(1, keys=[key])
    assert store.node_stats()["spilled_total"] > 0 and store.node_stats()["used"] == 0
    store.close()


@pytest_asyncio.fixture
async def full_disk_server(tmp_path, spill_dir):
    """A server whose spill disk is full; its reaper never ends a session by itself (timeout 600 s)."""
    disk = FailingDisk()
    disk.full = True
    pool = SharedPool.anonymous(64 * KIB)
    service = Service(pool, store_options=StoreOptions(spill_dir=spill_dir, spill_limit=1 << 20, spill_io=disk))
    srv = Server(service, DaemonConfig(socket=f"ipc://{tmp_path}/run/s.sock", client_timeout=600, hwm=10))
    srv.bind()
    task = asyncio.create_task(srv.serve())
    yield srv, task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    service.store.close()
    pool.close()


async def session_gone(srv: Server, session: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SESSION_END_DEADLINE
    while any(s.id == session for s in srv.service.sessions):
        assert loop.time() < deadline, f"session {session} of a client that went away did not end"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_after_a_spill_failure_the_server_serves_everyone_and_a_flooding_client_that_leaves_is_freed(
        full_disk_server, caplog):
    caplog.set_level(logging.INFO, logger="stormd")
    srv, serving = full_disk_server
    owner = AsyncClient(srv.config.socket)
    await owner.hello()
    for key in range(1, 5):
        assert (await owner.call("PUT", **put_fields(key, 16 * KIB)))["ok"]
        assert (await owner.call("SEAL", key=key, checksum=key))["ok"]
    refused = await owner.call("PUT", **put_fields(5, 16 * KIB))
    assert refused["error"] == ErrorCode.POOL_FULL and "No space left on device" in refused["message"]

    # A client that floods STATS without reading the replies, then goes: the replies the socket cannot
    # take wait in its backlog, and sending them finds it gone, which ends its session.
    flooder = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    flooder.setsockopt(zmq.RCVHWM, 1)
    flooder.connect(srv.config.socket)
    gone = AsyncClient(srv.config.socket)
    gone.sock = flooder
    session = (await gone.hello())["session"]
    for i in range(3000):
        await flooder.send(pack({"op": "STATS", "id": 10 + i, **gone.auth}))
    flooder.close(linger=0)
    await session_gone(srv, session)
    assert [r.why for r in caplog.records if getattr(r, "session", None) == session and hasattr(r, "why")] \
        == ["its socket is gone"]

    assert not serving.done()
    other = AsyncClient(srv.config.socket)
    assert (await other.call("PING"))["ok"]
    for key in range(4, 0, -1):  # the owner's tensors: never spilled, all there
        got = await owner.call("GET", key=key)
        assert got["ok"] and got["checksum"] == key, got
    assert (await owner.call("BYE"))["freed"] == 4
    assert srv.service.store.node_stats()["used"] == 0
    assert ErrorCode.INTERNAL not in srv.service.errors
