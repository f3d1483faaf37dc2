"""The server's handlers on a real ROUTER socket, driven from the same event loop (pytest-asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from helpers import put_fields
from stormd.config import DaemonConfig
from stormd.server import Server
from stormd.service import Service
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, ErrorCode, pack, unpack


class AsyncClient:
    def __init__(self, endpoint: str):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.auth: dict = {}

    async def call(self, op: str, **fields) -> dict:
        await self.sock.send(pack({"op": op, "id": next(self.ids), **self.auth, **fields}))
        while (reply := unpack(await asyncio.wait_for(self.sock.recv(), 5))).get("probe"):
            pass  # the daemon asking whether this socket is still there, which clients drop
        return reply

    async def hello(self) -> dict:
        r = await self.call("HELLO", version=PROTOCOL_VERSION, pid=os.getpid(), host="test")
        self.auth = {"session": r["session"], "token": r["token"]}
        return r


@contextlib.asynccontextmanager
async def serving(pool_size: int, config: DaemonConfig):
    """A Server over a fresh pool of ``pool_size`` bytes, serving on this loop until the block ends."""
    pool = SharedPool.anonymous(pool_size)
    srv = Server(Service(pool), config)
    srv.bind()
    task = asyncio.create_task(srv.serve())
    try:
        yield srv
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pool.close()


@pytest_asyncio.fixture
async def server(tmp_path):
    async with serving(1 << 20, DaemonConfig(socket=f"ipc://{tmp_path}/run/s.sock", client_timeout=0.3)) as srv:
        yield srv


@pytest.mark.asyncio
async def test_hello_put_seal_get_free(server):
    c = AsyncClient(server.config.socket)
    hello = await c.hello()
    assert hello["ok"] and hello["pool"]["size"] == 1 << 20 and hello["version"] == PROTOCOL_VERSION
    put = await c.call("PUT", **put_fields(9, 4096))
    assert put["ok"] and put["offset"] % 256 == 0
    assert (await c.call("SEAL", key=9, checksum=123))["ok"]
    got = await c.call("GET", key=9)
    assert got["offset"] == put["offset"] and got["checksum"] == 123 and got["shape"] == [4096]
    assert (await c.call("FREE", all=True))["freed"] == 1
    assert server.service.store.node_stats()["used"] == 0


@pytest.mark.asyncio
async def test_replies_match_ids_when_requests_are_pipelined(server):
    c = AsyncClient(server.config.socket)
    await c.hello()
    for i in range(50):  # send all, then read all: replies come back in order with their ids
        await c.sock.send(pack({"op": "PUT", "id": 1000 + i, **c.auth, **put_fields(i, 100)}))
    replies = [unpack(await asyncio.wait_for(c.sock.recv(), 5)) for _ in range(50)]
    assert [r["id"] for r in replies] == list(range(1000, 1050)) and all(r["ok"] for r in replies)


@pytest.mark.asyncio
async def test_requests_queued_by_several_clients_are_all_answered_each_clients_in_order(server):
    """Requests are answered from ZeroMQ's descriptor callback, ANSWERED_IN_TURN at a time, the rest
    in later turns: none is left behind, answered twice or out of its client's order."""
    import stormd.server as server_module

    clients = [AsyncClient(server.config.socket) for _ in range(3)]
    for c in clients:
        await c.hello()
    before = server.service.traffic.requests
    n = 3 * server_module.ANSWERED_IN_TURN + 5
    for i in range(n):  # all sent before any reply is read: most are queued at once
        for c in clients:
            await c.sock.send(pack({"op": "PING", "id": 1000 + i, **c.auth}))
    for c in clients:
        replies = [unpack(await asyncio.wait_for(c.sock.recv(), 5)) for _ in range(n)]
        assert [r["id"] for r in replies] == list(range(1000, 1000 + n)) and all(r["ok"] for r in replies)
    assert server.service.traffic.requests - before == 3 * n
    assert (await clients[0].call("PING"))["ok"]  # and it serves on


@pytest.mark.asyncio
async def test_errors_are_counted_and_the_loop_survives_bad_frames(server):
    c = AsyncClient(server.config.socket)
    await c.sock.send(b"\xc1")
    r = unpack(await asyncio.wait_for(c.sock.recv(), 5))
    assert r["error"] == ErrorCode.BAD_MESSAGE
    await c.sock.send_multipart([b"a", b"b", b"c"])
    r = unpack(await asyncio.wait_for(c.sock.recv(), 5))
    assert r["error"] == ErrorCode.BAD_MESSAGE and "one frame" in r["message"]
    assert (await c.call("PING"))["ok"]
    assert server.service.errors[ErrorCode.BAD_MESSAGE] == 2


