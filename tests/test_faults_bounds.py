"""Issue 38, item 7: what one client can make the daemon hold is bounded: sessions per socket and
in all, the bytes of the replies it leaves unread, the size of a frame it sends; and the CLIENTS
reply stays within what any client (stormctl) decodes however many sessions there are."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import pytest_asyncio
import zmq
from test_server_async import AsyncClient, serving, until

from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from stormd import ctl
from stormd.config import DaemonConfig
from stormd.server import Server
from stormd.service import Service
from stormd.sessions import SessionLimits
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ErrorCode, Request, pack, unpack

MIB = 1 << 20


def hello(service: Service, peer: bytes | None, pid: int = 1) -> dict:
    return service.handle_message({"op": "HELLO", "id": pid, "version": PROTOCOL_VERSION, "pid": pid,
                                   "host": "h" * 64}, peer)


def test_sessions_are_capped_per_client_socket_and_in_all():
    pool = SharedPool.anonymous(MIB)
    service = Service(pool, session_limits=SessionLimits(per_peer=3, total=5))
    assert all(hello(service, b"a")["ok"] for _ in range(3))
    refused = hello(service, b"a")
    assert refused["error"] == ErrorCode.TOO_MANY_SESSIONS and "max_sessions_per_peer" in refused["message"]
    assert hello(service, b"b")["ok"] and hello(service, b"c")["ok"]  # other sockets are not held up by it
    full = hello(service, b"d")
    assert full["error"] == ErrorCode.TOO_MANY_SESSIONS and "max_sessions" in full["message"]
    first = next(iter(service.sessions))
    service.end_session(first, "test")  # an ended session frees its place on both counts
    assert hello(service, b"a")["ok"]
    assert len(service.sessions) == 5 and len(service.sessions.by_peer(b"a")) == 3
    pool.close()


def test_the_clients_reply_fits_any_client_however_many_sessions_and_lists_the_biggest_holders_first():
    pool = SharedPool.anonymous(16 * MIB)
    service = Service(pool)  # no session limit: the reply must stay bounded by itself
    n = 6000
    sessions = [hello(service, None, pid) for pid in range(1, n + 1)]
    holders = {}
    for r, nbytes in zip(sessions[-3:], (3072, 1024, 2048)):  # the last sessions opened hold the most
        auth = {"session": r["session"], "token": r["token"]}
        assert service.handle(Request("PUT", 1, {**auth, **put_fields(1, nbytes)}), None)["ok"]
        holders[r["session"]] = nbytes
    reply = service.handle_message({"op": "CLIENTS", "id": 7})
    frame = pack(reply)
    assert len(frame) <= MAX_MESSAGE_BYTES and unpack(frame) == reply  # decodable by any client
    assert reply["total"] == n and 0 < len(reply["clients"]) < n
    top = [(c["session"], c["held_bytes"]) for c in reply["clients"][:3]]
    assert top == sorted(holders.items(), key=lambda kv: -kv[1])
    caption = ctl.clients_report(reply, "ipc:///x").caption
    assert f"{len(reply['clients'])} of {n} clients shown" in caption and f"{n - len(reply['clients'])} more" in caption
    pool.close()


@pytest_asyncio.fixture
async def small_backlog_server(tmp_path):
    """Unread replies are cut off at 1 MiB of them, never by their count."""
    async with serving(MIB, DaemonConfig(socket=f"ipc://{tmp_path}/run/s.sock", hwm=1, client_timeout=600,
                                         client_max_backlog=10_000_000, client_max_backlog_bytes=MIB)) as srv:
        yield srv


@pytest.mark.asyncio
async def test_a_client_whose_unread_replies_pass_the_byte_bound_is_cut_off(small_backlog_server, caplog):
    caplog.set_level(logging.INFO, logger="stormd")
    srv = small_backlog_server
    owner = AsyncClient(srv.config.socket)
    await owner.hello()
    assert (await owner.call("PUT", **put_fields(1, 4096)))["ok"]
    slow = AsyncClient(srv.config.socket)
    slow.sock.setsockopt(zmq.RCVHWM, 1)
    session = (await slow.hello())["session"]
    assert (await slow.call("PUT", **put_fields(1, 4096)))["ok"]
    stats = len(pack(srv.service.handle_message({"op": "STATS", "id": 1, **slow.auth})))
    for i in range(8 * MIB // stats):  # 8 MiB of replies it never reads
        await slow.sock.send(pack({"op": "STATS", "id": 10 + i, **slow.auth}))
    await until("the slow client to be cut off", lambda: all(s.id != session for s in srv.service.sessions))
    # the frames it sent after its session ended get error replies it does not read either: the peer may
    # be cut off again (no sessions left then), which is the bound doing its job
    (cut,) = [r for r in caplog.records
              if r.getMessage() == "client cut off: it does not read its replies" and r.sessions == [session]]
    assert cut.unread_bytes > MIB and cut.unread_replies < 10_000_000
    (gone,) = [r for r in caplog.records if getattr(r, "why", "").startswith("it left")]
    assert "client_max_backlog_bytes 1048576" in gone.why
    assert srv.service.store.node_stats()["used"] == srv.service.store.held_bytes(owner.auth["session"]) == 4096
    assert (await owner.call("SEAL", key=1, checksum=1))["ok"]  # the owner is served as before
    assert (await owner.call("GET", key=1))["checksum"] == 1


def test_a_daemon_at_its_session_limit_is_unavailable_to_a_new_client(tmp_path, caplog):
    """A HELLO the daemon refuses (at its session limit, draining) leaves it of no use to this process:
    mode='auto' trains on the embedded store, mode='daemon' raises StormUnavailable saying why."""
    import torch

    import storm

    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--max-sessions", "1")
    try:
        first = RawClient(d.endpoint)
        first.hello()
        with pytest.raises(storm.StormUnavailable, match="TOO_MANY_SESSIONS"):
            storm.offload(mode="daemon", socket=str(d.socket)).__enter__()
        caplog.set_level(logging.INFO, logger="storm")
        with storm.offload(mode="auto", socket=str(d.socket), min_bytes=0) as ctx:
            loss = torch.nn.Linear(8, 8)(torch.ones(4, 8)).tanh().sum()
        loss.backward()
        assert ctx.backend_name == "embedded store" and ctx.stats.offloaded > 0
        assert any("TOO_MANY_SESSIONS" in r.getMessage() for r in caplog.records)
        first.close()
    finally:
        storm.close_all()
        stop_daemon(d)


@pytest.mark.asyncio
async def test_a_hello_at_the_session_limit_first_ends_the_sessions_of_closed_sockets(tmp_path):
    """Processes that crash after HELLO (a crash loop) left their sessions until client_timeout and
    kept every new client out meanwhile; a HELLO at the limit now finds the closed sockets first,
    and a live client is asked, not ended."""
    pool = SharedPool.anonymous(MIB)
    srv = Server(Service(pool, session_limits=SessionLimits(per_peer=16, total=3)),
                 DaemonConfig(socket=f"ipc://{tmp_path}/run/s.sock", client_timeout=600))
    srv.bind()
    task = asyncio.create_task(srv.serve())
    try:
        clients = [AsyncClient(srv.config.socket) for _ in range(3)]
        for c in clients:
            assert (await c.hello())["ok"]
        for c in clients[:2]:
            c.sock.close(linger=0)  # no BYE: the process is gone
        # Two newcomers, each let in at the limit only once a closed socket's session has ended. The
        # first HELLO may come when ZeroMQ's I/O thread has seen one of the two closes: it ends that one
        # and is let in, and the second newcomer's HELLO ends the other.
        deadline = time.monotonic() + 60  # until ZeroMQ's I/O thread has seen both connections close
        hello = {"version": PROTOCOL_VERSION, "pid": 1, "host": "test"}
        admitted = []
        for _ in range(2):
            newcomer = AsyncClient(srv.config.socket)
            while not (r := await newcomer.call("HELLO", **hello))["ok"] and time.monotonic() < deadline:
                assert r["error"] == ErrorCode.TOO_MANY_SESSIONS, r
                await asyncio.sleep(0.2)
            assert r["ok"], r
            admitted.append(r["session"])
        assert {s.id for s in srv.service.sessions} == {clients[2].auth["session"], *admitted}
        assert (await clients[2].call("PUT", **put_fields(1, 4096)))["ok"]  # the live one was probed, not ended
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pool.close()
