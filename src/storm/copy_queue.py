"""The copy queue: offloaded saves still on the device, waiting for their copy into the store.

A save's tensor stays alive until its put has landed, so the queue's bytes sit on the device
beside what the step holds anyway, with the frame it is encoded into where it is one
(storm/frames.py). The caching allocator counts a save's tensor as allocated, but not its frame:
the frame is the put's, which lets go of it once the encode and the copy are queued on their
streams, and from then on the allocator only keeps its memory from being handed out again until
they have run. So ``nbytes`` is what the queue takes of the device, and ``allocated`` what of it
the allocator's count shows (full offload's room reads that count: rooms.py).

Saving waits on the oldest copy once the queue is over its step's limit (``limit``:
``max_held_bytes``, more past a budget, less under a full-offload step's room, which rooms.py
chooses), and ``drain`` waits until it is within one.

What becomes of a save whose copy is done (released, stored again, forgotten) is the session's
(storm/session.py): it calls every method here under its lock, except ``drain`` and
``drain_through`` (storm/restore.py's), which take the lock themselves to wait outside it,
``end_step`` and ``limit`` from the training thread past a budget (they read the step's own
figures and the queue's bytes), and ``copied`` in poll's look without the lock.
"""

from __future__ import annotations

import collections
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from .copies.base import Copy
from .gpu import allocated_or_none
from .room import Reader
from .saved import State, Step, Stored


class CopyQueue:
    """``poll``: the session's (let go of saves whose copy finished, free keys nobody holds), run
    as ``drain`` waits; ``lock``: the session's, which guards the queue with the rest of its state."""

    def __init__(self, poll: Callable[[], None], lock: AbstractContextManager[Any]):
        self._poll = poll
        self._lock = lock
        # oldest first (copies finish about in order), each with the device bytes its wait holds and
        # its frame's among them
        self._saves: collections.deque[tuple[Stored, int, int]] = collections.deque()
        self.nbytes = 0  # the device bytes of those saves, their frames counted
        self.frame_nbytes = 0  # their frames' bytes among them
        self.memory: Reader = allocated_or_none  # what the allocator holds on a device, None where unknown

    def add(self, stored: Stored, step: Step, frame_bytes: int = 0) -> int | None:
        """``stored``, saved in ``step``, waits for its put, just begun, encoded into a frame of
        ``frame_bytes`` on the device where it is (0: copied as it is). Returns what to drain the
        queue to (outside the lock) when it is over the step's limit, else None: the oldest copy
        is waited for (the queue may stay over by part of a save, and the link has the rest while
        the next op computes); with a room, until the queue is within it: its limit falls where
        the step's own memory rises."""
        held = stored.nbytes + frame_bytes
        self._saves.append((stored, held, frame_bytes))
        self.nbytes += held
        self.frame_nbytes += frame_bytes
        limit = self.limit(step)
        if self.nbytes <= limit:
            return None
        return limit if step.room is not None else self.nbytes - self._saves[0][1]

    @property
    def allocated(self) -> int:
        """The queue's bytes that the caching allocator counts as allocated: its saves' tensors, not
        their frames (module docstring)."""
        return self.nbytes - self.frame_nbytes

    def step_memory(self, device: torch.device) -> int | None:
        """What the allocator holds on ``device`` less the saves waiting here (``allocated``): the
        step's own memory, which a copy finishing does not lower. None where unknown (off CUDA)."""
        held = self.memory(device)
        return None if held is None else held - self.allocated

    def limit(self, step: Step) -> int:
        """Bytes that may wait for their copy. Forward's peak is at its end, and past the budget
        every save stays: until as many as in the last step have come (``step.past_budget_before``),
        the copies may run behind by that much more without raising the peak, and forward need not wait for the
        link (a budget that fits in forward's link time then costs forward nothing). A
        full-offload step with a room holds no more than fits under its floor. A step whose caller
        knows what forward holds below its peak (storm.plan, Offload.allow_queued) may run behind by
        that much more, so the host does not wait on each block's copy and lose its lead on the GPU."""
        most = step.options.max_held_bytes
        if step.full_offload:
            return most if step.room is None else min(most, step.room.queue(step.made))
        return most + max(0, step.past_budget_before - step.past_budget_bytes) + step.queue_allowance

    def copied(self) -> Stored | None:
        """The oldest save if its copy has finished, else None."""
        try:
            oldest = self._saves[0][0]
        except IndexError:  # empty (poll looks without the lock: another thread may empty it)
            return None
        # read once: without the lock, another thread may pop and release this save (its copy_in
        # set to None) since the look above; the locked pass that follows sees the queue as it is
        copy = oldest.copy_in
        return oldest if copy is not None and copy.done() else None

    def pop(self) -> Stored:
        """The oldest save, out of the queue: its copy has finished (``copied``)."""
        stored, held, frame = self._saves.popleft()
        self.nbytes -= held
        self.frame_nbytes -= frame
        return stored

    def copies(self) -> list[Copy]:
        """The puts the saves in the queue wait for, oldest first."""
        return [s.copy_in for s, *_ in self._saves if s.copy_in is not None]

    def drain(self, limit: int) -> None:
        """Let go of saved tensors whose copy has finished, then wait, oldest first, until at most
        ``limit`` bytes of them wait for their copy."""
        self._wait_until(lambda: self.nbytes <= limit)

    def drain_through(self, stored: Stored) -> None:
        """Wait, oldest first, until ``stored`` has left the queue: the session lets go of saves in
        the order they came, and copies on other streams or routes may finish out of that order."""
        self._wait_until(lambda: stored.state != State.HELD)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Poll, and wait for the oldest copy, until ``done()`` (read under the lock) or the queue is empty."""
        self._poll()
        while True:
            with self._lock:
                if done() or not self._saves:
                    break
                oldest = self._saves[0][0].copy_in
            if oldest is not None:  # None: let go of since the look; the poll takes it out
                oldest.wait()
            self._poll()

    def end_step(self, step: Step) -> None:
        """Forward is over: under a room, drain to what backward's first unpack leaves; past a
        budget, to ``max_held_bytes``."""
        if step.room is not None:
            self.drain(self.limit(step))
        if step.budget_reached:
            self.drain(step.options.max_held_bytes)

    def addresses(self) -> list[int]:
        """The device addresses of the saves waiting whose tensors are still held."""
        return [s.tensor.untyped_storage().data_ptr() for s, *_ in self._saves if s.tensor is not None]
