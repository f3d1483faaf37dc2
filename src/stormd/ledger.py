"""A ledger of the pool extents the store has given to tensors, to catch a placement bug at once.

Two layers hand out pool bytes: the general allocator, and each session's step
placement (placement.py), which places tensors inside a region it took from that allocator. The
allocator's own ``check`` sees only the regions, not where a placement put
things inside them, so a placement that placed a tensor past its region would
hand out bytes that belong to someone else, and nothing would notice until a
checksum failed (CPU) or never (CUDA copies carry none). The ledger records
every tensor's extent, whoever placed it, and refuses one that leaves the pool
or overlaps a live one, and a release of anything but an extent it recorded.

Each call is O(log n) in the live extents; the store keeps a ledger only when
``check_extents`` is on (tests and debugging), since production pays for the
bookkeeping on every PUT and FREE and a correct placement never needs it.
"""

from __future__ import annotations

from sortedcontainers import SortedDict


class ExtentConflict(AssertionError):
    """An extent was placed over a live one or outside the pool, or released without being placed:
    a bug in the store or the step placement, never the client's doing."""


class ExtentLedger:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._live: SortedDict = SortedDict()  # offset -> (end, owner) of every tensor's live extent

    def place(self, offset: int, nbytes: int, owner: str) -> None:
        """Record ``owner``'s extent [offset, offset + nbytes); raises ExtentConflict, recording nothing,
        when that range leaves the pool or overlaps a live extent."""
        end = offset + nbytes
        if offset < 0 or end > self.capacity:
            raise ExtentConflict(f"{owner} placed at [{offset}, {end}), outside the pool of {self.capacity} bytes")
        live = self._live
        # live extents never overlap each other, so only the last one starting at or before offset
        # and the first one after it can overlap [offset, end)
        i = live.bisect_right(offset)
        for lo, (hi, other) in (live.peekitem(j) for j in (i - 1, i) if 0 <= j < len(live)):
            if lo < end and offset < hi:
                raise ExtentConflict(f"{owner} placed at [{offset}, {end}) overlaps {other} at [{lo}, {hi})")
        live[offset] = (end, owner)

    def release(self, offset: int, nbytes: int) -> None:
        """Remove exactly the extent ``place`` recorded at ``offset``; raises ExtentConflict otherwise."""
        held = self._live.get(offset)
        if held is None or held[0] != offset + nbytes:
            there = "nothing" if held is None else f"{held[1]} at [{offset}, {held[0]})"
            raise ExtentConflict(f"release of [{offset}, {offset + nbytes}) but the ledger holds {there}")
        del self._live[offset]

    def extents(self) -> list[tuple[int, int]]:
        """The live extents as (offset, end), by offset."""
        return [(lo, hi) for lo, (hi, _) in self._live.items()]
