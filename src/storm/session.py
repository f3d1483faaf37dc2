"""A process's side of one store session: which saved tensors are where.

Each offloaded storage is a ``Stored``: held (its tensor alive) until the
mover has copied it, then released, so the memory is freed; fetched back on
unpack, with the next ones in reverse saving order prefetched. Each saved view
is a ``Handle`` onto a Stored (a storage saved twice is stored once); when the
last Handle dies (autograd freed the graph) the key is freed in the store.

All state changes happen under one lock in ``poll``, ``save`` and ``load`` (restore.py's);
Handle finalizers only enqueue, because they run wherever Python drops them.

When its daemon stops serving it (the backend's ``loss``), a session of
``mode='auto'`` moves on to the store in its place from the next save on
(mover.Stores), and stores there again the saves it still holds (their copy
failed, or is not released yet): nothing stays on the device for it. What the
daemon already held is its to lose: a draining one still hands it back, else
backward raises its StormDaemonLost. With ``mode='daemon'`` a save raises it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from stormd.wire.cuda import locking_s

from .backend import Backend
from .copies.base import PutRequest, Route
from .copy_queue import CopyQueue
from .errors import StormUnavailable
from .frames import frame_bytes
from .gpu import IpcEvent, pack_range, record_ready, unpack_range, wait_on_compute
from .mover import Mover, Stores, next_key
from .policy import Keep, Policy, Refusals
from .restore import Restorer
from .rooms import Rooms
from .saved import Handle, Kept, Marker, State, Step, StepKind, StepOptions, Stored, copy_of

MARKER_SPACING = 64 << 20  # past the budget, one save in about this many bytes reports backward's progress
MAX_KINDS = 64  # kinds of step whose figures fraction budgets go by, the most recent
MAX_OVERFLOWED_KINDS = 4096  # kinds of save whose frames overflowed, the most recent: shapes that change add one each
K, V = TypeVar("K"), TypeVar("V")
_steps = itertools.count(1)  # for the whole process, as keys are (mover.next_key): sessions may share a store


class ClientSession:
    """One store session of the process (registry.py), shared by every step and thread: new_step,
    save (pack), end_step, load (unpack), synchronize, close. A step's own state is its Step's
    (saved.py); the session holds what outlives a step: its saves' keys, stores and copies. Which
    saves stay is policy.py's to say, the saves that wait for their copy are the copy queue's
    (copy_queue.py), full offload's limits rooms.py's, unpacks and what comes back ahead restore.py's
    and prefetch.py's, and the counters are stats.py's."""

    def __init__(self, backend: Backend, reopen: Callable[[], Backend] | None = None):
        """``reopen``: the store to move on to when the current one's daemon stops (mode auto; None: a save
        raises its loss)."""
        self._stores = Stores(backend, reopen)
        self.dropped: collections.deque[Stored] = collections.deque()  # handles autograd let go of
        self._lock = threading.RLock()
        self.copy_queue = CopyQueue(self.poll, self._lock)
        self.rooms = Rooms(self.copy_queue)  # full offload's limits (rooms.py)
        self.restorer = Restorer(self.poll, self._lock, self._stores, self.rooms, self.copy_queue)  # backward's side
        # (copies out of the store: Copy objects or CUDA events, key to free once they are done)
        self._reading: collections.deque[tuple[list[Any], int]] = collections.deque()
        # what fraction budgets and the copy queue past a budget go by, per kind of step (StepKind):
        # the last completed forward's offloadable bytes (of one that stayed within its budget) and
        # bytes saved past its budget. Per kind, not per process: two models trained in turn would
        # each go by the other's
        self._candidate_bytes: collections.OrderedDict[StepKind, int] = collections.OrderedDict()
        self._past_budget_bytes: collections.OrderedDict[StepKind, int] = collections.OrderedDict()
        self._refusals = Refusals()
        # Stored.kind -> the codecs whose frame overflowed for it: its saves take the next frame
        # that takes them, or go raw (mover.route, frames.frame_codec)
        self._overflowed: collections.OrderedDict[tuple[Any, ...], frozenset[str]] = collections.OrderedDict()
        self.closed = False  # by close_all(): the store's bytes are gone, and saves have nowhere to go
        self.last_step = 0  # the number of the last step begun (steps are numbered for the whole process)

    @property
    def backend(self) -> Backend:
        """The store new saves go to."""
        return self._stores.current.backend

    @property
    def mover(self) -> Mover:
        return self._stores.current

    def use(self, backend: Backend) -> None:
        """New saves go to ``backend``: a step found it in place of the current store."""
        with self._lock:
            self._stores.use(backend)

    def _move_on(self) -> bool:
        """The current store's daemon stopped: False in mode daemon, else new saves go to its replacement."""
        with self._lock:
            return self._stores.move_on()

    def describe(self) -> str:
        """The store new saves go to, in words, and the daemon it took the place of, if it did."""
        return self._stores.describe()

    def new_step(self, budget: int | float | None = None, options: StepOptions = StepOptions(),
                 full_offload: bool = True) -> Step:
        """A step; ``budget``: bytes, or a fraction of the offloadable bytes of the last step of
        its kind that stayed within its budget (the first, with nothing to go by, offloads all;
        the kind is known at its first save: _begin_kind); ``options``: the step's own, served with
        each of its saves; ``full_offload``: whether a step without a budget follows full offload's
        rooms (rooms.py), or offloads every save within ``options`` alone (storm.plan's steps)."""
        gone = self._stores.gone()
        if gone:
            self._retire(gone)
        step = Step(next(_steps), budget if isinstance(budget, int) else float("inf"), options,
                    full_offload=budget is None and full_offload)
        step.fraction = budget if isinstance(budget, float) else None
        # past a budget set mid-step too (Offload.offload_at_most); not for storm.plan's steps, whose copy
        # queue is the plan's
        step.queue_past_budget = budget is not None or full_offload
        self.last_step = step.number
        with self._lock:  # another thread's save may be following a room meanwhile
            self.rooms.start_step(step)
        return step

    def _retire(self, gone: list[Mover]) -> None:
        """Let go of ``gone``, the stores whose daemon is gone, once no copy reads or writes their pool (it goes)."""
        self.synchronize()
        for copy in [c for key, c in list(self.restorer.prefetch.copies.items()) if self._stores.of(key) in gone]:
            copy.wait()
        with self._lock:
            self._stores.retire(gone)

    def end_step(self, step: Step, completed: bool = True) -> None:
        """Forward is over: remember its size for fraction budgets, where it offloaded all it would
        have (saves past the budget are not counted), saved something (an evaluation under no_grad
        saves nothing) and ``completed`` (its forward did not raise part-way): another step's
        fraction of 0 or of part of a forward would keep it from offloading; and, where it had a
        budget and completed, what it saved past it (CopyQueue.limit). Prefetch waits for
        backward's first unpack: fetching at the end of forward would bring bytes back at the
        memory peak."""
        if step.kind is not None and completed:
            if not step.budget_reached and step.candidate_bytes:
                _remember(self._candidate_bytes, step.kind, step.candidate_bytes)
            if step.budget_bytes != float("inf"):  # one within its budget saved nothing past it
                _remember(self._past_budget_bytes, step.kind, step.past_budget_bytes)
        self.poll()
        self.copy_queue.end_step(step)
        if step.budget_reached and step.order:
            step.level = self.copy_queue.step_memory(step.order[0].device)

    # --- saving -------------------------------------------------------------

    def save(self, t: torch.Tensor, step: Step, policy: Policy, compiled: bool = False) -> Handle | Kept:
        """pack: a Handle for an offloaded tensor, or a Kept when it stays where it is. ``compiled``:
        a compiled graph's save (storm/graph), stored raw and not checked for in-place changes (the
        graph makes none; it reuses the memory once it has called ``let_go``).

        Runs once per saved tensor on the training thread, where every microsecond is a
        microsecond the GPU may wait for its next kernel: the paths that keep a tensor
        come first and touch little."""
        reason = policy.keep_reason(t)
        if reason is not None:
            step.stats.record_kept(step.layer, reason, t.numel() * t.element_size())
            return Kept(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        kept = step.kept_storages.get(storage._cdata) if step.kept_storages else None
        if kept is not None and not kept.expired():
            step.stats.record_kept(step.layer, Keep.SHARED, nbytes)
            return Kept(t)
        stored = step.by_storage.get(storage._cdata)
        if stored is not None:
            with self._lock:  # another thread's poll may forget it between a look and the handle
                if stored.state != State.FREED and not stored.weak.expired() and stored.nbytes == nbytes \
                        and (stored.version == t._version if stored.version is not None
                             else not stored.let_go):  # compiled: its memory unchanged until let go
                    step.stats.record(step.layer, saved=1, deduplicated=1)
                    if len(step.order) > stored.index + 1:  # other offloaded saves came between
                        step.saved_again.append((len(step.order), stored))
                    return self._handle(stored, t, len(step.order))
        if step.kind is None:
            self._begin_kind(step, t)
        step.candidate_bytes += nbytes
        if step.room is not None and self._kept_by_room(step, storage, nbytes, compiled):
            return Kept(t)
        if step.stats.offloaded_bytes + nbytes > step.budget_bytes:
            step.budget_reached = True
            step.stats.record_kept(step.layer, Keep.BUDGET, nbytes)
            return Marker(t, step, nbytes)
        if self.closed:
            raise StormUnavailable("storm.close_all() closed the store inside this step's context: "
                                   "call it once the step's backward has run")
        loss = self.backend.loss
        if loss is not None and not self._move_on():
            raise loss.error()
        with pack_range(t.device):
            return self._offload(t, storage, nbytes, step, compiled)

    def _begin_kind(self, step: Step, t: torch.Tensor) -> None:
        """``step``'s first save the policy would offload, ``t``, tells its kind: what its fraction
        budget and its copy queue past a budget go by, from the last step of that kind."""
        step.kind = (tuple(t.shape), t.dtype, t.device.type)
        last = self._candidate_bytes.get(step.kind)
        if step.fraction is not None and last is not None:
            step.budget_bytes = min(step.budget_bytes, step.fraction * last)  # offload_at_most may have set one
        if step.queue_past_budget:
            step.past_budget_before = self._past_budget_bytes.get(step.kind, 0)

    def _kept_by_room(self, step: Step, storage: torch.UntypedStorage, nbytes: int, compiled: bool) -> bool:
        """Whether a full-offload step's room keeps this save on the device (forward's last saves):
        then the queue drains to what fits beside it, since the room's limit falls at each such
        save and no put of its own would drain the queue."""
        with self._lock:
            if not self.rooms.keeps(step, storage, nbytes, compiled):
                return False
            limit = self.copy_queue.limit(step)
        step.stats.record_kept(step.layer, Keep.ROOM, nbytes)
        self.copy_queue.drain(limit)
        return True

    def save_past_budget(self, t: torch.Tensor, step: Step) -> Kept:
        """pack once the budget is reached: the tensor stays, for about a microsecond. About every
        MARKER_SPACING bytes one is a marker; at its unpack prefetch looks at how much memory backward has
        freed, so the offloaded saves, needed last, come back while backward still computes,
        without raising the peak (the window opens only at the first offloaded save unpacked)."""
        if type(t) is torch.Tensor:  # not a parameter (alive anyway) or a view of one
            base = t._base
            if base is None or type(base) is torch.Tensor:
                step.past_budget_bytes += t.numel() * t.element_size()
                if step.past_budget_bytes - step.marked_bytes >= MARKER_SPACING:
                    marker = Marker(t, step, step.past_budget_bytes - step.marked_bytes)
                    step.marked_bytes = step.past_budget_bytes
                    self.copy_queue.drain(self.copy_queue.limit(step))  # it polls: nothing else does past the budget
                    return marker
        return Kept(t)

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage, nbytes: int, step: Step,
                 compiled: bool) -> Handle:
        t0 = time.perf_counter()
        locked = locking_s()
        self.poll()
        dtype = str(t.dtype).removeprefix("torch.")
        meta = {"dtype": dtype, "shape": list(t.shape), "strides": list(t.stride()),
                "storage_offset": t.storage_offset()}
        with self._lock:  # the store, its route and the key together: the session may move on to another store
            stored = Stored(next_key(), step, t, StorageWeakRef(storage), nbytes, compiled)
            stored.route, codec, ipc = self._route(stored, storage, dtype)  # it serves the get too
            step.order.append(stored)
            previous = step.by_storage.get(storage._cdata)  # an earlier save of the storage, changed since
            step.by_storage[storage._cdata] = stored
            try:
                self.rooms.follow_room(step, storage, nbytes)
                frame = frame_bytes(codec, nbytes)
                if not self.rooms.frame_fits(step, frame):
                    # the put's frame would sit on the step's floor beside the queue: copied as it is
                    stored.route, codec, ipc = self._route(stored, storage, dtype, "raw")
                    frame = 0
                ready = record_ready(t.device, interprocess=stored.route is Route.DAEMON) if t.is_cuda else None
                stored.request = PutRequest(stored.key, step.number, storage, meta, stored.route, codec, ready, ipc)
                stored.copy_in = self.mover.put(stored.request)
            except BaseException:  # nothing went: the save is not the step's, and no handle points at it
                step.order.pop()
                if previous is None:
                    del step.by_storage[storage._cdata]
                else:
                    step.by_storage[storage._cdata] = previous
                raise
            handle = self._handle(stored, t, stored.index)
            step.stats.record(stored.layer, saved=1, offloaded=1, offloaded_bytes=nbytes)
            drain_to = self.copy_queue.add(stored, step, frame)
        step.stats.add_pack(time.perf_counter() - t0, framed=bool(frame), locking=locking_s() - locked)
        if drain_to is not None:  # bound what waits on the mover; wait outside the lock
            self.copy_queue.drain(drain_to)
        return handle

    def _route(self, stored: Stored, source: torch.UntypedStorage, dtype: str,
               codec: str | None = None) -> tuple[Route, str, tuple[bytes, int] | None]:
        """The route and codec of ``stored``'s put of ``source`` (of the saved view's ``dtype``) to the
        current store (mover.route): by ``codec`` where given, else its step's codec setting; raw for
        a compiled graph's save; past the frames that overflowed for its kind."""
        assert stored.step is not None
        codec = "raw" if stored.compiled else codec or stored.step.options.codec or self.backend.codec
        return self.mover.route(source, dtype, codec, stored.facts.producer,
                                self._overflowed.get(stored.kind, frozenset()))

    def _handle(self, stored: Stored, t: torch.Tensor, index: int) -> Handle:
        """A new Handle onto ``stored`` for a save of ``t`` that came after ``index`` offloaded saves of
        its step (under the lock: the session alone counts them)."""
        stored.refs += 1
        stored.handles += 1
        return Handle(self.dropped, stored, t, index)

    def let_go(self, handle: Handle | Kept) -> Handle | Kept:
        """A compiled graph frees or reuses the saved tensor's memory after this call (storm/graph):
        what comes after on the compute stream waits for its copy into the store, and the session
        no longer holds it. A put the store refused keeps a copy of it instead (a Kept, returned
        in place of the handle), as does a tensor the policy kept."""
        if isinstance(handle, Kept):
            return Kept(copy_of(handle.tensor), checked=False)
        stored = handle.stored
        with self._lock:
            stored.let_go = True
            refused = stored.state == State.KEPT  # and a poll has seen that already
            if not refused and (stored.state != State.HELD or stored.tensor is None):  # stored, or let go
                return handle
            copy = stored.copy_in
        if not refused and copy.error() is not None:  # waits for the store's reply, not for the bytes
            self.poll()
            refused = True
        if refused:  # this handle's view of a copy: other views of the storage may have saved it too
            return Kept(copy_of(handle.view_of(stored.tensor.untyped_storage())), checked=False)
        event = copy.result().event
        if event is not None:
            wait_on_compute(stored.device, event)
        with self._lock:
            stored.tensor = None
        return handle

    def poll(self) -> None:
        """Let go of tensors whose copy finished, and free keys nobody holds any more."""
        if not (self.copy_queue.copied() is not None or self.dropped or self._reading):
            return  # the common case (looked at without the lock)
        with self._lock:
            frees = self._reads_done() + self._copies_in_done() + self._handles_dropped()
        self._stores.free(frees)

    def _reads_done(self) -> list[int]:
        """Keys whose last copies out of the store have finished: free now."""
        frees, reading = [], self._reading
        while reading and all(r.done() for r in reading[0][0]):  # copies finish about in order
            frees.append(reading.popleft()[1])
        return frees

    def _copies_in_done(self) -> list[int]:
        """Release the held tensors whose copy into the store has finished, oldest first; a frame that
        overflowed is stored again raw, and a tensor whose store's daemon stopped before it was
        released is stored again in the store that replaces it. Returns the keys to free."""
        frees = []
        while (stored := self.copy_queue.copied()) is not None:
            landed = stored.copy_in.error() is None
            overflowed = landed and stored.copy_in.result().incomplete()
            if overflowed:  # its kind takes another frame or none from now on, held or not
                self._frame_overflowed(stored)
            if stored.refs == 0:  # no handle holds it any more: it goes, stored again nowhere
                frees.extend(self._release(self.copy_queue.pop()))
                continue
            if stored.tensor is not None and self._stores.lost(stored.key) is not None and self._move_on():
                frees.extend(self._put_again(stored, landed))
                continue  # it is held until that copy is done too
            if overflowed:
                frees.extend(self._put_again(stored, landed, raw=True))
                break
            frees.extend(self._release(self.copy_queue.pop()))
        return frees

    def _frame_overflowed(self, stored: Stored) -> None:
        """``stored``'s frame had more escapes than slots: saves of its kind take the next frame that
        takes them, or go raw (mover.route, frames.frame_codec)."""
        assert stored.request is not None and stored.step is not None
        codecs = self._overflowed.get(stored.kind, frozenset()) | {stored.request.codec}
        _remember(self._overflowed, stored.kind, codecs, MAX_OVERFLOWED_KINDS)  # one forgotten overflows once more
        stored.step.stats.record(stored.layer, frame_overflows=1)

    def _handles_dropped(self) -> list[int]:
        """Count the handles autograd let go of; a storage none holds is forgotten (its put dropped
        if the worker has not begun it). Returns the keys to free."""
        frees, dropped = [], self.dropped
        while dropped:
            stored = dropped.popleft()
            stored.refs -= 1
            if stored.refs != 0:
                continue
            # its put not yet let go of (held, or found modified in place while it ran): backward took
            # it from its tensor, or its graph went
            if stored.copy_in is not None:
                if not stored.copy_in.cancel():
                    continue  # its copy has begun: freed once it is done (_release)
                stored.step.stats.record(stored.layer, copies_dropped=1, dropped_bytes=stored.nbytes)
            frees.extend(self._forget(stored))
        return frees

    def _put_again(self, stored: Stored, landed: bool, raw: bool = False) -> list[int]:
        """Store ``stored``, still held, again under a new key in the current store: raw when its frame had
        more escapes than slots (``_frame_overflowed`` has said so), else because the daemon of the
        store it went to stopped. Routed again either way (mover.route): the current
        store may copy it another way. Returns the old key to free, where its put ``landed``."""
        old, stored.key = stored.key, next_key()
        req = stored.request
        assert req is not None
        stored.route, codec, ipc = self._route(stored, req.source, req.meta["dtype"], "raw" if raw else None)
        ready = req.ready
        if stored.route is Route.DAEMON and not isinstance(ready, IpcEvent):
            # stormd waits on the event that says the tensor is complete, and can open only an
            # interprocess one: once the first put's has fired, any event recorded after it says so too
            ready.synchronize()
            ready = record_ready(stored.device, interprocess=True)
        stored.request = dataclasses.replace(req, key=stored.key, route=stored.route, codec=codec, ipc=ipc, ready=ready)
        stored.copy_in = self.mover.put(stored.request)
        return [old] if landed else []

    def _release(self, stored: Stored) -> list[int]:
        """The copy of ``stored`` finished, and it left the copy queue: let its tensor go. Returns keys to free."""
        stored.request = None
        if stored.state == State.FREED:  # its put was cancelled (poll): nothing of it reached the store
            return []
        copy, stored.copy_in = stored.copy_in, None  # its event goes with it: interprocess events are scarce
        err = copy.error()
        if err is not None:
            loss = self._stores.lost(stored.key)  # a refusal of a daemon that stopped is said as its loss
            if loss is not None and stored.refs == 0:  # nobody holds it: dropped, as a put cancelled is
                stored.step.stats.record(stored.layer, copies_dropped=1, dropped_bytes=stored.nbytes)
                return self._forget(stored)
            reason = self._refusals.reason(loss.error() if loss is not None else err)
            stored.state = State.KEPT
            stored.step.stats.record(stored.layer, keep=reason, kept_bytes=stored.nbytes,
                                     offloaded=-1, offloaded_bytes=-stored.nbytes)
            return self._forget(stored) if stored.refs == 0 else []
        stored.in_store = True
        landed = copy.result()
        self._stores.settle(stored.route, stored.key, landed)  # its bytes are in the pool now: the handler says so
        stored.frame_bytes = landed.nbytes if landed.frame is not None else 0
        stored.step.stats.record(stored.layer, stored_bytes=landed.nbytes)
        # The version is read here, on the training thread between two ops, so an
        # in-place op that raced the copy has finished and bumped it by now.
        unchanged = stored.version is None or stored.tensor is None or stored.tensor._version == stored.version
        stored.state = State.OFFLOADED if unchanged else State.MODIFIED
        stored.tensor = None
        return self._forget(stored) if stored.refs == 0 else []  # its handles died during the copy

    def _forget(self, stored: Stored) -> list[int]:
        """Returns the key to free now; a key whose bytes a copy may still be reading waits in
        ``_reading`` for that copy: the unpack that queued it has returned long before the GPU
        ran it, and a freed extent is the next PUT's, maybe another process's, to overwrite."""
        stored.state = State.FREED
        stored.tensor = None
        if stored.step.by_storage.get(stored.weak.cdata) is stored:  # a later save of its storage keeps its own
            del stored.step.by_storage[stored.weak.cdata]
        # The step holds its saves in order (its stats, storm.plan's trace): with each referring back
        # to it, every finished step was a reference cycle, freed only by the garbage collector, and
        # the host's heap grew with what waited for it
        stored.step = None
        unread = self.restorer.forget(stored)
        if not stored.in_store:
            return []
        stored.in_store = False
        reads = [r for r in (stored.read, unread) if r is not None and not r.done()]
        stored.read = None  # ``reads`` holds it while it runs
        if reads:
            self._reading.append((reads, stored.key))
            return []
        return [stored.key]

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished and been checked."""
        while True:
            self.poll()  # after a wait, it may start copies again: tensors whose frame overflowed
            with self._lock:
                pending = self.copy_queue.copies() + [r for reads, _ in self._reading for r in reads]
            if not pending:
                self._stores.flush_frees()  # what the step let go of is freed in the store too
                return
            for copy in pending:
                copy.wait()

    # --- loading ------------------------------------------------------------

    def load(self, handle: Handle | Kept) -> torch.Tensor:
        """unpack: the saved view, rebuilt from the store or from the still-held tensor (restore.py)."""
        if isinstance(handle, Kept):
            t = handle.unpack()
            if isinstance(handle, Marker) and handle.step.order:
                self.restorer.passed(handle)
            return t
        if self.closed:
            raise StormUnavailable("storm.close_all() closed the store while this graph still had saved "
                                   "tensors in it, so they are gone: call it once backward has run")
        with unpack_range(handle.device):
            return self.restorer.restore(handle)

    def close(self) -> None:
        self.closed = True
        self.rooms.close()
        self._stores.close()


def _remember(by_kind: collections.OrderedDict[K, V], kind: K, value: V, most: int = MAX_KINDS) -> None:
    """``value`` for ``kind``, the most recent; at most ``most`` kinds, the least recent forgotten
    (shapes that change every step would add one each)."""
    by_kind[kind] = value
    by_kind.move_to_end(kind)
    while len(by_kind) > most:
        by_kind.popitem(last=False)
