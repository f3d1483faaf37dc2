"""The mover: decides each saved tensor's route at its put, sends its copies to the
handler registered for that route (storm/copies/), and owns the worker thread those handlers share.

Saving never waits for a round trip: the training thread sends GET (and PUT
for a CUDA tensor) and hands the rest to one worker thread, which takes the
store's reply and moves the bytes. Those requests are pipelined, so the
store's latency is paid once per burst, not once per tensor. One thread, so
the copies, and the requests queued behind them (``request``), stay in order.

The routes, chosen in ``Mover.route`` and nowhere else (at a save's put, and again where the
session stores it again), serve that put and the get of what it stored:

- Route.HOST, a CPU tensor: copies/cpu_to_pool.py (the worker copies, checksums, encodes);
- Route.DAEMON, a CUDA tensor whose memory stormd copies itself (HELLO's
  ``cuda_devices``), raw: copies/cuda_by_daemon.py (CUDA IPC; memory that
  cannot be exported is logged once, and that GPU's saves take the next route
  from then on);
- Route.OWN, any other CUDA tensor (the embedded store, a daemon without CUDA,
  frames): copies/cuda_to_pool.py (this process copies on its own streams).

``Stores``: a session's Movers, one per store it has offloaded to, and which of
them holds a key (a session moves on to another store when its daemon stops).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Collection

import torch

from stormd.wire.cuda import device_uuid, register_pool

from .backend import Backend
from .copies.base import Copy, CopyHandler, Landed, PutRequest, Route, log_failure, wait_reply
from .copies.cpu_to_pool import CpuToPool
from .copies.cuda_by_daemon import CudaByDaemon
from .copies.cuda_to_pool import CudaToPool
from .errors import DaemonLoss
from .frames import frame_codec
from .gpu import DeviceStreams, NotExportable, export
from .replies import Resolved

# Keys a Mover gathers before it sends a FREE: backward lets go of saves one at a time, and a FREE
# each made a third of a daemon's requests, each a turn of the loop every rank waits on. Fewer
# wait, whatever their number, until the next PUT, request or synchronize.
FREE_BATCH = 16
log = logging.getLogger("storm")
_threads_lock = threading.Lock()  # torch's default intra-op thread count is the process's, not a Mover's
# Keys are numbered for the whole process, not per session: Stores finds a key's store by its number,
# and two sessions may share one store (mode auto and mode daemon of one endpoint; the embedded store).
_keys = itertools.count(1)


def next_key() -> int:
    """A key no other save of this process has had."""
    return next(_keys)


class Mover:
    """``uuid_of``: a GPU index's UUID (the CUDA runtime's, by default), matched against the GPUs
    whose memory the store copies itself; ``export``: the IPC handle and offset of a pointer's
    memory on a GPU (storm/gpu.py's, by default; tests stand in their own)."""

    def __init__(self, backend: Backend, uuid_of: Callable[[int], str | None] = device_uuid,
                 export: Callable[[int, int], tuple[bytes, int]] = export):
        self.backend = backend
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="storm-mover")
        with _threads_lock:  # another Mover's worker between the read and the restore would make 1 the default
            intra_op = torch.get_num_threads()
            self._worker.submit(_one_cpu_thread).result()
            torch.set_num_threads(intra_op)  # the worker set the default for threads yet to start: back to the caller's
        self._streams: dict[int, DeviceStreams] = {}
        self._daemon = CudaByDaemon(backend, self._worker, lambda device: self._streams_for(device, into_pool=False),
                                    export=export, uuid_of=uuid_of)
        self._handlers: dict[Route, CopyHandler] = {
            Route.HOST: CpuToPool(backend, self._worker),
            Route.OWN: CudaToPool(backend, self._worker, self._streams_for),
            Route.DAEMON: self._daemon,
        }
        self._unexportable: set[int] = set()  # GPUs whose memory CUDA IPC could not name: their saves go OWN
        self._frees: list[int] = []  # keys let go of and not yet sent (FREE_BATCH)
        self._frees_lock = threading.Lock()

    def _streams_for(self, device: torch.device, into_pool: bool = True) -> DeviceStreams:
        """``into_pool``: this process copies into the pool, which it then page-locks (not stormd)."""
        if into_pool and not self.backend.pool.cuda_registered:
            register_pool(self.backend.pool)
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = DeviceStreams(device)
        return s

    def route(self, source: torch.UntypedStorage, dtype: str, codec: str, producer: str = "",
              overflowed: Collection[str] = ()) -> tuple[Route, str, tuple[bytes, int] | None]:
        """A put's route: which handler copies ``source`` (of the saved view's ``dtype``
        name, its bytes made by ``producer``: saved.producer_of) both ways, the codec it stores it
        with, given the step's codec setting and the frames that overflowed for saves of its kind
        (``overflowed``: not taken again), and for stormd's
        copies the memory's IPC handle and offset. CPU tensors take the codec setting; CUDA tensors a
        frame where a frame codec takes them (this process encodes and copies those), else raw."""
        if not source.is_cuda:
            return Route.HOST, "raw" if codec in overflowed else codec, None
        framed = frame_codec(codec, "cuda", dtype, source.nbytes(), producer, overflowed)
        if framed is not None:
            return Route.OWN, framed, None
        device = source.device
        if device.index in self._unexportable or not self._daemon.serves(device):
            return Route.OWN, "raw", None
        try:
            ipc = self._daemon.export(source)
        except NotExportable as e:
            log.warning("storm: %s; this process copies its CUDA tensors into the pool itself from now on", e)
            self._unexportable.add(device.index)
            return Route.OWN, "raw", None
        return Route.DAEMON, "raw", ipc

    def put(self, req: PutRequest) -> Copy:
        self.flush_frees()  # a PUT never finds the pool holding what was let go of before it
        return self._handlers[req.route].put(req)

    def get(self, route: Route, key: int, nbytes: int, device: torch.device, verify: bool = True) -> Copy:
        """Fetch a key's bytes, stored by a put of ``route``, into a fresh uint8 tensor on ``device``;
        ``verify``: the step's setting."""
        return self._handlers[route].get(key, nbytes, device, verify)

    def settle(self, route: Route, key: int, landed: Landed) -> None:
        """A put of ``route`` into ``key`` has landed and its bytes are in the pool: its handler tells
        the store what it must hear."""
        self._handlers[route].settle(key, landed)

    def request(self, op: str, **fields: Any) -> Future:
        """A request queued behind the copies already submitted (so STATS sees earlier FREEs)."""
        self.flush_frees()
        return self._worker.submit(lambda: wait_reply(self.backend, op, self.backend.request(op, **fields)))

    def free(self, keys: list[int]) -> None:
        """FREE ``keys``, once FREE_BATCH have gathered or at the next PUT, request or flush_frees.
        Sent from the calling thread, like PUT, so a step's PUTs never overtake the FREEs of the
        step before (through the mover's queue they could, and find the pool still full)."""
        with self._frees_lock:
            self._frees.extend(keys)
            if len(self._frees) < FREE_BATCH:
                return
        self.flush_frees()

    def flush_frees(self) -> None:
        """Send the FREE of every key gathered."""
        if not self._frees:  # the common case, looked at without the lock
            return
        with self._frees_lock:
            keys, self._frees = self._frees, []
            # sent under the lock: two FREEs from two threads reach the store in the order taken; a
            # store that is gone freed them as it went
            if keys and self.backend.alive:
                self.backend.request("FREE", keys=keys).add_done_callback(log_failure)

    def close(self) -> None:
        self.flush_frees()
        self._worker.shutdown(wait=True)


