"""The store's records: one stored tensor (``Entry``) and one session's tensors (``SessionEntries``).

An entry says where the tensor's bytes are now (``Where``: the pool, on the way
to or from the spill file, only in the spill file, or lost) and what it takes
to rebuild the tensor from them (dtype, shape, strides, codec, checksum).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from .counters import SessionCounters
from .placement import StepPlacement
from .store_options import ClientLimits


class Where:
    """Where an entry's bytes are."""

    POOL = "pool"
    SPILLING = "spilling"  # in the pool, a copy to the spill file is being written
    SPILLED = "spilled"    # only in the spill file
    LOADING = "loading"    # being read back into a pool extent
    LOST = "lost"          # reading it back failed: its bytes are gone (Entry.lost says why)


@dataclass
class Entry:
    key: int
    step: int
    offset: int | None  # None while spilled
    nbytes: int
    dtype: str
    shape: list[int]
    strides: list[int]
    storage_offset: int
    codec: str
    raw_nbytes: int         # the storage's size before the client encoded it (= nbytes for raw)
    slot: int = 0           # order within its step: the placement's index
    planned: bool = False   # placed in the session's planned region
    sealed: bool = False
    fetched: bool = False   # GET answered: the client may read the extent, so it stays until FREE
    checksum: int | None = None  # None: sealed without one (not verified on GET)
    where: str = Where.POOL
    file_offset: int | None = None
    io: Future | None = None
    lost: str | None = None  # why its bytes are gone (Where.LOST)

    def describe(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "raw_nbytes": self.raw_nbytes, "dtype": self.dtype,
                "shape": self.shape,
                "strides": self.strides, "storage_offset": self.storage_offset, "codec": self.codec,
                "checksum": self.checksum}


@dataclass
class SessionEntries:
    """One session's tensors, its step placement, its limits and counters."""

    placement: StepPlacement
    name: str = ""
    limits: ClientLimits = ClientLimits()
    entries: dict[int, Entry] = field(default_factory=dict)
    counters: SessionCounters = field(default_factory=SessionCounters)
    spilled: SortedList = field(default_factory=SortedList)  # (step, key) of spilled entries: read back last first
    loading: int = 0
