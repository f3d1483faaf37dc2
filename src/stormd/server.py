"""The daemon's transport: one ZeroMQ ROUTER socket on an asyncio (uvloop) loop.

Every frame is decoded and handed to ``Service``; each gets exactly one reply.
Clients that stop sending (no heartbeat within ``client_timeout``) or that the
socket can no longer reach are dropped and everything they held is freed.

Flow control. A client that sends faster than the daemon answers fills its
own pipe (``hwm`` messages each way): ZeroMQ then stops reading that
connection, so the client's sends block, while the ROUTER keeps taking the
other clients' messages in turn. A reply the socket cannot take now (the
client does not read its replies) waits in that client's backlog, in order,
and is sent when the client reads; nothing is dropped (as the daemon stops,
the replies still waiting have STOP_LINGER_MS to go, before the STOPPING
notice). A client whose backlog grows past ``client_max_backlog`` replies or
``client_max_backlog_bytes`` is cut off: its session ends (logged at ERROR,
its tensors freed) rather than letting it hold the daemon's memory. Frames larger than ``max_message_size``
are dropped by ZeroMQ as their header arrives (ZMQ_MAXMSGSIZE; it closes that
connection), so no client makes the daemon buffer a frame of any size.
tcp:// sockets are served only with CURVE (auth.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from time import perf_counter
from typing import Callable, cast

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from .auth import secure_server
from .config import DaemonConfig
from .service import Service
from .wire.endpoint import ensure_private_dir, ipc_path, socket_is_live
from .wire.protocol import OPS, ErrorCode, ProtocolError, notice, pack, packer, unpack_request

log = logging.getLogger("stormd")

_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_OP_NAMES = frozenset(OPS)
# Requests answered back to back before the loop's other tasks get a turn: _answer_queued takes the
# requests already queued without an await, so under a steady load they would wait for a quiet moment
ANSWERED_IN_TURN = 64
BACKLOG_RETRY = 0.001  # seconds between retries of replies a client has not made room for
# What the daemon sends a client socket, unasked, to learn whether it is still connected: an id no
# request has, which clients drop as they drop any reply they are not waiting for.
PROBE = pack(notice())
# Seconds after a client socket's disconnect at which every client socket is probed (one whose route
# is not yet let go of at the first probe is found at a later one)
DISCONNECT_PROBES = (0.0, 0.01, 0.04, 0.1, 0.25, 0.5, 1.0)
# A HELLO that finds the daemon full looks for sessions of closed sockets at most this often: every
# look costs a send per client socket, and a HELLO loop must not turn into a send storm.
PROBE_INTERVAL = 0.1
_AFTER_A_STORM = next(i for i, delay in enumerate(DISCONNECT_PROBES) if delay >= PROBE_INTERVAL)
# How long the last messages as the daemon stops (replies waiting in backlogs, then the STOPPING
# notices) may each take to reach their clients: bounded, so a client that reads nothing cannot hold
# the exit up.
STOP_LINGER_MS = 1000


def heartbeat_timeout(client_timeout: float) -> float:
    """Seconds a connection may go without answering ZeroMQ's heartbeats before the socket closes
    it: twice ``client_timeout``, and at least two seconds, so a loaded host that is slow to run a
    live peer's I/O thread does not cut it off (its session would end at ``client_timeout`` anyway)."""
    return max(2 * client_timeout, 2.0)


def reap_interval(client_timeout: float) -> float:
    """How often silent clients are looked for: a client gone silent is dropped within
    ``client_timeout + reap_interval(client_timeout)`` of its last message."""
    return max(client_timeout / 4, 0.05)


@dataclass
class _Backlog:
    """A client's replies the socket could not take yet, oldest first, and their bytes."""

    frames: collections.deque[bytes] = field(default_factory=collections.deque)
    nbytes: int = 0

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.nbytes += len(frame)

    def popleft(self) -> None:
        self.nbytes -= len(self.frames.popleft())

    def clear(self) -> None:
        self.frames.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.frames)


