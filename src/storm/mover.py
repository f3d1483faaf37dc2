"""The mover: routes each copy between a saved tensor and the store's pool to the handler of its
media (client/copies/), and owns the worker thread those handlers share.

Saving never waits for a round trip: the training thread sends GET (and PUT
for a CUDA tensor) and hands the rest to one worker thread, which takes the
store's reply and moves the bytes. Those requests are pipelined, so the
store's latency is paid once per burst, not once per tensor. One thread, so
the copies, and the requests queued behind them (``request``), stay in order.

The paths, chosen in ``Mover.route`` and nowhere else:

- a CPU tensor: copies/cpu_to_pool.py (the worker copies, checksums, encodes);
- a CUDA tensor whose memory stormd copies itself (HELLO's ``cuda_devices``),
  raw: copies/cuda_by_daemon.py (CUDA IPC; memory that cannot be exported is
  logged once and goes the next way from then on);
- any other CUDA tensor (the embedded store, a daemon without CUDA, frames):
  copies/cuda_to_pool.py (this process copies on its own streams).
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
from .copies.base import Copy, CopyHandler, PutRequest, wait_reply
from .copies.cpu_to_pool import HostCopies
from .copies.cuda_by_daemon import DaemonCopies
from .copies.cuda_to_pool import PoolCopies
from .gpu import DeviceStreams, IpcEvent, NotExportable

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


def _log_failure(fut: Future) -> None:
    if fut.exception() is not None:
        log.warning("storm: a request to the store failed: %s", fut.exception())


class Mover:
    """``uuid_of``: a GPU index's UUID (the CUDA runtime's, by default), matched against the GPUs
    whose memory the store copies itself."""

    def __init__(self, backend: Backend, uuid_of: Callable[[int], str | None] = device_uuid):
        self.backend = backend
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="storm-mover")
        with _threads_lock:  # another Mover's worker between the read and the restore would make 1 the default
            intra_op = torch.get_num_threads()
            self._worker.submit(_one_cpu_thread).result()
            torch.set_num_threads(intra_op)  # the worker set the default for threads yet to start: back to the caller's
        self._streams: dict[int, DeviceStreams] = {}
        self._host = HostCopies(backend, self._worker)
        self._pool = PoolCopies(backend, self._worker, self._streams_for)
        self._daemon = DaemonCopies(backend, self._worker, lambda device: self._streams_for(device, into_pool=False),
                                    uuid_of=uuid_of)

    def _streams_for(self, device: torch.device, into_pool: bool = True) -> DeviceStreams:
        """``into_pool``: this process copies into the pool, which it then page-locks (not stormd)."""
        if into_pool and not self.backend.pool.cuda_registered:
            register_pool(self.backend.pool)
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = DeviceStreams(device)
        return s

    def daemon_copies(self, device: torch.device) -> bool:
        """Whether the store copies this GPU's memory itself (stormd, through CUDA IPC)."""
        return self._daemon.serves(device)

    def route(self, device: torch.device, daemon_may_copy: bool) -> CopyHandler:
        """The handler of copies between ``device``'s memory and the pool."""
        if device.type != "cuda":
            return self._host
        return self._daemon if daemon_may_copy and self._daemon.serves(device) else self._pool

    def _started(self, handler: CopyHandler, device: torch.device, start: Callable[[CopyHandler], Copy]) -> Copy:
        """``start(handler)``; where stormd cannot open this process's memory, through this process's
        own copies instead, from now on."""
        try:
            return start(handler)
        except NotExportable as e:
            log.warning("storm: %s; this process copies its CUDA tensors into the pool itself from now on", e)
            self._daemon.stop_serving(device)
            return start(self._pool)

    def _codec_for(self, req: PutRequest) -> str:
        """CPU tensors: the step's codec setting. CUDA tensors: a frame where a frame codec takes them,
        else raw."""
        if not req.source.is_cuda:
            return req.codec
        framed = req.codec in FRAME_CODECS and frameable("cuda", req.meta["dtype"], req.source.nbytes())
        return FRAME_CODEC if framed else "raw"

    def put(self, req: PutRequest) -> Copy:
        device = req.source.device
        codec = self._codec_for(req)
        # Frames are copied here even where stormd could copy them: a step with frames copied by stormd
        # took longer than with this process's copies (bench/results, README). A ready event stormd can
        # wait on was recorded only where it copies this device.
        handler = self.route(device, codec == "raw" and isinstance(req.ready, IpcEvent))
        return self._started(handler, device, lambda h: h.put(req, codec))

    def get(self, key: int, nbytes: int, device: torch.device, copy_in: Copy | None = None,
            verify: bool = True) -> Copy:
        """Fetch a key's bytes into a fresh uint8 tensor on ``device``; ``copy_in``: the key's put (a
        frame is decoded here, and a copy out of the pool waits for the copy in); ``verify``: the
        step's setting."""
        handler = self.route(device, copy_in is not None and copy_in.frame is None)
        after = copy_in.event if copy_in is not None else None
        return self._started(handler, device, lambda h: h.get(key, nbytes, device, after, verify))

    def request(self, op: str, **fields: Any) -> Future:
        """A request queued behind the copies already submitted (so STATS sees earlier FREEs)."""
        return self._worker.submit(lambda: wait_reply(self.backend, op, self.backend.request(op, **fields)))

    def seal(self, key: int, put: Copy) -> None:
        """Tell the store ``put``, a CUDA copy into ``key``'s extent, has finished, unless the store
        seals it itself (CPU puts seal themselves, stormd's own copies are sealed by stormd)."""
        if not put.sealed:
            self.backend.request("SEAL", key=key).add_done_callback(_log_failure)

    def free(self, keys: list[int]) -> None:
        """Sent from the calling thread, like PUT, so a step's PUTs never overtake the FREEs of the
        step before (through the mover's queue they could, and find the pool still full)."""
        if keys:
            self.backend.request("FREE", keys=keys).add_done_callback(_log_failure)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _one_cpu_thread() -> None:
    """Run on the worker: its CPU copies and codecs use this thread alone. A second OpenMP team
    beside the training thread's makes libgomp count more threads than cores and cut its
    workers' spin-waits short, so every parallel op of the training thread pays futex wake-ups:
    a small CPU model's forward and backward took about twice as long while the worker's team
    existed (bench/cpu_threads.py measures it).
    get_num_threads first: ATen applies the process default to a thread at its first parallel
    op, which would undo a setting made before it."""
    torch.get_num_threads()
    torch.set_num_threads(1)
