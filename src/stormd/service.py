"""Request handling, free of any transport: the daemon's server and the client's
embedded store both run every request through ``Service.handle``."""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .allocator import ExtentAllocator
from .copier import CudaCopier
from .entries import Entry
from .growth import PoolGrowth
from .sessions import Session, SessionLimits, SessionTable
from .store import Store
from .store_options import StoreOptions
from .wire.pool import SharedPool
from .wire.protocol import (
    ADMIN_OPS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    Request,
    error,
    ok,
    pack,
    parse_request,
    request_id,
)

log = logging.getLogger("stormd")

SERVER_NAME = f"stormd/{PROTOCOL_VERSION} on {socket.gethostname()} pid {os.getpid()}"
# CLIENTS lists as many sessions as fit in a message any client decodes (stormctl included);
# the rest of the reply (id, ok, total, the list's header) takes far less than this margin.
CLIENTS_REPLY_BYTES = MAX_MESSAGE_BYTES - 1024
_SESSION_OPS = frozenset({"PUT", "SEAL", "GET", "FREE", "STATS", "BYE"})  # those of a session: its token checked


@dataclass
class Traffic:
    """Totals since start, kept here because a session's own counters go when it ends."""

    puts: int = 0
    gets: int = 0
    bytes_in: int = 0        # bytes of the tensors clients stored (PUT), before encoding
    bytes_out: int = 0       # bytes handed back (GET), as stored
    stored_bytes: int = 0    # what the pool holds for bytes_in: less when clients encode
    requests: int = 0        # requests answered (the server counts them)
    busy_s: float = 0.0      # seconds spent answering them: the event loop's load, which every client waits on


class ErrorSink(Protocol):
    def record(self, code: str, message: str) -> None: ...


