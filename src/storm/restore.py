"""Backward's side of a session: a saved view unpacked, from the tensor still held or from the store,
with the next offloaded saves fetched ahead (prefetch.py paces them).

A storage saved under several views comes back once: the fetched bytes are kept, weakly, by key
(``restored``) and, while more of its views are still to be unpacked, strongly (``awaited``),
unless a full-offload step's room fetches it again at each unpack (room.py: held in between, it
would be under the step's highest reading). The
session (storm/session.py) owns the state of every save; this module reads and changes it under
the session's lock, as the session does, and waits for bytes outside it; what only the
thread unpacking a save touches (its step's ``fetching`` and ``flush_task``, its ``read``) is
written without the lock, its handle alive meanwhile.
"""

from __future__ import annotations

import time
import weakref
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from .copies.base import Copy
from .copy_queue import CopyQueue
from .errors import StormInPlaceError
from .gpu import consume
from .mover import Stores
from .prefetch import Prefetcher
from .rooms import Rooms
from .saved import IN_PLACE_FIX, Handle, Marker, State, Step, Stored


class Restorer:
    """Unpacks of one session. ``poll``: the session's (let go of saves whose copy finished, free keys
    nobody holds); ``lock``: the session's; ``stores``, ``rooms``, ``copy_queue``: the session's."""

    def __init__(self, poll: Callable[[], None], lock: AbstractContextManager[Any], stores: Stores, rooms: Rooms,
                 copy_queue: CopyQueue):
        self._poll, self._lock = poll, lock
        self._stores, self._rooms, self._copy_queue = stores, rooms, copy_queue
        self._restored: dict[int, weakref.ref] = {}  # key -> weak ref to the fetched bytes
        self._awaited: dict[int, torch.Tensor] = {}   # fetched bytes that more handles will unpack
        self.prefetch = Prefetcher(self._fetch, self._restored, copy_queue.step_memory)

    def restore(self, handle: Handle) -> torch.Tensor:
        """The saved view ``handle`` stands for: from its tensor while the session holds it, else from
        bytes fetched earlier (another view of its storage, or ahead), else fetched now."""
        self._poll()
        stored = handle.stored
        step = stored.step
        assert step is not None  # a Stored is freed only once no handle holds it
        self.free_at_backward_end(step)
        step.fetching = True
        if stored.state == State.HELD and stored.tensor is None:  # let go (a compiled graph's), not yet released
            self._copy_queue.drain_through(stored)
        with self._lock:
            ref = self._restored.get(stored.key)
            base = ref() if ref is not None else None  # brought back by an earlier unpack, still alive
            self._rooms.unpacked(stored, self.prefetch.nbytes, restored=base is not None)
            if stored.state in (State.HELD, State.KEPT):
                held = stored.tensor
                assert held is not None  # held until its copy is released, kept for good
                if stored.version is not None and held._version != stored.version:
                    if stored.state == State.HELD:  # its copy may have read the change: the value is gone
                        stored.state = State.MODIFIED
                    raise StormInPlaceError(_modified(stored))
                # counted as a fetched unpack is: the views unpacked after its copy lands must not keep
                # the fetched bytes for it (``awaited``), nor prefetch fetch it again
                self._unpacked(stored)
                return handle.view_of(held.untyped_storage())
            if stored.state == State.MODIFIED:
                raise StormInPlaceError(_modified(stored))
            self._unpacked(stored)
            fetch = None
            if base is not None:
                self._rooms.landed(stored, base)
            else:
                fetch = self.prefetch.take(stored)
                if fetch is not None:
                    step.stats.record(stored.layer, prefetch_hits=1)
                else:
                    fetch = self._fetch(stored)
            self.prefetch.ahead(step, handle.index, stored if fetch is not None else None)
        if fetch is not None:
            base = self._landed(stored, step, fetch)
        assert base is not None  # here already, or fetched now
        return handle.view_of(base.untyped_storage())

    def _unpacked(self, stored: Stored) -> None:
        """One more view of ``stored`` unpacked (under the lock): once every view has been, its fetched
        bytes are no longer awaited."""
        stored.unpacks += 1
        if stored.unpacks >= stored.handles:
            self._awaited.pop(stored.key, None)

    def _landed(self, stored: Stored, step: Step, fetch: Copy) -> torch.Tensor:
        """The bytes ``fetch`` brings back, waited for (on CUDA: the compute stream waits for the copy,
        the host does not), kept for the views of ``stored`` still to be unpacked unless its step's
        room fetches it again for each."""
        t0 = time.perf_counter()
        landed = fetch.result()  # raises what the fetch raised
        base = landed.tensor
        assert base is not None  # a get lands a tensor
        stored.read = landed.event  # not the Copy: that would hold the fetched bytes alive
        step.stats.record(stored.layer, fetch_wait_s=time.perf_counter() - t0, fetched=1, fetched_bytes=stored.nbytes)
        if base.is_cuda:
            consume(base, stored.read)
        with self._lock:
            self._rooms.landed(stored, base)
            self._restored[stored.key] = weakref.ref(base)
            if stored.unpacks < stored.handles and stored.state != State.FREED \
                    and not (step.room is not None and step.room.refetches(stored.index)):
                self._awaited[stored.key] = base  # another view of it is still to come
        return base

    def passed(self, marker: Marker) -> None:
        """Backward reached a marker past the budget: the offloaded tensors may come back as far
        as the memory it has freed (Prefetcher.allowance_at)."""
        self._poll()  # copies that finished since forward are released, so prefetch can pass them
        step = marker.step
        self.free_at_backward_end(step)
        if step.cursor == 0:  # every offloaded save is fetched or was passed over: nothing to pace
            return
        with self._lock:
            if not step.paced:
                step.fetch_allowance = self.prefetch.allowance_at(step, marker)
            self.prefetch.ahead(step, marker.index)

    def allow_prefetch(self, step: Step, nbytes: int) -> None:
        """Backward has freed ``nbytes`` for fetches now (a caller that knows the model's blocks, such as
        storm.plan, says so as backward reaches each): as many offloaded bytes of ``step`` may
        come back ahead, on top of the prefetch window."""
        self._poll()
        with self._lock:
            step.paced = step.fetching = True
            step.fetch_allowance = nbytes  # may shrink: what backward frees can be taken by gradients
            self.prefetch.ahead(step, len(step.order))

    def forget(self, stored: Stored) -> Copy | None:
        """``stored`` is freed (under the lock): what was fetched of it goes; returns its fetch started
        ahead and never unpacked, if any, which may still be reading its bytes."""
        self._restored.pop(stored.key, None)
        self._awaited.pop(stored.key, None)
        return self.prefetch.take(stored)

    def free_at_backward_end(self, step: Step) -> None:
        """Free what this backward released once it ends: without it the last handles to die
        would wait in the store for the next step's first save."""
        task = torch._C._current_graph_task_id()
        # outside backward (grad_fn._saved_*) the next poll frees; queued once per backward, by its own
        # id: a backward that raised runs no callback, and the next must queue its own
        if task == -1 or step.flush_task == task:
            return
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_ended(step, task))
        step.flush_task = task

    def _backward_ended(self, step: Step, task: int) -> None:
        if step.flush_task == task:
            step.flush_task = -1
        self._poll()
        self._stores.flush_frees()  # the keys gathered for a FREE (mover.FREE_BATCH) go now too

    def _fetch(self, stored: Stored) -> Copy:
        assert stored.step is not None
        return self._stores.get(stored.route, stored.key, stored.nbytes, stored.device, stored.step.options.verify)


def _modified(stored: Stored) -> str:
    """What StormInPlaceError says of ``stored``, changed in place after autograd saved it: before its
    copy finished, or where the store refused it and the step kept it on its device."""
    if stored.state == State.KEPT:
        return (f"a saved {stored.describe()} was modified in place after autograd saved it; the store refused "
                f"it, so it stayed on its device as saved, and that change is in it now; {IN_PLACE_FIX}")
    return (f"a saved {stored.describe()} was modified in place after autograd saved it and before STORM "
            f"finished copying it, so its saved value is gone; {IN_PLACE_FIX}")
