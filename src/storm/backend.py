"""What the hooks need from a store: a request verb and the pool it hands out extents of.

Two implementations: ``DaemonConnection`` (stormd over ZeroMQ) and
``EmbeddedStore`` (the same Service, in this process). ``open_backend``
chooses between them for ``mode='auto' | 'daemon' | 'embedded'`` and holds
one per process and endpoint, so every step reuses its session and pool.

A daemon that stopped serving this process (its connection's ``loss``) is let
go of here, and its loss kept for the endpoint until a daemon answers there
again: ``mode='daemon'`` raises it (StormDaemonLost: drained, killed,
restarted, since when), ``mode='auto'`` says it once at WARNING and goes on
with the embedded store. The connection itself is the session's that used it
to close (storm/session.py): a draining daemon still hands back what that
session stored in it.

``mode='auto'`` looks for a daemon as each step begins, so that one started
later is used; where none was there to use, it looks again only
PROBE_INTERVAL_S later: each look checks the socket's directory and file (a
tcp:// one waits for an answer), a cost every step of a process without a
daemon would pay.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from stormd.wire.endpoint import ipc_path, socket_is_live
from stormd.wire.pool import SharedPool

from .errors import DaemonLoss, StormNoDaemon, StormUnavailable, StormUntrusted
from .options import mode_option, pool_size_option, socket_option
from .replies import Resolved
from .trust import open_checked_socket

log = logging.getLogger("storm")


class Backend(Protocol):
    pool: SharedPool
    name: str
    store: str   # the store in words, for storm.stats()
    alive: bool  # False once a daemon connection has closed (it lost its daemon, or was closed)
    loss: DaemonLoss | None  # how and since when its daemon stopped serving this process: it takes no new tensors
    codec: str   # how the store asks for tensors to be encoded (HELLO; CUDA: frames or raw)
    cuda_devices: frozenset[str]  # UUIDs of the GPUs whose memory the store copies itself (CUDA IPC)

    def request(self, op: str, **fields: Any) -> Future | Resolved:
        """Send a request; the future gives the reply's fields or raises StormRequestError."""

    def close(self) -> None: ...


_lock = threading.Lock()
_backends: dict[tuple, Backend] = {}
_losses: dict[str, DaemonLoss] = {}  # endpoint -> how its daemon stopped, until one answers there again
_announced: set[object] = set()
# mode='auto': endpoint -> when a look found no daemon there to use (clock's seconds), what it found and
# at which level it was said, until PROBE_INTERVAL_S later
_absent: dict[str, tuple[float, str, int]] = {}
PROBE_INTERVAL_S = 5.0


def open_backend(mode: str, socket: str | None = None, pool_size: str | int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[str], Backend] | None = None) -> Backend:
    """The process's backend for this mode and endpoint, created on first use. ``clock``: seconds,
    for how long ago mode='auto' last found no daemon it could use at the endpoint; ``connect``:
    how a daemon's endpoint is reached (by default, as stormd serves it)."""
    mode = mode_option(mode)
    endpoint = socket_option(mode, socket)
    size = pool_size_option(pool_size)
    with _lock:
        if mode in ("auto", "daemon"):
            b = _backends.get(("daemon", endpoint))
            if b is not None and b.alive and b.loss is None:
                return b
            absent = _absent.get(endpoint)
            if mode == "auto" and b is None and absent is not None and clock() - absent[0] < PROBE_INTERVAL_S:
                return _embedded(size, absent[1], absent[2])  # the line said once already
            if b is not None:  # its daemon stopped: try afresh (it may have been restarted)
                del _backends[("daemon", endpoint)]
                if b.loss is not None:
                    _losses[endpoint] = b.loss
            loss = _losses.pop(endpoint, None)
            try:
                b = (connect or _connect)(endpoint)
            except StormUnavailable as e:
                if loss is None or isinstance(e, StormUntrusted):
                    if mode == "daemon":
                        raise
                    # quiet only when no daemon is there: one that answered and cannot be used (its pool
                    # cannot be mapped, it refused the session, it is not trusted) is worth a warning
                    level = logging.INFO if isinstance(e, StormNoDaemon) else logging.WARNING
                    if loss is None:  # none here to use (a tcp:// look waits out its timeout): not each step
                        _absent[endpoint] = (clock(), str(e), level)
                    return _embedded(size, str(e), level)
                _losses[endpoint] = loss  # what the user needs to hear: the daemon stopped, not that its socket is gone
                if mode == "daemon":
                    raise loss.error() from None
                return _embedded(size, loss, logging.WARNING)
            _backends[("daemon", endpoint)] = b
            _absent.pop(endpoint, None)
            if loss is None:
                _announce(f"storm: offloading through {b.name}")
            else:
                _announce(f"storm: {loss.said()}; offloading through {b.name} from now on", logging.WARNING, loss)
            return b
        return _embedded(size, "mode='embedded'", logging.INFO)


def _embedded(size: int | None, why: str | DaemonLoss, level: int) -> Backend:
    """The process's embedded store for ``size`` (under _lock), said once: why it is used, or that it
    takes the place of a daemon that stopped (``why``, its loss)."""
    b = _backends.get(("embedded", size))
    if b is None:
        from .embedded import EmbeddedStore
        b = _backends[("embedded", size)] = EmbeddedStore(size)  # a pool that grows when size is None
    if isinstance(why, DaemonLoss):
        _announce(f"storm: {why.said()}; offloading to the embedded store ({b.pool_text}) from now on", level, why)
    else:
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


def _announce(line: str, level: int = logging.INFO, once: object = None) -> None:
    """Log ``line`` once per process for ``once`` (default: the line itself): nothing per step."""
    key = line if once is None else once
    if key not in _announced:
        _announced.add(key)
        log.log(level, line)


def close_backends() -> None:
    """Close every backend of this process (BYE to daemons)."""
    with _lock:
        for b in _backends.values():
            b.close()
        _backends.clear()
        _losses.clear()
        _absent.clear()
        _announced.clear()