async def until(what: str, done, timeout: float = 30.0) -> None:
    """Poll ``done()`` while the server's loop runs; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        assert loop.time() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_silent_sessions_are_reaped(server):
    c = AsyncClient(server.config.socket)
    await c.hello()
    assert (await c.call("PUT", **put_fields(1, 5000)))["ok"]
    # the client stays silent past the 0.3 s timeout: polling reads the server's state, sending nothing
    await until("the reaper to end the silent session", lambda: len(server.service.sessions) == 0, timeout=60)
    assert server.service.store.node_stats()["used"] == 0
    assert (await c.call("GET", key=1))["error"] == ErrorCode.UNAUTHORIZED


def failing_end_session(*args, **kwargs):
    raise RuntimeError("ending a session failed (injected)")


def logged(caplog, text: str) -> list:
    return [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.asyncio
async def test_the_silent_client_reaper_survives_an_exception_and_reaps_on(server, caplog, monkeypatch):
    c = AsyncClient(server.config.socket)
    await c.hello()
    assert (await c.call("PUT", **put_fields(1, 5000)))["ok"]
    monkeypatch.setattr(server.service, "end_session", failing_end_session)
    await until("the reaper to log its failure", lambda: logged(caplog, "ending a silent client's session failed"))
    assert logged(caplog, "ending a silent client's session failed")[0].exc_info is not None  # with its traceback
    monkeypatch.undo()
    await until("the reaper to end the silent session", lambda: len(server.service.sessions) == 0)
    assert server.service.store.node_stats()["used"] == 0


@pytest.mark.asyncio
async def test_an_exception_while_ending_a_gone_clients_sessions_does_not_end_serve(server, caplog, monkeypatch):
    monkeypatch.setattr(server.service, "end_session", failing_end_session)
    gone = AsyncClient(server.config.socket)
    gone.sock.setsockopt(zmq.RCVHWM, 1)
    await gone.hello()
    for i in range(5000):  # replies it never reads: sending them finds it gone, which ends its sessions
        await gone.sock.send(pack({"op": "STATS", "id": 10 + i, **gone.auth}))
    gone.sock.close(linger=0)
    # whichever finds it gone first: a reply's send, the flush of queued replies, or the probe that a
    # socket's disconnect starts (on a loaded machine the probe may come before any send fails)
    failures = ("answering a request failed", "flushing a client's replies failed",
                "ending the sessions of a closed client socket failed")
    await until("the server to log the failure", lambda: any(logged(caplog, f) for f in failures))
    monkeypatch.undo()
    other = AsyncClient(server.config.socket)
    assert (await other.call("PING"))["ok"]
    await other.hello()
    assert (await other.call("PUT", **put_fields(1, 100)))["ok"]


@pytest.mark.asyncio
async def test_the_server_decodes_requests_within_the_largest_valid_requests_limits(server):
    """A map of 100 fields is within what a reply may hold (the client's limits) and more than any
    request has: decoding such frames held the daemon's loop up for every other client."""
    c = AsyncClient(server.config.socket)
    r = await c.call("PING", **{f"f{i}": i for i in range(100)})
    assert r["error"] == ErrorCode.BAD_MESSAGE and "map_len" in r["message"], r
    assert (await c.call("PING"))["ok"]  # and it serves on


class _Enough(BaseException):
    """Ends a serve() loop from inside an answer (answers catch Exception)."""


class FakeSocket:
    """The synchronous socket serve() reads: ``queued`` requests, EVENTS from them, and a pipe's read
    end for ZeroMQ's descriptor (``signal`` makes it readable, as a message's arrival does). As in
    ZeroMQ, every operation on the socket takes the descriptor's signal, whatever it was for."""

    def __init__(self, endless: bool = False):
        self.endless = endless
        self.queued: list[list[bytes]] = []
        self.sent: list[bytes] = []
        self._frames: list[bytes] = []  # what is left of the message recv reads
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)

    def _take_signal(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 64)

    def get(self, option: int) -> int:
        if option == zmq.FD:
            return self._r
        if option == zmq.RCVMORE:
            return int(bool(self._frames))
        assert option == zmq.EVENTS, option
        self._take_signal()
        return int(zmq.POLLIN) if self.endless or self.queued or self._frames else 0

    def recv(self, flags: int = 0) -> bytes:
        """The next frame: of the message being read, else of the next one queued."""
        self._take_signal()
        if not self._frames:
            self._frames = [b"peer", b"request"] if self.endless else list(self.queued.pop(0))
        return self._frames.pop(0)

    def send(self, frame: bytes, flags: int = 0) -> None:
        self._take_signal()
        self.sent.append(frame)

    def signal(self) -> None:
        os.write(self._w, b"x")

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@pytest.mark.asyncio
async def test_a_steady_stream_of_requests_still_gives_the_loops_other_tasks_a_turn(monkeypatch):
    """Requests already queued are answered without an await, so under a load that never lets the
    queue empty the reaper, the reply backlogs and a drain would wait for a quiet moment: the
    server yields after every ANSWERED_IN_TURN answers."""
    import stormd.server as server_module

    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    answered = 0
    sock = FakeSocket(endless=True)  # a request always queued

    def answer(frames: list[bytes]) -> None:
        nonlocal answered
        answered += 1
        if answered == 10 * server_module.ANSWERED_IN_TURN:
            raise _Enough

    srv._sock, srv._sync = object(), sock
    monkeypatch.setattr(srv, "_answer", answer)
    monkeypatch.setattr(srv, "close", lambda: None)
    turns: list[int] = []

    async def other_task() -> None:
        while True:
            turns.append(answered)
            await asyncio.sleep(0)

    other = asyncio.create_task(other_task())
    await asyncio.sleep(0)  # it runs once before serving starts
    with pytest.raises(_Enough):
        await srv.serve()
    other.cancel()
    pool.close()
    assert turns[0] == 0 and len(turns) >= 9, turns
    assert all(b - a <= server_module.ANSWERED_IN_TURN for a, b in zip(turns, turns[1:])), turns
    sock.close()


