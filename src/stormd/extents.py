"""The pool extents the store gives tensors, and where each goes back to.

A tensor's extent comes from its session's step placement (inside the planned
region) or from the general allocator, and goes back to the one it came from.
With ``check_extents`` on, every extent is also recorded in the ledger
(ledger.py), which refuses one that would overlap a live extent, whichever of
the two placed it.
"""

from __future__ import annotations

from .allocator import Allocator
from .entries import Entry, SessionEntries
from .ledger import ExtentConflict, ExtentLedger


class PoolExtents:
    def __init__(self, allocator: Allocator, ledger: ExtentLedger | None = None):
        self.allocator = allocator
        self.ledger = ledger

    def claim(self, session: int, s: SessionEntries, key: int, offset: int, nbytes: int, planned: bool) -> None:
        """Record a tensor's new pool extent in the ledger, when checking. One that overlaps a live extent
        is a placement bug: it is given back and ExtentConflict raised, so the tensor there keeps its bytes."""
        if self.ledger is None:
            return
        try:
            self.ledger.place(offset, self.allocator.aligned(nbytes), f"key {key} of session {session}")
        except ExtentConflict:
            self.give_back(s, offset, planned)
            raise

    def release(self, s: SessionEntries, e: Entry) -> None:
        """``e`` leaves its pool extent (freed, or its bytes are in the spill file or lost)."""
        if self.ledger is not None:
            self.ledger.release(e.offset, self.allocator.aligned(e.nbytes))
        self.give_back(s, e.offset, e.planned)
        e.offset, e.planned = None, False

    def give_back(self, s: SessionEntries, offset: int, planned: bool) -> None:
        if planned:
            s.placement.release(offset)
        else:
            self.allocator.free(offset)
