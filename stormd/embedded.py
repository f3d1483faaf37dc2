"""The daemon's request handling inside a client process: the one entry point of the embedded store.

``storm``'s embedded store (client/embedded.py), what ``mode='auto'`` falls back
to when no daemon answers, runs every request through the daemon's own Service
and Store by design, so that it behaves as stormd does. It reaches them through
``embedded_service`` alone, not by importing the daemon's modules, so the
daemon's internals stay free to change behind this function
(tests/test_imports.py holds the client to it).
"""

from __future__ import annotations

from .service import Service
from .store_options import StoreOptions
from .wire.pool import SharedPool


def embedded_service(pool: SharedPool) -> Service:
    """A Service over ``pool`` for one process's own requests: no session logging (the process is
    its only client), and no spill to disk (the embedded store's pool is its whole budget)."""
    return Service(pool, log_sessions=False,
                   store_options=StoreOptions(spill_off="the embedded store does not spill to disk"))