@pytest.mark.asyncio
async def test_a_request_whose_signal_a_send_took_is_still_answered(monkeypatch):
    """Requests are answered once ZeroMQ's descriptor turns readable, but any operation on the socket
    (a reply sent from another task: the backlog flusher) reads the descriptor's signal of a request
    that arrived meanwhile, which then stays queued with the descriptor quiet. Every send outside
    the answering has the server look at EVENTS again, so that request is answered without waiting
    for the next."""
    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    sock = FakeSocket()
    answers: list[list[bytes]] = []
    srv._sock, srv._sync = object(), sock
    monkeypatch.setattr(srv, "_answer", answers.append)
    monkeypatch.setattr(srv, "close", lambda: None)
    serving_task = asyncio.create_task(srv.serve())
    await asyncio.sleep(0.05)  # asleep: nothing queued

    sock.queued.append([b"peer", b"first"])  # a request arrives and signals
    sock.signal()
    await asyncio.wait_for(_until(lambda: len(answers) == 1), 5)

    sock.queued.append([b"peer", b"second"])  # another arrives, and a send takes its signal
    sock.signal()
    assert srv._try_send(b"other", b"reply")
    await asyncio.wait_for(_until(lambda: len(answers) == 2), 5)
    assert answers == [[b"peer", b"first"], [b"peer", b"second"]]
    serving_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving_task
    sock.close()
    pool.close()


@pytest.mark.asyncio
async def test_a_socket_that_fails_ends_serve_with_its_error(monkeypatch):
    """Requests are read in a callback of the loop's, not in serve()'s task: what reading the socket
    raises (past a request's answer, which costs that request alone) still ends serve() with it,
    rather than going to the loop's exception handler while serve() waits on."""
    class FailingSocket(FakeSocket):
        def get(self, option: int) -> int:
            if option == zmq.EVENTS:
                raise zmq.ZMQError(zmq.ENOTSOCK)
            return super().get(option)

    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    sock = FailingSocket()
    srv._sock, srv._sync = object(), sock
    monkeypatch.setattr(srv, "close", lambda: None)
    monkeypatch.setattr(srv, "_end_sessions_on_disconnect", _forever)  # no monitor without bind()
    with pytest.raises(zmq.ZMQError) as failed:
        await asyncio.wait_for(srv.serve(), 5)
    assert failed.value.errno == zmq.ENOTSOCK
    sock.close()
    pool.close()


