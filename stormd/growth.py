"""How the embedded store's pool grows on demand, up to a cap, when a PUT does not fit.

stormd's pool is fixed: operators size it. The embedded store's users do not
know their activation bytes in advance, so its pool starts modest and grows
in place (SharedPool.grow: the mapping reserved the cap's address space at
the start, so tensors already stored keep their offsets and addresses). Each
growth doubles the pool, by at least ``min_step``, and never past the cap,
which stormd/limits.host_room derives from free RAM and the memory cgroup;
past it, or when a growth fails (the page-lock of what it adds, the mapping),
the PUT is POOL_FULL with the reason, as a full fixed pool is.
"""

from __future__ import annotations

from typing import Callable

from .wire.cuda import grow_pool
from .wire.pool import SharedPool
from .wire.sizes import format_size

MIN_GROWTH = 256 << 20  # few growths, each a page-lock call when the pool is page-locked
GROWTH_ALIGNMENT = 2 << 20  # whole pages (huge ones too), so no page is locked twice


class GrowthRefused(RuntimeError):
    """The pool cannot grow; the message says why (its cap, or the failure)."""


class PoolGrowth:
    """The pool's growth policy: ``extend(pool, size)`` grows it (grow_pool: page-locks what it adds
    where the pool is page-locked); a test stands in one that fails."""

    def __init__(self, pool: SharedPool, cap: int, source: str,
                 extend: Callable[[SharedPool, int], None] = grow_pool, min_step: int = MIN_GROWTH):
        self.pool = pool
        self.cap = cap
        self.source = source  # where the cap comes from, for the log and POOL_FULL's reason
        self.min_step = min_step
        self._extend = extend

    def grow(self, nbytes: int) -> int:
        """Grow the pool so that ``nbytes`` more fit (to twice its size, at least ``min_step`` more,
        at most the cap); returns its new size. Raises GrowthRefused, the pool unchanged, naming why."""
        size = self.pool.size
        if size >= self.cap:
            raise GrowthRefused(f"the pool is at its cap of {format_size(self.cap)} ({self.source}); "
                                f"free host memory, or set pool_size to fix the pool's size")
        target = max(2 * size, size + self.min_step, size + nbytes)
        target = min(-(-target // GROWTH_ALIGNMENT) * GROWTH_ALIGNMENT, self.cap)
        try:
            self._extend(self.pool, target)
        except (OSError, MemoryError, RuntimeError) as e:
            raise GrowthRefused(f"growing the pool from {format_size(size)} to {format_size(target)} "
                                f"failed: {e}") from None
        return self.pool.size
