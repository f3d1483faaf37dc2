"""How the embedded store's pool grows on demand, up to a cap, when a PUT does not fit.

stormd's pool is fixed: operators size it. The embedded store's users do not
know their activation bytes in advance, so its pool starts modest and grows
in place (SharedPool.grow: the mapping reserved the cap's address space at
the start, so tensors already stored keep their offsets and addresses). Each
growth adds a quarter of the pool (GROWTH_SHARE), at least ``min_step`` and at
least what the PUT needs, and never past what the
host's share grants it (host_share.py: the cap, which stormd/limits.host_room
derives from free RAM and the memory cgroup, shared by the embedded stores of
the host, and the free memory of the moment); past it, or when a growth fails
(the page-lock of what it adds, the mapping), the PUT is POOL_FULL with the
reason, as a full fixed pool is.
"""

from __future__ import annotations

from typing import Callable

from .host_share import HostShare
from .wire.cuda import grow_pool
from .wire.pool import SharedPool
from .wire.sizes import format_size

MIN_GROWTH = 256 << 20  # few growths, each a page-lock call when the pool is page-locked
# a growth adds 1/GROWTH_SHARE of the pool: page-locking costs by the byte, not by the call, and what a
# growth adds past the step's need stays page-locked (doubling left up to half the pool unused)
GROWTH_SHARE = 4
GROWTH_ALIGNMENT = 2 << 20  # whole pages (huge ones too), so no page is locked twice


class GrowthRefused(RuntimeError):
    """The pool cannot grow; the message says why (its cap, or the failure)."""


class PoolGrowth:
    """The pool's growth policy: ``extend(pool, size)`` grows it (grow_pool: page-locks what it adds
    where the pool is page-locked); a test stands in one that fails."""

    def __init__(self, pool: SharedPool, share: HostShare,
                 extend: Callable[[SharedPool, int], None] = grow_pool, min_step: int = MIN_GROWTH):
        """``pool``: reserved up to the cap; ``share``: its part of the host, which it leaves at close."""
        self.pool = pool
        self.cap = pool.reserved
        self.share = share  # where the cap comes from and what it is shared with: the log, POOL_FULL's reason
        self.min_step = min_step
        self._extend = extend

    def grow(self, nbytes: int) -> int:
        """Grow the pool so that ``nbytes`` more fit (by a quarter of its size, at least ``min_step``
        more, at most what the share grants); returns its new size. Raises GrowthRefused, the pool
        unchanged, naming why."""
        size = self.pool.size
        target = size + max(size // GROWTH_SHARE, self.min_step, nbytes)
        target = -(-target // GROWTH_ALIGNMENT) * GROWTH_ALIGNMENT
        with self.share.turn():
            limit, why = self.share.allowance(size)
            limit = min(limit - limit % GROWTH_ALIGNMENT, self.cap)
            if size >= limit:
                raise GrowthRefused(f"the pool is at its cap of {format_size(size)} ({why}); "
                                    f"free host memory, or set pool_size to fix the pool's size")
            target = min(target, limit)
            try:
                self._extend(self.pool, target)
            except (OSError, MemoryError, RuntimeError) as e:
                raise GrowthRefused(f"growing the pool from {format_size(size)} to {format_size(target)} "
                                    f"failed: {e}") from None
            self.share.record(self.pool.size)
        return self.pool.size

    def close(self) -> None:
        """Leave the host's share, once the pool is closed."""
        self.share.close()
