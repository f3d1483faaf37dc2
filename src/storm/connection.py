"""Connection to stormd: one DEALER socket, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, and both the training thread (unpack) and
the mover thread (PUT, GET) issue requests. So callers enqueue requests and
wake the I/O thread through a pipe; it sends, matches replies to futures by
id, and pings the daemon every ``heartbeat`` seconds so the daemon knows the
client is alive while no tensors flow. The same pings tell the client the daemon
is gone: when nothing has come back for ``dead_after`` seconds while requests
wait, or the daemon no longer knows the session (it restarted), the connection
closes for good and every request fails at once with StormUnavailable: those
sent, those still queued here and any made later. So no caller (the mover's
worker, with hundreds of requests behind it) waits out a timeout per request,
and a process that catches the error can exit. These pings stay beside
ZeroMQ's own heartbeats, which the daemon's socket sets (stormd/server.py
says why they cannot replace them).

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

from .errors import StormRequestError, StormUnavailable, StormUntrusted
from .replies import resolve
from .trust import CheckedSocket, check_pool, open_checked_socket

CONNECT_TIMEOUT = 2.0
HEARTBEAT = CLIENT_HEARTBEAT
DEAD_AFTER = 5.0
MAX_IN_FLIGHT = 256  # below stormd's default hwm (1000), so neither side's pipe fills


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
        self.lost: str | None = None  # why the daemon is considered gone
        self._ids = itertools.count(1)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._closed = threading.Event()
        self._auth: dict[str, Any] = {}
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="storm-io", daemon=True)
        self._thread.start()
        try:
            # STORM_CLIENT_NAME picks this process's quota and priority in stormd's `clients` setting
            named = {"name": os.environ["STORM_CLIENT_NAME"]} if os.environ.get("STORM_CLIENT_NAME") else {}
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
        return StormUnavailable(self.lost or f"connection to {self.endpoint} is closed")

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
            self.lost = f"connection to {self.endpoint} failed: {type(e).__name__}: {e}"
        finally:
            # closed first: a request queued from here on fails in request() instead of waiting in the outbox
            self._closed.set()
            sock.close(linger=0)
            error = self._closing_error()
            for fut in [*self._pending.values(), *(fut for _, fut in unsent)]:
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()
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
                reply = unpack(sock.recv())
                last_heard = time.monotonic()
                fut = self._pending.pop(reply.get("id"), None)
                if fut is not None:
                    resolve(fut, reply)
                if reply.get("error") == "UNAUTHORIZED" and self._auth:
                    self.lost = (f"stormd at {self.endpoint} no longer knows session {self.session}: it ended it "
                                 f"(no message within its client_timeout, a client cut off) or it restarted")
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
            if (self._pending or unsent) and time.monotonic() - last_heard > self.dead_after:
                self.lost = f"stormd at {self.endpoint} did not answer for {self.dead_after:g} s"
            if self.lost:
                return

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