class Service:
    def __init__(self, pool: SharedPool, error_log: ErrorSink | None = None, store_options: StoreOptions | None = None,
                 log_sessions: bool = True, codec: str = "raw", cuda: CudaCopier | None = None,
                 session_limits: SessionLimits = SessionLimits(), growth: PoolGrowth | None = None):
        self.pool = pool
        self.codec = codec  # told to clients at HELLO: how to encode CPU tensors
        self.cuda = cuda    # copies CUDA tensors through IPC (stormd/copier.py); None: clients copy them
        # Keys freed while the daemon's copy into or out of them still ran, and sessions that ended
        # so: their extents are released once those copies have finished (settle_copies).
        self._deferred_frees: list[tuple[int, list[int]]] = []
        self._closing: list[int] = []
        # Per session, the entries the daemon's own copies are filling, in the order queued: each is
        # sealed here once its copy has finished, so the client sends no SEAL for them: one request
        # fewer per CUDA tensor, each a send on the training thread and a reply on the client's
        # reader thread.
        self._unsealed: dict[int, collections.OrderedDict[int, Entry]] = {}
        # The daemon logs each connect and disconnect; the embedded store's only session is
        # its own process, so a line about it would only be noise in the training log.
        self.log_sessions = log_sessions
        self.store = Store(ExtentAllocator(pool.size), pool, store_options, growth=growth)
        self.sessions = SessionTable(session_limits)
        self.draining = False
        self.drain: dict[str, Any] = {}  # while draining: why and since when, as clients are told (protocol.py)
        self.errors: dict[str, int] = {}
        self.traffic = Traffic()
        self.started = time.time()
        # seconds from the daemon's process start to serving, set once it serves (stormd/main.py); the
        # embedded store has no start of its own to report
        self.startup_s: float | None = None
        # The daemon logs error replies (rate-limited); the embedded store in a
        # training process passes none, so storm.offload() stays silent.
        self.error_log = error_log

    def handle_message(self, msg: Any, peer: bytes | None = None) -> dict[str, Any]:
        """Validate and run one decoded message; always returns a reply, never raises.

        A ``Request`` is taken as it is: the embedded store builds them in its own
        process, where the schema check would only cost the training thread time."""
        trusted = isinstance(msg, Request)
        try:
            if self._deferred_frees or self._closing or self._unsealed:
                self.settle_copies()  # inside the try: a CUDA failure there costs a reply, not the daemon
            return self.handle(msg if trusted else parse_request(msg), peer)
        except ProtocolError as e:
            # without its traceback: kept in this frame, whose traceback it is, the two would form a
            # cycle holding the caller's frames (in the embedded store, the training thread's, with
            # the tensor it was saving) until the garbage collector ran
            error = e.with_traceback(None)
        except Exception as e:  # a bug must cost one reply, not the daemon
            log.exception("internal error handling %r", msg.op if trusted else msg.get("op") if isinstance(msg, dict)
                          else msg)
            error = ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        return self.refuse(msg.id if trusted else request_id(msg), error)

    def refuse(self, rid: int, e: ProtocolError) -> dict[str, Any]:
        self.errors[e.code] = self.errors.get(e.code, 0) + 1
        if self.error_log is not None:
            self.error_log.record(e.code, e.message)
        return error(rid, e.code, e.message)

    def handle(self, req: Request, peer: bytes | None) -> dict[str, Any]:
        op, f = req.op, req.fields
        if op in _SESSION_OPS:  # the requests of a training step first: they take no other test
            s = self.sessions.authenticate(f["session"], f["token"])
        elif op == "HELLO":
            return self._hello(req, peer)
        elif op == "PING":
            if "session" in f:
                self.sessions.authenticate(f["session"], f.get("token", ""))
            return ok(req.id, time=time.time(), **self.drain_fields())
        elif op in ADMIN_OPS:
            return self._admin(req)
        # the replies as literals, not ok()'s keywords: one call and one dict fewer per request
        if op == "PUT":
            if self.draining:
                raise ProtocolError(ErrorCode.DRAINING, "the daemon is shutting down and takes no new tensors")
            # the daemon's copy queued within the store's PUT: one refused (NO_CUDA, BAD_HANDLE) stores nothing
            # and counts nothing
            cuda = f.get("cuda")
            e = self.store.put(s.id, f, None if cuda is None else self._copy(s.id, cuda, to_host=True))
            if cuda is not None:
                self._unsealed.setdefault(s.id, collections.OrderedDict())[e.key] = e
            traffic = self.traffic
            traffic.puts += 1
            traffic.bytes_in += e.raw_nbytes
            traffic.stored_bytes += e.nbytes
            return {"id": req.id, "ok": True, "offset": e.offset}
        if op == "SEAL":
            if self.cuda is not None and self.cuda.busy(s.id, [f["key"]]):
                raise ProtocolError(ErrorCode.COPY_IN_FLIGHT, f"key {f['key']}: the daemon's copy into it has not "
                                                              f"finished (stormd seals it itself once it has)")
            self.store.seal(s.id, f["key"], f.get("checksum"))
            return {"id": req.id, "ok": True}
        if op == "GET":
            if self._unsealed:
                self._seal_copied(s.id, f["key"])
            # queued within the store's GET: one refused leaves the tensor unfetched (free to spill) and uncounted
            cuda = f.get("cuda")
            e = self.store.get(s.id, f["key"], None if cuda is None else self._copy(s.id, cuda, to_host=False))
            self.traffic.gets += 1
            self.traffic.bytes_out += e.nbytes
            return {"id": req.id, "ok": True, **e.describe()}
        if op == "FREE":
            return {"id": req.id, "ok": True,
                    "freed": self._free(s.id, self.store.keys(s.id, f.get("keys"), f.get("step")))}
        if op == "STATS":
            return ok(req.id, session=self.store.session_stats(s.id), node=self.node_stats())
        if op == "BYE":
            return ok(req.id, freed=self.end_session(s, "said BYE"))
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {op} has no handler")

    def _hello(self, req: Request, peer: bytes | None) -> dict[str, Any]:
        f = req.fields
        if f["version"] != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                f"client speaks protocol {f['version']}, this stormd speaks {PROTOCOL_VERSION}; "
                                f"install matching versions of storm and stormd")
        if self.draining:
            raise ProtocolError(ErrorCode.DRAINING, "the daemon is shutting down")
        s = self.sessions.open(f["pid"], f["host"], peer)
        self.store.open_session(s.id, f.get("name", ""))  # the name picks its quota and priority
        if self.log_sessions:
            log.info("client connected", extra={"session": s.id, "pid": s.pid, "host": s.host})
        return ok(req.id, session=s.id, token=s.token, pool=self.pool.descriptor.to_wire(),
                  server=SERVER_NAME, version=PROTOCOL_VERSION, codec=self.codec,
                  cuda_devices=self.cuda.devices if self.cuda is not None else [])

    def _copy(self, session: int, cuda: dict[str, Any], to_host: bool) -> Callable[[Entry], None]:
        """What queues the daemon's copy of an entry into the pool (``to_host``) or out of it, between
        the pool and the CUDA memory a request's ``cuda`` field names."""
        def copy(e: Entry) -> None:
            copier = self._copier()
            (copier.to_host if to_host else copier.to_device)(session, e.key, cuda, self._address(e), e.nbytes)
        return copy

    def _copier(self) -> CudaCopier:
        if self.cuda is None:
            raise ProtocolError(ErrorCode.NO_CUDA, "this stormd copies no CUDA memory (no GPU, or cuda_ipc is off); "
                                                   "copy CUDA tensors into the pool in the client (leave out 'cuda')")
        return self.cuda

    def _address(self, e: Entry) -> int:
        """Where ``e``'s bytes are in the pool's mapping: an entry a PUT or GET has just placed is there."""
        assert e.offset is not None, f"key {e.key} has no place in the pool"
        return self.pool.address(e.offset, e.nbytes)

    def _free(self, session: int, keys: list[int]) -> int:
        """Free ``keys`` now, except those a CUDA copy may still read or write: those are freed by
        settle_copies once it has finished, so no other PUT gets their extent before that."""
        later = self.cuda.busy(session, keys) if self.cuda is not None else []
        if later:
            self._deferred_frees.append((session, later))
            waiting = set(later)
            keys = [k for k in keys if k not in waiting]
        self.store.free(session, keys=keys)
        return len(keys) + len(later)

    def _seal_copied(self, session: int, key: int) -> None:
        """Seal ``key`` now if the daemon's copy into it has finished, whatever copies queued before
        it still run (a GET must not wait for those); COPY_IN_FLIGHT if it has not."""
        queue = self._unsealed.get(session)
        e = queue.get(key) if queue is not None else None
        if queue is not None and e is not None and not self._seal_if_copied(session, queue, key, e):
            raise ProtocolError(ErrorCode.COPY_IN_FLIGHT, f"key {key}: the daemon's copy into it has not finished; "
                                                          f"GET it once the PUT's done event has fired")

    def _seal_if_copied(self, session: int, queue: collections.OrderedDict[int, Entry], key: int, e: Entry) -> bool:
        """Seal ``e``, queued under ``key``, and take it off ``queue`` once the daemon's copy into it has
        finished; False while the copy runs. An entry freed meanwhile (or freed and stored anew)
        just leaves the queue."""
        if self.store.find(session, key) is e:
            if self._copier().busy(session, [key]):  # only the daemon's CUDA copies leave a key unsealed
                return False
            self.store.seal(session, key, None)
        del queue[key]
        return True

    def _seal_finished(self, pending: dict[int, collections.OrderedDict[int, Entry]]) -> None:
        """Seal the entries of ``pending`` whose copies have finished and put the others back. A
        session's copies run on its own streams and finish about in the order queued, so each queue
        is read from the front up to the first copy still running: a request costs an event query
        or two, not one per copy in flight."""
        for session, queue in pending.items():
            while queue:
                key, e = next(iter(queue.items()))
                if not self._seal_if_copied(session, queue, key, e):
                    break
            if queue:
                self._unsealed[session] = queue

    def settle_copies(self) -> None:
        """Seal what the daemon's CUDA copies have filled and release what waited for copies that
        have finished since (called before each request and by the server's reaper). What waits is
        taken out first: should an event query fail (the GPU's context lost), those keys stay
        unsealed (GET: NOT_SEALED) and taken, rather than failing every request from then on."""
        unsealed, self._unsealed = self._unsealed, {}
        waiting, self._deferred_frees = self._deferred_frees, []
        self._seal_finished(unsealed)
        for session, keys in waiting:
            still = self._copier().busy(session, keys)  # only the daemon's CUDA copies defer a FREE
            stored = set(self.store.keys(session))
            self.store.free(session, keys=[k for k in keys if k not in still and k in stored])
            if still:
                self._deferred_frees.append((session, still))
        closing, self._closing = self._closing, []
        for session in closing:
            self._drop(session)

    def _drop(self, session: int) -> int:
        """Free everything of an ended session, now or (CUDA copies still running) later."""
        self._unsealed.pop(session, None)  # nothing of it is fetched again
        if self.cuda is not None:
            if not self.cuda.idle(session):
                self._closing.append(session)
                return len(self.store.keys(session))
            self.cuda.close_session(session)
            self._deferred_frees = [(sid, keys) for sid, keys in self._deferred_frees if sid != session]
        return self.store.drop_session(session)

    def end_session(self, s: Session, why: str) -> int:
        self.sessions.close(s.id)
        freed = self._drop(s.id)
        if self.log_sessions:
            log.info("client disconnected", extra={"session": s.id, "pid": s.pid, "why": why, "keys_freed": freed})
        return freed

    def node_stats(self) -> dict[str, Any]:
        return {**self.store.node_stats(), "clients": len(self.sessions), "errors": dict(self.errors),
                "cuda_segments": self.cuda.open_segments() if self.cuda is not None else 0,
                "page_locked_bytes": self.pool.page_locked_bytes}

    @property
    def page_lock_s(self) -> float | None:
        """Seconds the daemon took to page-lock its pool at start; None where it page-locked none
        (no CUDA copies of its own: clients page-lock what they copy themselves)."""
        return self.cuda.page_lock_s if self.cuda is not None else None

    def start_draining(self, reason: str) -> None:
        """Refuse new PUTs and HELLOs from now on; GETs, FREEs and BYEs are still answered."""
        if not self.draining:
            self.draining = True
            self.drain = {"reason": reason, "since": time.time()}
            log.info("draining: no new PUT or HELLO; GETs are answered until clients are done",
                     extra={"reason": reason})

    def drain_fields(self) -> dict[str, Any]:
        """What a PING reply, and the notice to clients when the daemon stops, say of a drain: nothing
        while serving. A client learns of the drain from them, not from a silence or a refused PUT."""
        return {"draining": self.drain} if self.draining else {}

    def _admin(self, req: Request) -> dict[str, Any]:
        """stormctl's verbs. They need no session: the socket is private to the daemon's user."""
        if req.op == "DRAIN":
            self.start_draining("DRAIN request")
        if req.op == "CLIENTS":
            return self._clients(req.id)
        return ok(req.id, server=SERVER_NAME, version=PROTOCOL_VERSION, uptime_s=round(time.time() - self.started, 3),
                  startup_s=self.startup_s, page_lock_s=self.page_lock_s, draining=self.draining,
                  traffic=vars(self.traffic).copy(), node=self.node_stats())

    def _clients(self, rid: int) -> dict[str, Any]:
        """One row per session, those holding the most bytes first, as many as fit in
        CLIENTS_REPLY_BYTES; ``total`` counts them all."""
        now = time.monotonic()
        rows: list[dict[str, Any]] = []
        room = CLIENTS_REPLY_BYTES
        for s in sorted(self.sessions, key=lambda s: self.store.held_bytes(s.id), reverse=True):
            row = {"session": s.id, "pid": s.pid, "host": s.host, "connected_s": round(now - s.started, 3),
                   "idle_s": round(now - s.last_seen, 3), **self.store.session_stats(s.id)}
            room -= len(pack(row))
            if room < 0:
                break
            rows.append(row)
        return ok(rid, clients=rows, total=len(self.sessions))
