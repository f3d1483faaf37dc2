"""Connection to stormd: one DEALER socket, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, and both the training thread (unpack) and
the mover thread (PUT, GET) issue requests. So callers enqueue requests and
wake the I/O thread through a pipe; it sends, matches replies to futures by
id, and pings the daemon every ``heartbeat`` seconds so the daemon knows the
client is alive while no tensors flow.

The connection also learns when the daemon stops serving this process, and
keeps how and since when as ``loss`` (storm/errors.py's DaemonLoss): a drain
(SIGTERM, stormctl drain) from the PING replies or the daemon's STOPPING
notice as it exits (a PUT refused with DRAINING waits for the next PING's
account, so that its failure says why); a kill from the silence, when nothing
has come back for ``dead_after`` seconds while requests wait; a restart, or a
session the daemon ended, from a request it no longer knows the session of (a
STATUS then tells the two apart by the daemon's uptime). A draining daemon
still answers GET and FREE, so the connection stays open until it stops;
otherwise it closes for good at once, and every request fails with the loss's
StormDaemonLost: those sent, those still queued here and any made later. So
no caller (the mover's worker, with hundreds of requests behind it) waits out
a timeout per request, and a process that catches the error can exit. These
pings stay beside ZeroMQ's own heartbeats, which the daemon's socket sets
(stormd/server.py says why they cannot replace them).

Credit: at most ``max_in_flight`` requests are on the wire unanswered; later
ones wait here, in order. So a process that produces requests faster than
the daemon answers is slowed in its own queue, the socket's send never blocks
(the credit is below ZeroMQ's high-water mark) and the daemon never holds a
backlog of this client's replies. A tcp:// endpoint is reached with CURVE
keys from the environment (stormd/wire/curve.py). An ipc:// endpoint is reached only
through its directory as storm/trust.py opened and checked it (/proc/self/fd/N/NAME), held open for
as long as ZeroMQ may reconnect: never by the name again, which another user could have repointed.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq

from stormd.wire.cuda import unregister_pool
from stormd.wire.curve import CurveKeyError, client_curve_options
from stormd.wire.endpoint import ipc_path
from stormd.wire.pool import PoolError, SharedPool
from stormd.wire.protocol import CLIENT_HEARTBEAT, PROTOCOL_VERSION, pack, unpack

from .errors import (
    DRAINED,
    ENDED,
    FAILED,
    KILLED,
    RESTARTED,
    DaemonLoss,
    StormRequestError,
    StormUnavailable,
    StormUntrusted,
)
from .replies import resolve
from .trust import CheckedSocket, check_pool, open_checked_socket

CONNECT_TIMEOUT = 2.0
HEARTBEAT = CLIENT_HEARTBEAT
DEAD_AFTER = 5.0
MAX_IN_FLIGHT = 256  # below stormd's default hwm (1000), so neither side's pipe fills
# A drain learnt from a refused PUT, from a daemon whose PING replies give no account of it (an older one)
REFUSED_PUT = "a signal or `stormctl drain` (it refused a PUT with DRAINING)"
ENDED_WHY = ("it heard nothing from this process within its client_timeout, or cut it off for replies left "
             "unread (its log says which)")


class DaemonConnection:
    def __init__(self, endpoint: str, connect_timeout: float = CONNECT_TIMEOUT, heartbeat: float = HEARTBEAT,
                 dead_after: float = DEAD_AFTER, max_in_flight: int = MAX_IN_FLIGHT,
                 checked: CheckedSocket | None = None):
        """``checked``: the ipc:// socket as open_checked_socket opened it (opened here if not given);
        the connection owns it from here on and closes it when it closes, failing to connect included."""
        self.endpoint = endpoint
        path = ipc_path(endpoint)
        self._checked = checked if checked is not None or path is None else open_checked_socket(path)
        # what ZeroMQ connects (and reconnects) to: ``endpoint`` itself is kept for what is said to the user
        self._connect_to = self._checked.endpoint if self._checked is not None else endpoint
        self.max_in_flight = max_in_flight
        try:
            self._sockopts = client_curve_options(endpoint) if endpoint.startswith("tcp://") else {}
        except CurveKeyError as e:
            self._close_checked()
            raise StormUnavailable(str(e)) from None
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.loss: DaemonLoss | None = None  # how and since when the daemon stopped serving this process
        self._stopping = False  # the daemon is gone, or going (STOPPING): close now
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._unknown: list[Future] = []  # requests of a session the daemon no longer knows: failed with the loss
        self._refused: list[tuple[Future, dict]] = []  # PUTs refused with DRAINING, answered once the loss is known
        self._asked: tuple[Future, float] | None = None  # the STATUS that tells a restart, and when it was sent
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._closed = threading.Event()
        self._auth: dict[str, Any] = {}
        self._ctx = zmq.Context()
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name="storm-io", daemon=True)
        self._thread.start()
        try:
            # STORM_CLIENT_NAME picks this process's quota and priority in stormd's `clients` setting
            named = {"name": os.environ["STORM_CLIENT_NAME"]} if os.environ.get("STORM_CLIENT_NAME") else {}
            self._hello_at = time.time()  # a daemon started after this is not the one that opened the session
            hello = self.request("HELLO", version=PROTOCOL_VERSION, pid=os.getpid(),
                                 host=socket.gethostname(), **named).result(connect_timeout)
        except TimeoutError:
            self._shutdown()
            raise StormUnavailable(f"no stormd answered at {endpoint} within {connect_timeout:g} s") from None
        except StormRequestError as e:  # draining, at its session limit, another protocol: it serves no one new
            self._shutdown()
            raise StormUnavailable(f"stormd at {endpoint} refused a new session: {e}") from None
        except Exception:
            self._shutdown()
            raise
        self._auth = {"session": hello["session"], "token": hello["token"]}
        self.session = hello["session"]
        self.codec = hello.get("codec", "raw")  # the daemon's choice of codec
        self.cuda_devices = frozenset(hello.get("cuda_devices", ()))  # GPUs whose memory the daemon copies
        self.name = f"stormd at {endpoint} (session {self.session}, {hello['server']})"
        self.store = self.name
        path = hello["pool"]["path"]
        try:
            self.pool = SharedPool.attach(path, hello["pool"]["size"], check=lambda st: check_pool(path, st))
        except PoolError as e:
            self.close()
            raise StormUnavailable(f"connected to {endpoint} but cannot map its pool: {e}") from None
        except StormUntrusted:
            self.close()  # BYE: nothing was stored
            raise

    def request(self, op: str, **fields: Any) -> Future:
        fut: Future = Future()
        if self._closed.is_set():
            fut.set_exception(self._closing_error())
            return fut
        msg = {"op": op, "id": next(self._ids), **(self._auth if op != "HELLO" else {}), **fields}
        self._outbox.put((msg, fut))
        if self._closed.is_set():  # closed since the check above: the I/O thread may have emptied the outbox already
            self._fail_outbox()
        self._wake()
        return fut

    def _fail_outbox(self) -> None:
        """Fail every request still queued: once the connection is closed none of them is sent, and
        their callers (the mover's worker among them) would each wait out their timeout for a reply."""
        error = self._closing_error()
        while True:
            try:
                _, fut = self._outbox.get_nowait()
            except queue.Empty:
                return
            fut.set_exception(error)

    def _closing_error(self) -> StormUnavailable:
        return self.loss.error() if self.loss else StormUnavailable(f"connection to {self.endpoint} is closed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        unsent: collections.deque = collections.deque()
        try:
            self._serve(sock, unsent)
        except Exception as e:  # the requests fail with this, rather than the thread dying with a traceback
            self.loss = self.loss or DaemonLoss(self.endpoint, FAILED, time.time(), f"{type(e).__name__}: {e}")
        finally:
            # closed first: a request queued from here on fails in request() instead of waiting in the outbox
            self._closed.set()
            sock.close(linger=0)
            error = self._closing_error()
            waiting = [*self._pending.values(), *(f for _, f in unsent), *self._unknown, *(f for f, _ in self._refused)]
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()
            self._unknown.clear()
            self._refused.clear()
            self._fail_outbox()

    def _serve(self, sock: zmq.Socket, unsent: collections.deque) -> None:
        """Send, receive and ping until closed or the daemon is lost. ``unsent``: requests taken from
        the outbox that the socket could not take yet."""
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in self._sockopts.items():
            sock.setsockopt(option, value)
        sock.connect(self._connect_to)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_sent = last_heard = time.monotonic()
        # Sends never block this thread: a socket with no connection to queue on (a CURVE handshake the
        # daemon refused drops it) would hold it, and with it every reply, heartbeat and shutdown. What
        # cannot go yet waits in ``unsent``, and the poller wakes the loop when the socket can take it.
        while not self._closed.is_set():
            sendable = unsent and len(self._pending) < self.max_in_flight  # else replies wake it
            poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if sendable else 0))
            events = dict(poller.poll(timeout=int(self.heartbeat * 1000)))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            # replies first: each one returns a credit the outbox below may use
            while sock.poll(0, zmq.POLLIN):
                last_heard = time.monotonic()
                self._read(unpack(sock.recv()), unsent)
            if self._asked is not None:
                status, asked = self._asked
                if status.done() or time.monotonic() - asked > self.dead_after:
                    self.loss, self._stopping = self._session_unknown(status, asked), True
            if self._auth and not unsent and time.monotonic() - last_sent >= self.heartbeat:
                unsent.append(({"op": "PING", "id": next(self._ids), **self._auth}, Future()))
            while len(self._pending) < self.max_in_flight and (unsent or not self._outbox.empty()):
                msg, fut = unsent.popleft() if unsent else self._outbox.get()
                try:
                    sock.send(pack(msg), zmq.NOBLOCK)
                except zmq.Again:
                    unsent.appendleft((msg, fut))
                    break
                self._pending[msg["id"]] = fut
                last_sent = time.monotonic()
            silent = time.monotonic() - last_heard
            if (self._pending or unsent) and silent > self.dead_after:
                self.loss = self.loss or DaemonLoss(self.endpoint, KILLED, time.time() - silent,
                                                    f"{self.dead_after:g} s")
                self._stopping = True
            if self._stopping:
                return

    def _read(self, reply: dict[str, Any], unsent: collections.deque) -> None:
        """One message from the daemon: a reply, or unasked (a probe; STOPPING). What it says of the
        daemon's state goes into ``loss`` before the request it answers completes, so whoever sees
        that request fail sees why."""
        draining = reply.get("draining")
        if isinstance(draining, dict):
            self._draining(draining.get("reason"), draining.get("since"))
            self._stopping = self._stopping or reply.get("stopping") is True
        fut = self._pending.pop(reply.get("id", 0), None)  # 0: no request's (a probe, a notice)
        if fut is None:
            return
        error = reply.get("error")
        if error == "DRAINING" and self._auth and self.loss is None:
            self._refused.append((fut, reply))
            if len(self._refused) == 1:  # its reply says why and since when; without that, an older daemon
                ping: Future = Future()
                ping.add_done_callback(lambda _: self._draining(None, None))
                unsent.appendleft(({"op": "PING", "id": next(self._ids), **self._auth}, ping))
            return
        if error == "UNAUTHORIZED" and self._auth:
            self._unknown.append(fut)
            if self.loss is not None:  # the daemon that drained is gone, and another answers
                self._stopping = True
            elif self._asked is None:
                self._asked = (Future(), time.monotonic())
                unsent.appendleft(({"op": "STATUS", "id": next(self._ids)}, self._asked[0]))
            return
        resolve(fut, reply)

    def _draining(self, reason: object, since: object) -> None:
        """The daemon drains: ``reason`` and ``since`` as it says them (None: it does not say), and the
        PUTs it refused for that fail now."""
        if self.loss is None:
            if isinstance(reason, str) and isinstance(since, (int, float)):
                how = "`stormctl drain`" if reason == "DRAIN request" else reason
                self.loss = DaemonLoss(self.endpoint, DRAINED, float(since), how)
            else:
                self.loss = DaemonLoss(self.endpoint, DRAINED, time.time(), REFUSED_PUT)
        refused, self._refused = self._refused, []
        for fut, reply in refused:
            resolve(fut, reply)

    def _session_unknown(self, status: Future, asked: float) -> DaemonLoss:
        """The daemon no longer knows this process's session (since ``asked``, time.monotonic()): it
        restarted, if the daemon that answers ``status`` (a STATUS) started after this session's HELLO;
        else it ended the session."""
        now = time.time()
        reply = status.result() if status.done() and status.exception() is None else {}
        uptime = reply.get("uptime_s")
        if isinstance(uptime, (int, float)) and now - uptime > self._hello_at:
            return DaemonLoss(self.endpoint, RESTARTED, now - uptime, str(reply.get("server")))
        return DaemonLoss(self.endpoint, ENDED, now - (time.monotonic() - asked), ENDED_WHY)

    @property
    def alive(self) -> bool:
        return not self._closed.is_set()

    def _shutdown(self) -> None:
        if self._thread is None:
            return
        self._closed.set()
        self._wake()
        self._thread.join(timeout=5)
        self._thread = None
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()
        self._close_checked()  # only now: until the context is gone, ZeroMQ may reconnect through it

    def _close_checked(self) -> None:
        if self._checked is not None:
            self._checked.close()

    def close(self) -> None:
        """Say BYE (the daemon frees everything of this session) and stop the I/O thread."""
        if not self._closed.is_set():
            try:
                self.request("BYE").result(timeout=1.0)
            except Exception:
                pass  # the daemon reclaims the session on its own when the heartbeats stop
        self._shutdown()
        if getattr(self, "pool", None) is not None:
            unregister_pool(self.pool)
            self.pool.close()
