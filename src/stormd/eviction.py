"""The eviction policy: which sealed tensor leaves the pool first when it is full.

A tensor may move while it is sealed (the client's copy is done) and not yet
fetched (after GET the client may be reading the extent, so it stays put until
FREE); the store tells the policy when one becomes movable (``add``) and when
it no longer is (``discard``), and the spiller asks it for the next victim
that the spill file has room for.
``EvictionPolicy`` is that interface, so a test can stand in a policy of its
own; ``SpillOrder`` is stormd's: the first to go is the one backward needs
last, the lowest client priority, then the oldest step, then the earliest
saved key.
"""

from __future__ import annotations

from typing import Protocol

from sortedcontainers import SortedList

from .entries import Entry


class EvictionPolicy(Protocol):
    def add(self, session: int, priority: int, e: Entry) -> None:
        """``e`` (of ``session``, whose client has ``priority``) may be spilled from now on."""

    def discard(self, session: int, priority: int, e: Entry) -> None:
        """``e`` may no longer be spilled (fetched, freed, or being spilled); nothing if it was not added."""

    def pop_victim(self, at_most: int) -> tuple[int, int] | None:
        """(session, key) of the tensor to spill next among those of at most ``at_most`` bytes (what
        the spill file has room for), no longer added; None when none of them may move."""

    def __len__(self) -> int:
        """How many tensors may move, of any size."""


class SpillOrder:
    """Movable tensors ranked by what backward needs last: client priority, step, key."""

    def __init__(self) -> None:
        self._ranked: SortedList = SortedList()

    def add(self, session: int, priority: int, e: Entry) -> None:
        self._ranked.add((priority, e.step, e.key, session, e.nbytes))

    def discard(self, session: int, priority: int, e: Entry) -> None:
        self._ranked.discard((priority, e.step, e.key, session, e.nbytes))

    def pop_victim(self, at_most: int) -> tuple[int, int] | None:
        # the first in rank that fits: one too large for the spill file must not keep the others in
        # the pool (the scan passes over such ones only while the file is that full)
        for i, (_, _, key, session, nbytes) in enumerate(self._ranked):
            if nbytes <= at_most:
                del self._ranked[i]
                return session, key
        return None

    def __len__(self) -> int:
        return len(self._ranked)
