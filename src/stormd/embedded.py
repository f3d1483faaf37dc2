"""The daemon's request handling inside a client process: the one entry point of the embedded store.

``storm``'s embedded store (storm/embedded.py), what ``mode='auto'`` falls back
to when no daemon answers, runs every request through the daemon's own Service
and Store by design, so that it behaves as stormd does. It reaches them through
``embedded_service`` alone, not by importing the daemon's modules, so the
daemon's internals stay free to change behind this function
(tests/test_imports.py holds the client to it).
"""

from __future__ import annotations

from typing import Callable

from .growth import GROWTH_ALIGNMENT, MIN_GROWTH, PoolGrowth
from .host_share import join_host
from .limits import host_room
from .service import Service
from .store_options import StoreOptions
from .wire.cuda import grow_pool, unregister_pool
from .wire.pool import SharedPool
from .wire.sizes import format_size

INITIAL_POOL = 256 << 20  # a growing pool's start: enough for small models without a growth


def embedded_service(pool_size: int | None, room: Callable[[], tuple[int, str]] = host_room,
                     extend: Callable[[SharedPool, int], None] = grow_pool, initial: int = INITIAL_POOL,
                     min_step: int = MIN_GROWTH, ledger: str | None = None) -> Service:
    """A Service over a new pool for one process's own requests: no session logging (the process is
    its only client), and no spill to disk (the embedded store's pool is its whole budget).

    ``pool_size``: the pool's fixed size, refused (ValueError) past ``room()``. None: the pool grows
    on demand, from ``initial`` bytes by at least ``min_step``, up to a cap that the embedded stores
    of the host share through the ledger in ``ledger`` (host_share.join_host: /dev/shm when None),
    from ``room()``'s bytes and where they come from (free host memory and the memory cgroup;
    pool_text says it for the log); ``extend`` grows it. The parameters after ``pool_size`` let a
    test stand in a host and a pool of its own."""
    options = StoreOptions(spill_off="the embedded store does not spill to disk")
    if pool_size is not None:
        cap, source = room()
        if pool_size > cap:  # the mapping is lazy: it would not fail now but when training fills it (OOM)
            raise ValueError(f"pool_size {format_size(pool_size)} is more than this host can give a pool now "
                             f"({format_size(cap)}: {source}); give a smaller pool_size (or STORM_POOL_SIZE), "
                             f"or none: the pool then grows on demand up to that")
        return Service(SharedPool.anonymous(pool_size), log_sessions=False, store_options=options)
    share = join_host(room, ledger)
    try:
        with share.turn():
            cap = max(share.cap - share.cap % GROWTH_ALIGNMENT, GROWTH_ALIGNMENT)
            now, _ = share.allowance(0)
            # whole pages, as growths add; no more than the share grants now, yet never less than a page
            start = min(initial, now, cap)
            start = max(start - start % GROWTH_ALIGNMENT, GROWTH_ALIGNMENT)
            pool = SharedPool.anonymous(start, reserve=cap)
            share.record(pool.size)
    except BaseException:
        share.close()
        raise
    return Service(pool, log_sessions=False, store_options=options,
                   growth=PoolGrowth(pool, share, extend, min_step))


def close_service(service: Service) -> None:
    """Close an embedded_service's pool and give back its share of the host."""
    unregister_pool(service.pool)
    service.pool.close()
    if service.store.growth is not None:
        service.store.growth.close()


def pool_text(service: Service) -> str:
    """The pool of an embedded_service in words, for the log line that announces the embedded store:
    its size, or, when it grows, its start, its cap, where the cap comes from and what it is shared
    with."""
    growth = service.store.growth
    if growth is None:
        return f"{format_size(service.pool.size)} pool"
    return (f"pool of {format_size(service.pool.size)} that grows on demand up to {format_size(growth.cap)}: "
            f"{growth.share.source}; {growth.share.shared_with}; pool_size= fixes its size")
