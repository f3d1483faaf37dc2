"""The store's counters: per session (they go when it ends) and for the node since start.

STATS reports both; the node's are also Prometheus metrics (metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SessionCounters:
    puts: int = 0
    gets: int = 0
    bytes_in: int = 0            # as stored (encoded)
    raw_bytes_in: int = 0        # as the tensors were: raw_bytes_in / bytes_in is the compression ratio
    bytes_out: int = 0
    pool_full: int = 0
    quota_refused: int = 0
    held_bytes: int = 0          # its extents' bytes (sizes rounded up to the pool's alignment),
                                 # in the pool or spilled: what the quota counts
    peak_held_bytes: int = 0
    spilled_bytes: int = 0       # of held_bytes, in the spill file now


@dataclass
class NodeCounters:
    """Totals since start (sessions' own counters go when they end)."""

    spilled_total: int = 0       # bytes written to the spill file
    read_back_total: int = 0     # bytes read back from it
    read_back_on_get: int = 0    # read-backs a GET had to wait for (prefetch came too late)
    prefetched: int = 0          # read-backs started before their GET
    spill_write_errors: int = 0  # writes to the spill file that failed (their tensors stayed in the pool)
    spill_read_errors: int = 0   # read-backs that failed (those keys' bytes are lost)
    plan_hits: int = 0
    plan_misses: int = 0
