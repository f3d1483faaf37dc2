"""Session lifecycle: who is connected, their token, when they were last heard from.

A session starts at HELLO and ends at BYE, when its heartbeats stop, or when
the daemon can no longer reach it; the store frees everything it held then.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator

from .protocol import ErrorCode, ProtocolError


@dataclass
class Session:
    id: int
    token: str
    pid: int
    host: str
    peer: bytes | None  # the ZeroMQ routing id of the client's socket; None in embedded mode
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)

    def open(self, pid: int, host: str, peer: bytes | None) -> Session:
        s = Session(next(self._ids), secrets.token_hex(16), pid, host, peer)
        self._sessions[s.id] = s
        return s

    def authenticate(self, session_id: int, token: str) -> Session:
        s = self._sessions.get(session_id)
        # compare_digest so a wrong token takes as long as a right one
        if s is None or not hmac.compare_digest(s.token.encode(), token.encode()):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, f"no session {session_id} with that token (it may have timed out)")
        s.last_seen = time.monotonic()
        return s

    def close(self, session_id: int) -> Session | None:
        return self._sessions.pop(session_id, None)

    def silent_since(self, deadline: float) -> list[Session]:
        """Sessions not heard from since ``deadline`` (time.monotonic())."""
        return [s for s in self._sessions.values() if s.last_seen < deadline]

    def by_peer(self, peer: bytes) -> list[Session]:
        return [s for s in self._sessions.values() if s.peer == peer]

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)
