"""Request handling, free of any transport: the daemon's server and the client's
embedded store both run every request through ``Service.handle``."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from .allocator import ExtentAllocator
from .pool import SharedPool
from .protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError, Request, error, ok, parse_request, request_id
from .sessions import Session, SessionTable
from .store import Store

log = logging.getLogger("stormd")

SERVER_NAME = f"stormd/{PROTOCOL_VERSION} on {socket.gethostname()} pid {os.getpid()}"


class Service:
    def __init__(self, pool: SharedPool):
        self.pool = pool
        self.store = Store(ExtentAllocator(pool.size))
        self.sessions = SessionTable()
        self.draining = False
        self.errors: dict[str, int] = {}

    def handle_message(self, msg: Any, peer: bytes | None = None) -> dict[str, Any]:
        """Validate and run one decoded message; always returns a reply, never raises."""
        try:
            return self.handle(parse_request(msg), peer)
        except ProtocolError as e:
            return self.refuse(request_id(msg), e)
        except Exception as e:  # a bug must cost one reply, not the daemon
            log.exception("internal error handling %r", msg.get("op") if isinstance(msg, dict) else msg)
            return self.refuse(request_id(msg), ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def refuse(self, rid: int, e: ProtocolError) -> dict[str, Any]:
        self.errors[e.code] = self.errors.get(e.code, 0) + 1
        return error(rid, e.code, e.message)

    def handle(self, req: Request, peer: bytes | None) -> dict[str, Any]:
        f = req.fields
        if req.op == "HELLO":
            return self._hello(req, peer)
        if req.op == "PING":
            if "session" in f:
                self.sessions.authenticate(f["session"], f.get("token", ""))
            return ok(req.id, time=time.time())
        s = self.sessions.authenticate(f["session"], f["token"])
        if req.op == "PUT":
            if self.draining:
                raise ProtocolError(ErrorCode.DRAINING, "the daemon is shutting down and takes no new tensors")
            return ok(req.id, offset=self.store.put(s.id, f).offset)
        if req.op == "SEAL":
            self.store.seal(s.id, f["key"], f.get("checksum"))
            return ok(req.id)
        if req.op == "GET":
            return ok(req.id, **self.store.get(s.id, f["key"]).describe())
        if req.op == "FREE":
            if f.get("all"):
                return ok(req.id, freed=self.store.free(s.id))
            return ok(req.id, freed=self.store.free(s.id, keys=f.get("keys"), step=f.get("step")))
        if req.op == "STATS":
            return ok(req.id, session=self.store.session_stats(s.id), node=self.node_stats())
        if req.op == "BYE":
            return ok(req.id, freed=self.end_session(s, "said BYE"))
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {req.op} has no handler")

    def _hello(self, req: Request, peer: bytes | None) -> dict[str, Any]:
        f = req.fields
        if f["version"] != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH,
                                f"client speaks protocol {f['version']}, this stormd speaks {PROTOCOL_VERSION}; "
                                f"install matching versions of storm and stormd")
        if self.draining:
            raise ProtocolError(ErrorCode.DRAINING, "the daemon is shutting down")
        s = self.sessions.open(f["pid"], f["host"], peer)
        log.info("client connected: session %d pid %d host %s", s.id, s.pid, s.host)
        return ok(req.id, session=s.id, token=s.token, pool=self.pool.descriptor.to_wire(),
                  server=SERVER_NAME, version=PROTOCOL_VERSION)

    def end_session(self, s: Session, why: str) -> int:
        self.sessions.close(s.id)
        freed = self.store.drop_session(s.id)
        log.info("client disconnected: session %d pid %d (%s), %d keys freed", s.id, s.pid, why, freed)
        return freed

    def node_stats(self) -> dict[str, Any]:
        return {**self.store.node_stats(), "clients": len(self.sessions), "errors": dict(self.errors)}
