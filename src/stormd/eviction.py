"""The eviction policy: which sealed tensor leaves the pool first when it is full.

A tensor may move while it is sealed (the client's copy is done) and not yet
fetched (after GET the client may be reading the extent, so it stays put until
FREE); the store tells the policy when one becomes movable (``add``) and when
it no longer is (``discard``), and the spiller asks it for the next victim.
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

    def pop_victim(self) -> tuple[int, int] | None:
        """(session, key) of the tensor to spill next, no longer added; None when none may move."""


class SpillOrder:
    """Movable tensors ranked by what backward needs last: client priority, step, key."""

    def __init__(self) -> None:
        self._ranked: SortedList = SortedList()

    def add(self, session: int, priority: int, e: Entry) -> None:
        self._ranked.add((priority, e.step, e.key, session))

    def discard(self, session: int, priority: int, e: Entry) -> None:
        self._ranked.discard((priority, e.step, e.key, session))

    def pop_victim(self) -> tuple[int, int] | None:
        if not self._ranked:
            return None
        _, _, key, session = self._ranked.pop(0)
        return session, key

    def __len__(self) -> int:
        return len(self._ranked)
