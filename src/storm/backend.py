"""What the hooks need from a store: a request verb and the pool it hands out extents of.

Two implementations: ``DaemonConnection`` (stormd over ZeroMQ) and
``EmbeddedStore`` (the same Service, in this process). ``open_backend``
chooses between them for ``mode='auto' | 'daemon' | 'embedded'`` and holds
one per process and endpoint, so every step reuses its session and pool.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Protocol

from stormd.wire.endpoint import ipc_path, socket_is_live
from stormd.wire.pool import SharedPool

from .errors import StormNoDaemon, StormUnavailable
from .options import mode_option, pool_size_option, socket_option
from .replies import Resolved
from .trust import open_checked_socket

log = logging.getLogger("storm")


class Backend(Protocol):
    pool: SharedPool
    name: str
    alive: bool  # False once a daemon connection has lost its daemon
    codec: str   # how the store asks for tensors to be encoded (HELLO; CUDA: frames or raw)
    cuda_devices: frozenset[str]  # UUIDs of the GPUs whose memory the store copies itself (CUDA IPC)

    def request(self, op: str, **fields: Any) -> Future | Resolved:
        """Send a request; the future gives the reply's fields or raises StormRequestError."""

    def close(self) -> None: ...


_lock = threading.Lock()
_backends: dict[tuple, Backend] = {}
_announced: set[str] = set()


def open_backend(mode: str, socket: str | None = None, pool_size: str | int | None = None) -> Backend:
    """The process's backend for this mode and endpoint, created on first use."""
    mode = mode_option(mode)
    endpoint = socket_option(mode, socket)
    size = pool_size_option(pool_size)
    with _lock:
        if mode in ("auto", "daemon"):
            b = _backends.get(("daemon", endpoint))
            if b is not None and b.alive:
                return b
            if b is not None:  # the daemon went away: try it afresh (it may have been restarted)
                del _backends[("daemon", endpoint)]
                b.close()
            try:
                b = _connect(endpoint)
                _backends[("daemon", endpoint)] = b
                _announce(f"storm: offloading through {b.name}")
                return b
            except StormUnavailable as e:
                if mode == "daemon":
                    raise
                # quiet only when no daemon is there: one that answered and cannot be used (its pool
                # cannot be mapped, it refused the session, it is not trusted) is worth a warning
                why, level = str(e), logging.INFO if isinstance(e, StormNoDaemon) else logging.WARNING
        else:
            why, level = "mode='embedded'", logging.INFO
        b = _backends.get(("embedded", size))
        if b is None:
            from .embedded import EmbeddedStore
            b = _backends[("embedded", size)] = EmbeddedStore(size)  # a pool that grows when size is None
        _announce(f"storm: using the embedded store ({b.pool_text}): {why}", level)
        return b


def _connect(endpoint: str) -> Backend:
    from .connection import DaemonConnection
    path = ipc_path(endpoint)
    if path is None:
        return DaemonConnection(endpoint)
    # Checked before anything reaches the socket, the liveness probe included; from here on the socket
    # is reached only through the directory that was checked (storm/trust.py says why)
    checked = open_checked_socket(path)
    try:
        if not socket_is_live(checked.via):
            raise StormNoDaemon(f"stormd socket {path} is left over from a daemon that is gone; "
                                f"restart stormd, or use mode='embedded'")
        return DaemonConnection(endpoint, checked=checked)  # it closes ``checked`` when it closes
    except BaseException:
        checked.close()  # closes once: a no-op if the connection already did
        raise


def _announce(line: str, level: int = logging.INFO) -> None:
    if line not in _announced:  # once per process and mode: nothing per step
        _announced.add(line)
        log.log(level, line)


def close_backends() -> None:
    """Close every backend of this process (BYE to daemons)."""
    with _lock:
        for b in _backends.values():
            b.close()
        _backends.clear()
        _announced.clear()

