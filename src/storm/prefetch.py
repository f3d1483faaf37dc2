"""Prefetch pacing: which offloaded saves come back ahead of backward, and how far ahead.

Backward needs the offloaded saves in reverse saving order. The prefetcher
fetches the ones before the save backward unpacks now, within the memory
backward has freed (its allowance) (markers past a budget measure it, or a caller that knows
the model's blocks says it: storm.plan through ``allow_prefetch``) plus, once
backward unpacks offloaded saves, the byte window (storm.offload's
``prefetch_bytes``, the step's own). The session calls it under its lock.
"""

from __future__ import annotations

import weakref
from typing import Callable

from .copies.base import Copy
from .room import Reader
from .saved import Marker, State, Step, Stored


class Prefetcher:
    """``fetch``: start fetching a Stored (the mover's get); ``restored``: the session's fetched
    bytes by key, still alive or not (what is here needs no fetch); ``memory``: the step's own
    memory on a device now, as Step.level counts it (CopyQueue.step_memory), None where unknown."""

    def __init__(self, fetch: Callable[[Stored], Copy], restored: dict[int, weakref.ref], memory: Reader):
        self.fetch = fetch
        self.restored = restored
        self.memory = memory
        self.copies: dict[int, Copy] = {}  # key -> its fetch, started ahead and not yet unpacked
        self.nbytes = 0  # the bytes of those fetches

    def take(self, stored: Stored) -> Copy | None:
        """The fetch started ahead for ``stored``, if any: it is the unpack's now."""
        fut = self.copies.pop(stored.key, None)
        if fut is not None:
            self.nbytes -= stored.nbytes
        return fut

    def allowance_at(self, step: Step, marker: Marker) -> int:
        """The allowance backward has made when it reaches ``marker``: the bytes it freed. On CUDA
        that is the step's own memory now below what it was when forward ended (backward frees saves
        but allocates gradients, which can take most of it); the copy queue's saves are counted in
        neither: their copies finishing free nothing backward may fill, since a language model's
        first unpacks come at its peak. Elsewhere, the bytes saved since the marker before, about to
        be freed."""
        if step.level is not None and (now := self.memory(marker.device)) is not None:
            return max(0, step.level - now) + self.nbytes  # the bytes prefetched are allocated already
        return step.fetch_allowance + marker.nbytes

    def ahead(self, step: Step, index: int, now: Stored | None = None) -> None:
        """Start fetching the storages saved before ``index``, within the allowance backward has made
        plus, once it unpacks offloaded saves, the byte window; not ``now``, which the unpack that
        calls this fetches itself (a storage several ops saved: its later unpacks will find it here).
        A storage saved again after other saves comes at the latest place it was saved at
        (Step.saved_again): backward unpacks it there first.

        ``step.cursor`` only moves down, so each storage is looked at about once per
        backward: O(1) per unpack. It waits at a storage whose copy to the store is
        still running (it may yet be needed from the device) and goes on once that
        copy is done. A second pass (retain_graph) fetches on demand."""
        step.cursor = min(step.cursor, index)
        step.again_cursor = min(step.again_cursor, len(step.saved_again))
        window = step.window() if step.fetching else 0
        limit = step.fetch_allowance + window
        while self.nbytes < limit:
            s, again = self._next(step)
            if s is None:
                return
            if s.state == State.HELD:
                return
            ref = self.restored.get(s.key)
            if (s is now or s.state != State.OFFLOADED or s.unpacks >= s.handles or s.key in self.copies
                    or (ref is not None and ref() is not None)):
                self._pass(step, again)
                continue  # not in the store, already unpacked, on its way, or here
            # the allowance is memory backward has freed (storm.plan's is its peak's slack): a fetch
            # must fit in it, with the frame it comes in, which the get holds beside the tensor it
            # decodes into until the decode is queued; only a window smaller than one tensor may
            # take that tensor, unless a full-offload room set it: then it is what fits under the
            # step's floor
            if self.nbytes + s.nbytes + s.frame_bytes > limit and (self.nbytes or not window or step.room is not None):
                return
            self._pass(step, again)
            self.copies[s.key] = self.fetch(s)
            self.nbytes += s.nbytes

    @staticmethod
    def _next(step: Step) -> tuple[Stored | None, bool]:
        """The storage backward needs next before the cursors, and whether it is one saved again
        (a place in Step.saved_again) rather than in the saving order; None where none is left."""
        if step.again_cursor:
            at, stored = step.saved_again[step.again_cursor - 1]
            if at >= step.cursor:  # saved again after order[:cursor]: unpacked before them
                return stored, True
        return (step.order[step.cursor - 1] if step.cursor else None), False

    @staticmethod
    def _pass(step: Step, again: bool) -> None:
        """Move past the storage _next gave."""
        if again:
            step.again_cursor -= 1
        else:
            step.cursor -= 1
