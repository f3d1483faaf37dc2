"""What a Store is built with: spill on or off, the check_extents ledger, per-client quota, key limit and priority.

stormd takes them from its settings (``StoreOptions.from_config``); the
embedded store builds its own (no spill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import DaemonConfig
from .spill import SpillIO


@dataclass(frozen=True)
class ClientLimits:
    quota: int = 0      # bytes a session may hold (pool + spill); 0: no limit but the pool
    priority: int = 0   # higher stays in the pool longer; lower is spilled first
    max_keys: int = 0   # tensors a session may hold at once; 0: no limit but the store's max_keys


@dataclass(frozen=True)
class StoreOptions:
    spill_dir: str | None = None   # None: spill off (a full pool is POOL_FULL)
    spill_limit: int = 0
    default_limits: ClientLimits = ClientLimits()
    clients: dict[str, ClientLimits] = field(default_factory=dict)  # by the name a client gives in HELLO
    # what POOL_FULL says while spill is off: stormd's settings; the embedded store cannot spill
    spill_off: str = "spill is off (set spill = true and spill_dir to let stormd move old tensors to disk)"
    check_extents: bool = False    # keep a ledger that refuses overlapping extents (ledger.py)
    # Each key costs the daemon memory beside its pool bytes (the entry, its view's shape and strides),
    # and 1-byte PUTs take only 256 pool bytes each: a bound on keys bounds that memory.
    max_keys: int = 1 << 18
    spill_io: SpillIO = field(default_factory=SpillIO)  # how bytes reach the spill file (tests: a failing disk)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> "StoreOptions":
        return cls(config.spill_dir if config.spill else None, config.spill_limit,
                   ClientLimits(config.client_quota, config.client_priority, config.client_max_keys),
                   {name: ClientLimits(row["quota"], row["priority"], config.client_max_keys)
                    for name, row in config.clients.items()},
                   check_extents=config.check_extents, max_keys=config.max_keys)
