"""The mover: decides each saved tensor's route once, when it is saved, sends its copies to the
handler registered for that route (storm/copies/), and owns the worker thread those handlers share.

Saving never waits for a round trip: the training thread sends GET (and PUT
for a CUDA tensor) and hands the rest to one worker thread, which takes the
store's reply and moves the bytes. Those requests are pipelined, so the
store's latency is paid once per burst, not once per tensor. One thread, so
the copies, and the requests queued behind them (``request``), stay in order.

The routes, chosen in ``Mover.route`` and nowhere else, serve a save's put and its get:

- Route.HOST, a CPU tensor: copies/cpu_to_pool.py (the worker copies, checksums, encodes);
- Route.DAEMON, a CUDA tensor whose memory stormd copies itself (HELLO's
  ``cuda_devices``), raw: copies/cuda_by_daemon.py (CUDA IPC; memory that
  cannot be exported is logged once, and that GPU's saves take the next route
  from then on);
- Route.OWN, any other CUDA tensor (the embedded store, a daemon without CUDA,
  frames): copies/cuda_to_pool.py (this process copies on its own streams).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from stormd.wire.cuda import device_uuid, register_pool
from stormd.wire.protocol import FRAME_CODEC

from .backend import Backend
from .copies.base import Copy, CopyHandler, Landed, PutRequest, Route, log_failure, wait_reply
from .copies.cpu_to_pool import CpuToPool
from .copies.cuda_by_daemon import CudaByDaemon
from .copies.cuda_to_pool import CudaToPool
from .gpu import DeviceStreams, NotExportable, export

# Smaller CUDA tensors are copied raw: a frame's kernel launches cost the training thread
# the same host time at any size, while what it saves on the link shrinks with the size.
FRAME_MIN_BYTES = 4 << 20
FRAME_CODECS = ("auto", "ancf_exp")  # codec settings that put CUDA tensors in frames
log = logging.getLogger("storm")
_threads_lock = threading.Lock()  # torch's default intra-op thread count is the process's, not a Mover's


def frameable(device_type: str, dtype: str, nbytes: int) -> bool:
    """Whether a frame codec puts a storage of this device type, saved view dtype (its name, as in
    a PUT's meta) and size in a frame: CUDA bf16 of at least FRAME_MIN_BYTES, whole 16-bit words."""
    return device_type == "cuda" and dtype == "bfloat16" and nbytes >= FRAME_MIN_BYTES and nbytes % 2 == 0


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

    def _streams_for(self, device: torch.device, into_pool: bool = True) -> DeviceStreams:
        """``into_pool``: this process copies into the pool, which it then page-locks (not stormd)."""
        if into_pool and not self.backend.pool.cuda_registered:
            register_pool(self.backend.pool)
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = DeviceStreams(device)
        return s

    def route(self, source: torch.UntypedStorage, dtype: str,
              codec: str) -> tuple[Route, str, tuple[bytes, int] | None]:
        """A save's route, decided once: which handler copies ``source`` (of the saved view's ``dtype``
        name) both ways, the codec it stores it with, given the step's codec setting, and for stormd's
        copies the memory's IPC handle and offset. CPU tensors take the codec setting; CUDA tensors a
        frame where a frame codec takes them (this process encodes and copies those), else raw."""
        if not source.is_cuda:
            return Route.HOST, codec, None
        if codec in FRAME_CODECS and frameable("cuda", dtype, source.nbytes()):
            return Route.OWN, FRAME_CODEC, None
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
        return self._worker.submit(lambda: wait_reply(self.backend, op, self.backend.request(op, **fields)))

    def free(self, keys: list[int]) -> None:
        """Sent from the calling thread, like PUT, so a step's PUTs never overtake the FREEs of the
        step before (through the mover's queue they could, and find the pool still full)."""
        if keys:
            self.backend.request("FREE", keys=keys).add_done_callback(log_failure)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _one_cpu_thread() -> None:
    """Run on the worker: its CPU copies and codecs use this thread alone. A second OpenMP team
    beside the training thread's makes libgomp count more threads than cores and cut its
    workers' spin-waits short, so every parallel op of the training thread pays futex wake-ups:
    a small CPU model's forward and backward ran far slower while the worker's team existed.
    get_num_threads first: ATen applies the process default to a thread at its first parallel
    op, which would undo a setting made before it."""
    torch.get_num_threads()
    torch.set_num_threads(1)