class Stores:
    """The stores one session has offloaded to, each with its Mover, and which of them holds a key.

    A session moves on to another store when its daemon stops serving it (``move_on``: ``reopen``
    gives the store in its place, mode auto) and at a step that finds another one (``use``: a
    restarted daemon, the embedded store). Keys are numbered for the whole process (next_key), so
    each store holds the session's keys from the first after it moved there up to where it moved
    on, and what a key needs later (its get, its settling, its FREE) goes to the store that holds
    it, whichever is current. A store whose daemon is gone, its connection closed, is let go of
    once no copy of the session reads or writes its pool (``retire``): its keys then fail with its
    loss. The session changes them under its lock; a change replaces the list of runs whole, so
    ``of`` and ``free`` may read it from any thread."""

    def __init__(self, backend: Backend, reopen: Callable[[], Backend] | None = None):
        self.current = Mover(backend)
        self._reopen = reopen
        # (the first key of each run of keys, where the run is: its Mover, or the loss of a store let go)
        self._runs: list[tuple[int, Mover | DaemonLoss]] = [(0, self.current)]

    def of(self, key: int) -> Mover | DaemonLoss:
        runs = self._runs
        return runs[0][1] if len(runs) == 1 else runs[bisect.bisect_right(runs, key, key=lambda r: r[0]) - 1][1]

    def lost(self, key: int) -> DaemonLoss | None:
        """How the store that holds ``key`` stopped serving this process, if it did."""
        where = self.of(key)
        return where.backend.loss if isinstance(where, Mover) else where

    def get(self, route: Route, key: int, nbytes: int, device: torch.device, verify: bool) -> Copy:
        """Fetch ``key`` from the store that holds it (Mover.get); its loss, if that store was let go of."""
        where = self.of(key)
        if not isinstance(where, Mover):
            return Copy(Resolved(error=where.error()))
        return where.get(route, key, nbytes, device, verify)

    def settle(self, route: Route, key: int, landed: Landed) -> None:
        """Mover.settle, in the store that holds ``key``: none where its connection is closed."""
        where = self.of(key)
        if isinstance(where, Mover) and where.backend.alive:
            where.settle(route, key, landed)

    def use(self, backend: Backend) -> None:
        """New saves go to ``backend`` (through the Mover the session had for it, if any)."""
        if backend is self.current.backend:
            return
        mover = next((m for m in self._movers() if m.backend is backend), None)
        self.current = mover or Mover(backend)
        self._runs = [*self._runs, (next_key(), self.current)]

    def _movers(self) -> list[Mover]:
        """Each Mover once (a session that comes back to a store uses its Mover again)."""
        return list({id(m): m for _, m in self._runs if isinstance(m, Mover)}.values())

    def move_on(self) -> bool:
        """The current store's daemon stopped: new saves go to the store ``reopen`` gives in its place
        (open_backend, which says so once). False where there is none: mode daemon."""
        if self.current.backend.loss is None:  # another thread moved on
            return True
        if self._reopen is None:
            return False
        self.use(self._reopen())
        return True

    def describe(self) -> str:
        """The current store in words, and the daemon it took the place of, if it did."""
        before = self.lost(self._runs[-1][0] - 1) if len(self._runs) > 1 else None
        if before is None or self.current.backend.loss is not None:
            return self.current.backend.store
        return f"{self.current.backend.store}, in place of the daemon: {before.said()}"

    def gone(self) -> list[Mover]:
        """The Movers, other than the current one, of stores whose daemon is gone: connection closed."""
        return [m for m in self._movers() if m is not self.current and m.backend.loss is not None
                and not m.backend.alive]

    def retire(self, movers: list[Mover]) -> None:
        """Let go of ``movers`` (gone(), no copy of theirs in flight) and their connections: the pool goes."""
        for m in movers:
            loss = m.backend.loss
            assert loss is not None  # gone() returns only lost stores
            m.close()
            m.backend.close()
            self._runs = [(start, loss if where is m else where) for start, where in self._runs]

    def free(self, keys: list[int]) -> None:
        """FREE ``keys`` in the stores that hold them; a store that is gone freed them when it went."""
        runs = self._runs
        if len(runs) == 1:  # the common case: one store, this key's
            where = runs[0][1]
            if isinstance(where, Mover) and where.backend.alive:
                where.free(keys)
            return
        by_store: dict[int, tuple[Mover, list[int]]] = {}
        for key in keys:
            where = self.of(key)
            if isinstance(where, Mover) and where.backend.alive:
                by_store.setdefault(id(where), (where, []))[1].append(key)
        for mover, some in by_store.values():
            mover.free(some)

    def flush_frees(self) -> None:
        """Send every Mover's gathered FREEs."""
        for m in self._movers():
            m.flush_frees()

    def close(self) -> None:
        """Close every Mover, and the connections of daemons that stopped (open_backend let go of them)."""
        for m in self._movers():
            m.close()
            if m.backend.loss is not None:
                m.backend.close()


def _one_cpu_thread() -> None:
    """Run on the worker: its CPU copies and codecs use this thread alone. A second OpenMP team
    beside the training thread's makes libgomp count more threads than cores and cut its
    workers' spin-waits short, so every parallel op of the training thread pays futex wake-ups:
    a small CPU model's forward and backward ran far slower while the worker's team existed.
    get_num_threads first: ATen applies the process default to a thread at its first parallel
    op, which would undo a setting made before it."""
    torch.get_num_threads()
    torch.set_num_threads(1)
