"""Session lifecycle: who is connected, their token, when they were last heard from.

A session starts at HELLO and ends at BYE, when its heartbeats stop, or when
the daemon can no longer reach it; the store frees everything it held then.
Each session costs the daemon memory, so how many may be open is capped per
client socket (a process opens one; a HELLO loop on one connection is a bug
or an attack) and for the whole daemon.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator

from .wire.protocol import ErrorCode, ProtocolError


@dataclass(frozen=True)
class SessionLimits:
    per_peer: int = 0  # sessions one client socket may hold open; 0: no limit (the embedded store)
    total: int = 0     # sessions of the whole daemon; 0: no limit


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
    def __init__(self, limits: SessionLimits = SessionLimits()) -> None:
        self.limits = limits
        self._sessions: dict[int, Session] = {}
        self._by_peer: dict[bytes, set[int]] = {}
        self._ids = itertools.count(1)

    def open(self, pid: int, host: str, peer: bytes | None) -> Session:
        """A new session; TOO_MANY_SESSIONS past a limit."""
        if self.full():
            raise ProtocolError(ErrorCode.TOO_MANY_SESSIONS,
                                f"stormd serves {len(self._sessions)} sessions, its limit (max_sessions); "
                                f"retry once others have ended, or raise max_sessions")
        mine = self._by_peer.get(peer, set()) if peer is not None else set()
        if self.limits.per_peer and len(mine) >= self.limits.per_peer:
            raise ProtocolError(ErrorCode.TOO_MANY_SESSIONS,
                                f"this connection holds {len(mine)} sessions, its limit (max_sessions_per_peer); "
                                f"a process needs one: end those it no longer uses with BYE")
        s = Session(next(self._ids), secrets.token_hex(16), pid, host, peer)
        self._sessions[s.id] = s
        if peer is not None:
            self._by_peer.setdefault(peer, set()).add(s.id)
        return s

    def authenticate(self, session_id: int, token: str) -> Session:
        s = self._sessions.get(session_id)
        # compare_digest so a wrong token takes as long as a right one
        if s is None or not hmac.compare_digest(s.token.encode(), token.encode()):
            raise ProtocolError(ErrorCode.UNAUTHORIZED,
                                f"no session {session_id} with that token (it may have timed out)")
        s.last_seen = time.monotonic()
        return s

    def close(self, session_id: int) -> Session | None:
        s = self._sessions.pop(session_id, None)
        if s is not None and s.peer is not None:
            mine = self._by_peer[s.peer]
            mine.discard(s.id)
            if not mine:
                del self._by_peer[s.peer]
        return s

    def silent_since(self, deadline: float) -> list[Session]:
        """Sessions not heard from since ``deadline`` (time.monotonic())."""
        return [s for s in self._sessions.values() if s.last_seen < deadline]

    def by_peer(self, peer: bytes) -> list[Session]:
        return [self._sessions[i] for i in sorted(self._by_peer.get(peer, ()))]

    def peers(self) -> list[bytes]:
        """The client sockets that hold sessions."""
        return list(self._by_peer)

    def full(self) -> bool:
        """Whether the next HELLO would be refused for the whole daemon's limit."""
        return bool(self.limits.total) and len(self._sessions) >= self.limits.total

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)