class Server:
    def __init__(self, service: Service, config: DaemonConfig,
                 observe: Callable[[str, float], None] | None = None):
        self.service = service
        self.config = config
        self.observe = observe  # (op, seconds to answer) per request, for the latency histogram
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._sync: zmq.backend.Socket  # bind() makes it: self._sock without asyncio's futures
        self._pack = packer()  # the replies' encoder: the loop's thread alone packs them
        self._auth: AsyncioAuthenticator | None = None  # the ZAP authenticator of a tcp:// (CURVE) socket
        self._backlog: dict[bytes, _Backlog] = {}  # by peer
        self._flusher: asyncio.Task | None = None
        # while serving: what serve() waits on, which only what _answer_queued raises resolves
        self._stopped: asyncio.Future | None = None
        self._looked_for: asyncio.Handle | None = None  # _answer_queued's next run, once asked for (_look_again)
        self._in_turn = False  # _answer_queued runs: it reads EVENTS after each reply it sends
        self._probed = -PROBE_INTERVAL  # time.monotonic() of the last look for closed client sockets
        self._monitor: zmq.asyncio.Socket | None = None  # bind() makes it: the socket's disconnects
        self._disconnects = 0  # disconnects the monitor has reported

    def bind(self) -> None:
        path = ipc_path(self.config.socket)
        if path is not None:
            ensure_private_dir(path.parent)
            if path.exists():
                if socket_is_live(path):
                    raise RuntimeError(f"{path}: another stormd is serving this socket; stop it first")
                log.warning("removing stale socket %s (its daemon is gone)", path)
                path.unlink()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_size)
        # ZeroMQ's own heartbeats (ZMTP PING, which the peer's libzmq answers on its I/O thread) close
        # the connection of a peer that no longer answers at all, a stopped or vanished process, and
        # with it what libzmq queues for it: its session ends by the clients' PING messages
        # (client_timeout), which ZMTP heartbeats cannot replace here: a ROUTER learns of no
        # disconnect without ZMQ_ROUTER_NOTIFY, a draft option that libzmq 4.3 builds refuse, and a
        # PONG says the peer's I/O thread runs, not that the process still serves its training
        timeout = heartbeat_timeout(self.config.client_timeout)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(timeout * 1000 / 4))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
        if self.config.socket.startswith("tcp://"):
            self._auth = secure_server(sock, self._ctx, self.config.curve_secret_key,
                                       self.config.curve_authorized_keys)
        sock.bind(self.config.socket)
        if path is not None:
            path.chmod(0o600)
        self._sock = sock
        # for what never waits (NOBLOCK receives and sends), which asyncio's futures only slow down; the
        # Cython socket itself, not pyzmq's Python layer over it, which each call went through too
        self._sync = zmq.backend.Socket(shadow=sock.underlying)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # _end_sessions_on_disconnect

    async def serve(self) -> None:
        """Answer requests until cancelled; then release the socket."""
        assert self._sock is not None, "bind() first"
        reaper = asyncio.create_task(self._reap_silent_clients())
        watcher = asyncio.create_task(self._end_sessions_on_disconnect())
        loop = asyncio.get_running_loop()
        fd = cast(int, self._sync.get(zmq.FD))
        # Requests are taken through the synchronous socket by the loop's callback on ZeroMQ's
        # descriptor itself (_answer_queued), not by a task it wakes: an await per wakeup (a future,
        # a task step) costs the loop more host time than answering a request does, and with one
        # rank every request waits for it in turn. The descriptor signals any change of the
        # socket's state, not a message, so EVENTS decides.
        self._stopped = loop.create_future()
        self._looked_for = None
        loop.add_reader(fd, self._answer_queued)
        self._look_again()  # what came before the reader was added
        try:
            await self._stopped  # resolves only with what the answering raised past _answer
        finally:
            loop.remove_reader(fd)
            if self._looked_for is not None:
                self._looked_for.cancel()
            self._stopped = None
            reaper.cancel()
            watcher.cancel()
            try:
                await self._send_waiting_replies()
            finally:  # a second signal cancels the wait: the socket still closes
                self.close()

    def _answer_queued(self) -> None:
        """Answer the requests ZeroMQ has already received, up to ANSWERED_IN_TURN of them, then
        give the loop's other callbacks and tasks (the reaper, backlogs, a drain) a turn before the
        next ones: under a load that never lets the queue empty they would otherwise wait for a quiet
        moment. Called on ZeroMQ's descriptor turning readable, and by _look_again."""
        self._looked_for = None
        self._in_turn = True
        try:
            for _ in range(ANSWERED_IN_TURN):
                frames = self._next_queued()
                if frames is None:
                    return  # EVENTS read after the last request: the next one signals the descriptor again
                try:
                    self._answer(frames)
                except Exception:  # a bug in one answer (or in ending a gone peer's sessions) costs that alone
                    log.exception("answering a request failed; serving on")
            self._look_again()  # more may be queued: after the others' turn
        except BaseException as e:  # the socket failed (or a test stops it): serve() raises it
            if self._stopped is not None and not self._stopped.done():
                self._stopped.set_exception(e)
            else:
                raise
        finally:
            self._in_turn = False

    def _look_again(self) -> None:
        """Have _answer_queued look at the socket once the loop's ready callbacks have run, unless it
        is asked to already."""
        if self._looked_for is None and self._stopped is not None:
            self._looked_for = asyncio.get_running_loop().call_soon(self._answer_queued)

    async def _send_waiting_replies(self) -> None:
        """As the daemon stops: the replies clients have not made room for yet go, in order, as they
        read, for at most STOP_LINGER_MS (a client that reads nothing does not hold the exit up).
        Dropped at once, a client reading on got the STOPPING notice in place of answers to requests
        stormd had served."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.wait({self._flusher}, timeout=STOP_LINGER_MS / 1000)

    def _next_queued(self) -> list[bytes] | None:
        """The next request ZeroMQ has already received (its frames, the peer's routing id first), or
        None. Reading EVENTS takes the descriptor's signal."""
        sock = self._sync
        if not sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int, as every option but the bytes ones
            return None
        # frame by frame, as recv_multipart would, less its look at RCVMORE after the routing id (a
        # ROUTER marks it more to follow, always)
        frames = [sock.recv(_NOBLOCK), sock.recv(_NOBLOCK)]
        while sock.get(_RCVMORE):
            frames.append(sock.recv(_NOBLOCK))
        return frames

    def _answer(self, frames: list[bytes]) -> None:
        started = perf_counter()
        peer = frames[0]
        msg = None
        if len(frames) != 2:
            reply = self.service.refuse(0, ProtocolError(ErrorCode.BAD_MESSAGE,
                                                         f"expected one frame per message, got {len(frames) - 1}"))
        else:
            try:
                # within the largest valid request's limits: no frame holds the loop up for long
                msg = unpack_request(frames[1])
                if isinstance(msg, dict) and msg.get("op") == "HELLO" and self.service.sessions.full():
                    self._end_sessions_of_closed_sockets()
                reply = self.service.handle_message(msg, peer)
            except ProtocolError as e:
                reply = self.service.refuse(0, e)
        self._send(peer, reply)
        seconds = perf_counter() - started
        traffic = self.service.traffic
        traffic.requests += 1
        traffic.busy_s += seconds
        if self.observe is not None:
            op = msg.get("op") if isinstance(msg, dict) else None
            self.observe(op if isinstance(op, str) and op in _OP_NAMES else "invalid", seconds)  # a bounded label set

    def _send(self, peer: bytes, reply: dict) -> None:
        frame = self._pack(reply)
        backlog = self._backlog.get(peer)
        if backlog is None:
            if self._try_send(peer, frame):
                return
            backlog = self._backlog[peer] = _Backlog()
            if self._flusher is None or self._flusher.done():
                self._flusher = asyncio.get_running_loop().create_task(self._flush_backlogs())
        backlog.append(frame)  # behind the replies already waiting, so the client reads them in order
        if len(backlog) > self.config.client_max_backlog or backlog.nbytes > self.config.client_max_backlog_bytes:
            self._cut_off(peer, backlog)

    def _try_send(self, peer: bytes, frame: bytes) -> bool:
        """Send now if the peer's pipe has room. False: it is full (retry later); True: sent, or the
        peer is gone (its sessions are ended)."""
        sock = self._sync
        try:  # never waits, so the loop needs no future; the flags as plain ints, as enum arithmetic costs more
            sock.send(peer, _MORE_NOBLOCK)  # a full pipe or a gone peer fails here, before the reply is queued
            sock.send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as err:
            if err.errno == zmq.EHOSTUNREACH:
                self._peer_gone(peer, "its socket is gone")
            else:  # nothing else is expected; one lost reply (its client times out) beats a daemon down for all
                log.error("reply to a client could not be sent", extra={"error": repr(err)})
        finally:
            if not self._in_turn:  # the send may have taken the descriptor's signal of a request waiting
                self._look_again()
        return True

    def _end_sessions_of_closed_sockets(self) -> None:
        """A crash loop would fill max_sessions with the sessions of closed sockets before their
        disconnects are seen: a HELLO that finds the daemon full probes first (_probe_peers)."""
        now = time.monotonic()
        if now - self._probed < PROBE_INTERVAL:
            return
        self._probed = now
        self._probe_peers()

    def _probe_peers(self) -> None:
        """End the sessions of every client socket that is gone: one ZeroMQ cannot route to
        (ROUTER_MANDATORY), which a probe finds now."""
        for peer in self.service.sessions.peers():
            self._try_send(peer, PROBE)  # a full pipe (alive, or stopped: heartbeats end that) is left alone

    async def _end_sessions_on_disconnect(self) -> None:
        """A process that exits or is killed without BYE would hold its sessions, and the pool's
        extents they own, until client_timeout of silence; its socket closes at once, though, and
        ZeroMQ's monitor says so (not whose: a ROUTER learns of no disconnect by peer, see bind).
        Each disconnect probes every client socket: the closed one's sessions end now. The socket's
        thread lets go of a closed connection's route a moment after the event, so the probes go
        on at DISCONNECT_PROBES' delays after the latest disconnect. Events are read as they come:
        ZeroMQ's thread blocks on a monitor whose queue is full, and with it every client's I/O."""
        assert self._monitor is not None, "bind() first"
        prober: asyncio.Task | None = None
        try:
            while True:
                await self._monitor.recv_multipart()
                self._disconnects += 1
                if prober is None or prober.done():
                    prober = asyncio.create_task(self._probe_after_disconnects())
        finally:
            if prober is not None:
                prober.cancel()

    async def _probe_after_disconnects(self) -> None:
        """Probe every client socket at DISCONNECT_PROBES' delays after a disconnect. One seen
        meanwhile starts the schedule again from its first delay of at least PROBE_INTERVAL: a storm
        of disconnects probes every PROBE_INTERVAL, and the last probe comes a second after the last."""
        seen, start, step = self._disconnects, time.monotonic(), 0
        while step < len(DISCONNECT_PROBES):
            await asyncio.sleep(max(0.0, start + DISCONNECT_PROBES[step] - time.monotonic()))
            try:
                self._probe_peers()
            except Exception:  # ending a gone peer's sessions failed: the reaper's timeout still ends them
                log.exception("ending the sessions of a closed client socket failed")
            step += 1
            if seen != self._disconnects:
                seen, start, step = self._disconnects, time.monotonic(), _AFTER_A_STORM

    def _peer_gone(self, peer: bytes, why: str) -> None:
        backlog = self._backlog.pop(peer, None)
        if backlog is not None:
            backlog.clear()  # nobody is left to read them
        for s in self.service.sessions.by_peer(peer):
            self.service.end_session(s, why)

    def _cut_off(self, peer: bytes, backlog: _Backlog) -> None:
        sessions = [s.id for s in self.service.sessions.by_peer(peer)]
        limits = {"client_max_backlog": self.config.client_max_backlog,
                  "client_max_backlog_bytes": self.config.client_max_backlog_bytes}
        log.error("client cut off: it does not read its replies", extra={
            "sessions": sessions, "unread_replies": len(backlog), "unread_bytes": backlog.nbytes, **limits})
        self._peer_gone(peer, f"it left {len(backlog)} replies unread ({backlog.nbytes} bytes; "
                              + ", ".join(f"{k} {v}" for k, v in limits.items()) + ")")

    async def _flush_backlogs(self) -> None:
        """Retry waiting replies until every backlog is empty. ROUTER cannot say which peer became
        writable, so poll; this runs only while some client is behind on its replies."""
        while self._backlog:
            await asyncio.sleep(BACKLOG_RETRY)
            for peer, backlog in list(self._backlog.items()):
                try:
                    while backlog and self._try_send(peer, backlog.frames[0]):
                        if backlog:  # sent; not where the peer was found gone (_peer_gone emptied it)
                            backlog.popleft()
                except Exception:  # ending a gone peer's sessions failed: that peer's replies go, the others' wait
                    log.exception("flushing a client's replies failed; they are dropped")
                    backlog.clear()
                if not backlog:
                    self._backlog.pop(peer, None)

    async def _reap_silent_clients(self) -> None:
        """Runs as long as the server: whatever one round raises is logged and the next round runs."""
        timeout = self.config.client_timeout
        while True:
            await asyncio.sleep(reap_interval(timeout))
            try:
                self.service.settle_copies()  # extents that waited for CUDA copies, when no request came
            except Exception:
                log.exception("releasing extents after CUDA copies failed")
            for s in self.service.sessions.silent_since(time.monotonic() - timeout):
                try:
                    self.service.end_session(s, f"no message for {timeout:g} s")
                except Exception:
                    log.exception("ending a silent client's session failed", extra={"session": s.id})

    def _tell_stopping(self, sock: zmq.asyncio.Socket) -> None:
        """After a drain, tell each client socket that still holds a session that the daemon stops and
        why (protocol.py's STOPPING): an idle client, whose pings would go unanswered, would otherwise
        take the drain for a daemon killed. Best effort: a full pipe or a gone socket is passed over."""
        if not self.service.draining:
            return
        frame = pack(notice(stopping=True, **self.service.drain_fields()))
        for peer in self.service.sessions.peers():
            sock.send_multipart([peer, frame], flags=zmq.NOBLOCK)  # resolves at once; a failure stays in it

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._monitor is not None:
            # first: closed while still monitored, ZeroMQ's thread would block on the events of the
            # connections closing now, and the context's term with it
            if self._sock is not None:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._tell_stopping(self._sock)
            self._sock.close(linger=STOP_LINGER_MS)
            self._sock = None
            path = ipc_path(self.config.socket)
            if path is not None:
                path.unlink(missing_ok=True)
        self._ctx.term()