@pytest.mark.asyncio
async def test_flushing_the_replies_of_a_client_found_gone_drops_them_quietly(caplog):
    """The flusher's send finds the client's socket gone: its sessions end and its waiting replies go,
    with nothing logged as a failure (before: the emptied backlog's pop raised, logged as one)."""
    from stormd.server import _Backlog

    class GoneSocket(FakeSocket):
        def send(self, frame: bytes, flags: int = 0) -> None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)

    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    sock = GoneSocket()
    srv._sync = sock
    backlog = _Backlog()
    for frame in (b"one", b"two"):
        backlog.append(frame)
    srv._backlog[b"gone"] = backlog
    caplog.set_level(logging.ERROR, logger="stormd")
    await asyncio.wait_for(srv._flush_backlogs(), 5)
    assert not srv._backlog and len(backlog) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    sock.close()
    pool.close()


class FullPipeSocket(FakeSocket):
    """A socket whose pipe to its one client is full (sends fail with zmq.Again, as ZeroMQ's do) until
    ``full`` is cleared: the client reads. Closing it records the linger asked for."""

    def __init__(self):
        super().__init__()
        self.full = True
        self.linger: int | None = None

    def send(self, frame: bytes, flags: int = 0) -> None:
        if self.full:
            self._take_signal()
            raise zmq.Again
        super().send(frame, flags)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        """The asyncio socket's (the STOPPING notices): a send that fails stays in its future."""
        with contextlib.suppress(zmq.Again):
            for frame in frames:
                self.send(frame, flags)

    def close(self, linger: int | None = None) -> None:
        self.linger = linger

    def release(self) -> None:
        super().close()


async def _forever() -> None:
    await asyncio.Event().wait()


@pytest.mark.asyncio
async def test_replies_waiting_for_a_slow_client_reach_it_as_the_daemon_stops_then_the_stopping_notice(
        monkeypatch):
    """Replies a client had not made room for yet waited in its backlog, and stopping dropped them
    (the flusher cancelled at once), the STOPPING notice going without them: the client, reading on,
    got that notice in place of the answers to requests stormd had served. They are sent, in order
    and before the notice, while the client reads within STOP_LINGER_MS."""
    import stormd.server as server_module

    monkeypatch.setattr(server_module, "STOP_LINGER_MS", 600_000)  # the client reads well within it
    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    sock = FullPipeSocket()
    srv._sock, srv._sync = sock, sock
    monkeypatch.setattr(srv, "_end_sessions_on_disconnect", _forever)  # no monitor without bind()
    serving_task = asyncio.create_task(srv.serve())
    hello = {"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": os.getpid(), "host": "test"}
    assert srv.service.handle_message(hello, b"peer")["ok"]
    for rid in (2, 3, 4):
        srv._send(b"peer", {"id": rid, "ok": True})  # the client reads none yet: they wait, in order
    assert len(srv._backlog[b"peer"]) == 3
    srv.service.start_draining("test")
    await asyncio.sleep(0.01)  # the flusher tries (the pipe is full)
    serving_task.cancel()
    await asyncio.sleep(0)  # serve() stops: its finally runs
    sock.full = False  # the client reads on
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(serving_task, 60)
    replies = [unpack(frame) for frame in sock.sent if frame != b"peer"]
    assert [r["id"] for r in replies] == [2, 3, 4, 0] and replies[-1]["stopping"], replies
    assert sock.linger == 600_000 and not srv._backlog
    sock.release()
    pool.close()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_a_storm_of_disconnects_probes_at_most_every_probe_interval(monkeypatch):
    """Each probe sends to every client socket: while disconnects keep coming, the probes that follow
    them come PROBE_INTERVAL apart, not once per disconnect, and the last a whole schedule after the
    last disconnect (a route let go of late is still found)."""
    import stormd.server as server_module

    pool = SharedPool.anonymous(1 << 20)
    srv = Server(Service(pool), DaemonConfig(socket="ipc:///unused"))
    probes: list[float] = []
    monkeypatch.setattr(srv, "_probe_peers", lambda: probes.append(asyncio.get_running_loop().time()))
    loop = asyncio.get_running_loop()
    srv._disconnects = 1
    prober = asyncio.create_task(srv._probe_after_disconnects())
    storm_end = loop.time() + 0.6
    while loop.time() < storm_end:  # a disconnect every 5 ms
        srv._disconnects += 1
        await asyncio.sleep(0.005)
    last_disconnect = loop.time()
    await asyncio.wait_for(prober, 30)
    pool.close()
    # the first schedule's quick probes, up to the first disconnect seen after one: then PROBE_INTERVAL apart
    after_first = probes[1:]
    gaps = [b - a for a, b in zip(after_first, after_first[1:])]
    assert gaps and min(gaps) >= server_module.PROBE_INTERVAL * 0.99, probes
    assert probes[-1] - last_disconnect >= server_module.DISCONNECT_PROBES[-1] - 0.01, (probes, last_disconnect)
