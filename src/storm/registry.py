"""The process's store sessions: one per mode, endpoint and pool size, which every step and every
thread of the process shares (a session holds a Mover, a worker thread of its own), closed at exit."""

from __future__ import annotations

import atexit
import threading

from .backend import close_backends, open_backend
from .options import mode_option, pool_size_option, socket_option
from .session import ClientSession

_sessions: dict[tuple, ClientSession] = {}  # (mode, endpoint, pool size) -> its session
# Threads that begin their first steps together must share one session: each would build a Mover of its own.
_sessions_lock = threading.Lock()


def session_for(mode: str, socket: str | None, pool_size: str | int | None) -> ClientSession:
    """The process's session for this mode, endpoint and pool size, reused by every step: over the store
    open_backend gives now (the one before, a daemon that stopped, stays the session's for what it holds)."""
    mode = mode_option(mode)
    endpoint, size = socket_option(mode, socket), pool_size_option(pool_size)
    backend = open_backend(mode, endpoint, size)
    key = (mode, endpoint if mode != "embedded" else None, size if mode != "daemon" else None)
    with _sessions_lock:
        s = _sessions.get(key)
        if s is None:
            reopen = (lambda: open_backend(mode, endpoint, size)) if mode == "auto" else None
            s = _sessions[key] = ClientSession(backend, reopen=reopen)
        s.use(backend)
        return s


def session_used(mode: str, socket: str | None) -> ClientSession:
    """The session of this mode and endpoint that a step took last, whatever its pool size (storm.stats
    reads it: a session opened for its pool size would be another one, with a new pool); without
    one, the session for the default pool size."""
    mode = mode_option(mode)
    endpoint = socket_option(mode, socket)
    where = (mode, endpoint if mode != "embedded" else None)  # session_for's key, less the pool size
    with _sessions_lock:
        used = [s for key, s in _sessions.items() if key[:2] == where]
    if used:
        return max(used, key=lambda s: s.last_step)
    return session_for(mode, socket, None)


def close_all() -> None:
    """Finish the copies in flight and close every session and backend of this process."""
    with _sessions_lock:
        for s in _sessions.values():
            s.close()
        _sessions.clear()
    close_backends()


atexit.register(close_all)
