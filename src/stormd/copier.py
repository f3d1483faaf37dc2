"""The daemon's CUDA copies: a client's GPU memory, opened through CUDA IPC, to and from the pinned pool.

A PUT or GET of a CUDA tensor may carry a ``cuda`` map (wire/protocol.py): the IPC handle of the
cudaMalloc segment holding the bytes and their offset in it, the GPU's UUID (indices differ between
processes under CUDA_VISIBLE_DEVICES), and two interprocess events the client made: ``ready``
(recorded where the tensor is complete, or where the destination is free) and ``done``, which the
daemon records after its copy. The daemon makes its stream wait on ``ready``, queues the copy
between the segment and the pool, records ``done`` and answers: the reply says "queued", ``done``
says "finished". Nothing here waits on the host.

Each session has its own pair of streams per GPU (device to host, host to device), so both
directions run at once and a client whose ``ready`` never fires stalls only its own copies.
Segments and events are opened once per session and kept (a bounded number, the least recently
used closed first); they are closed when the session ends, once its copies have finished. Every
copy also records an event of the daemon's own per key (``busy``): an extent is not freed, sealed
or handed to anyone else while a copy into or out of it may still run. The client's ``done`` event
cannot serve for that, since the client may record it again.

A handle that does not open, a range past the end of its segment, or an event that is not one is
a BAD_HANDLE reply; nothing of it stays open. All CUDA calls run on the daemon's event-loop thread,
which holds no lock of its own (the GIL and the driver's locks must not wait on each other).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .wire import cuda as binding
from .wire.cuda import CudaError, bindings, check, device_uuid, fired, handle_from_bytes, register_pool, unregister_pool
from .wire.pool import SharedPool
from .wire.protocol import ErrorCode, ProtocolError

log = logging.getLogger("stormd")

MAX_SEGMENTS = 1024    # segments one session may have open; beyond, the least recently used idle one is closed
MAX_EVENTS = 4096      # events one session may have open; beyond, the least recently used is destroyed
_RANGES = ("stormd copy to host", "stormd copy to device")

def device_uuids() -> dict[str, int]:
    """UUID -> index of the GPUs this process sees (torch's spelling, which clients send)."""
    if not torch.cuda.is_available():
        return {}
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


def open_copier(pool: SharedPool) -> "CudaCopier | None":
    """The daemon's CUDA copier, or None (logged) where this process cannot copy CUDA memory: then
    clients copy their CUDA tensors into the pool themselves."""
    try:
        if not device_uuids():
            log.info("no CUDA device visible: clients copy CUDA tensors into the pool themselves")
            return None
        return CudaCopier(pool)
    except (ImportError, CudaError) as e:
        log.warning("CUDA copies off, clients copy CUDA tensors into the pool themselves", extra={"why": str(e)})
        return None


class Mark:
    """An event of the daemon's own, recorded after a copy: ``finished()`` never blocks. Its event
    comes from ``spares``, the spare events of the stream's device, and goes back there once
    nothing holds the mark: a copy per request made creating and destroying one a cost of every
    request. Recording a spare again is safe: nothing queries it any more."""

    __slots__ = ("event", "spares")

    def __init__(self, stream: Any, spares: list):
        rt = binding.rt
        if spares:
            self.event = spares.pop()
        else:
            err, self.event = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
            check(err, "cudaEventCreate")
        self.spares = spares
        check(rt.cudaEventRecord(self.event, stream)[0], "cudaEventRecord")

    def finished(self) -> bool:
        return fired(self.event)

    def __del__(self) -> None:
        self.spares.append(self.event)


@dataclass
class _Segment:
    device: int
    pointer: int
    size: int
    last: Mark | None = None  # the latest copy that reads or writes it


@dataclass
class _SessionCuda:
    streams: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # device -> (to host, to device)
    segments: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # handle -> _Segment
    events: collections.OrderedDict = field(default_factory=collections.OrderedDict)    # handle -> event
    busy: dict[int, Mark] = field(default_factory=dict)  # key -> the latest copy into or out of its extent


class CudaCopier:
    def __init__(self, pool: SharedPool):
        # binds binding.rt and binding.drv, which the rest of this module reads: none of it runs before a CudaCopier
        rt, drv = bindings()
        self.pool = pool
        self.uuids = device_uuids()
        if not self.uuids:
            raise CudaError("no CUDA device is visible to stormd")
        started = time.monotonic()
        # each device's primary context, bound by cuCtxSetCurrent before its calls: with clients on
        # two GPUs, cudaSetDevice switching between them cost the daemon host time on every request,
        # where binding a context costs next to none. Made for every
        # visible GPU at start (a node's training processes use them all; CUDA_VISIBLE_DEVICES limits it)
        self._contexts = []
        for index in range(len(self.uuids)):
            check(rt.cudaSetDevice(index)[0], "cudaSetDevice")
            check(rt.cudaFree(0)[0], "cudaFree")  # initialises the device's primary context
            err, context = drv.cuCtxGetCurrent()
            check(err, "cuCtxGetCurrent")
            self._contexts.append(context)
        self._bound = -1  # the device whose context _use bound last: every request names one, mostly the same
        self._use(0)
        locking = time.monotonic()
        register_pool(pool)
        # the page-lock alone: what the daemon spends once where every rank's embedded store spends it again
        self.page_lock_s = round(time.monotonic() - locking, 3)
        log.info("pool page-locked for CUDA copies", extra={
            "seconds": self.page_lock_s, "bytes": pool.page_locked_bytes, "devices": len(self.uuids),
            "contexts_s": round(locking - started, 3)})
        self._sessions: dict[int, _SessionCuda] = {}
        self._spare_events: dict[int, list] = {device: [] for device in range(len(self.uuids))}  # for Marks
        self._to_host = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._to_device = rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    @property
    def devices(self) -> list[str]:
        return sorted(self.uuids)

    def to_host(self, session: int, key: int, cuda: dict[str, Any], dst: int, nbytes: int) -> None:
        """Queue the copy of ``nbytes`` at the client's segment + offset into the pool at ``dst``."""
        s, device = self._session(session), self._device(cuda["device"])
        src = self._range(s, device, cuda, nbytes)
        self._copy(s, key, cuda, device, 0, dst, src, nbytes, self._to_host)

    def to_device(self, session: int, key: int, cuda: dict[str, Any], src: int, nbytes: int) -> None:
        """Queue the copy of ``nbytes`` at ``src`` in the pool into the client's segment + offset."""
        s, device = self._session(session), self._device(cuda["device"])
        dst = self._range(s, device, cuda, nbytes)
        self._copy(s, key, cuda, device, 1, dst, src, nbytes, self._to_device)

    def busy(self, session: int, keys: list[int]) -> list[int]:
        """The keys of ``keys`` whose extent a copy may still be reading or writing."""
        s = self._sessions.get(session)
        if s is None or not s.busy:
            return []
        still = []
        for k in keys:
            mark = s.busy.get(k)
            if mark is not None:
                if mark.finished():
                    del s.busy[k]
                else:
                    still.append(k)
        return still

    def idle(self, session: int) -> bool:
        s = self._sessions.get(session)
        return s is None or not self.busy(session, list(s.busy))

    def close_session(self, session: int) -> None:
        """Close what the session opened; call once ``idle(session)``."""
        s = self._sessions.pop(session, None)
        if s is None:
            return
        rt = binding.rt
        for seg in s.segments.values():
            self._use(seg.device)
            rt.cudaIpcCloseMemHandle(seg.pointer)
        for event in s.events.values():
            rt.cudaEventDestroy(event)
        for pair in s.streams.values():
            for stream in pair:
                rt.cudaStreamDestroy(stream)
        s.busy.clear()

    def open_segments(self) -> int:
        return sum(len(s.segments) for s in self._sessions.values())

    def close(self) -> None:
        for session in list(self._sessions):
            self.close_session(session)
        for spare in self._spare_events.values():  # a mark still held by nobody's copy returns none after this
            while spare:
                binding.rt.cudaEventDestroy(spare.pop())  # safe while pending: CUDA releases it once it completes
        unregister_pool(self.pool)

    # --- internals -------------------------------------------------------------

    def _session(self, session: int) -> _SessionCuda:
        s = self._sessions.get(session)
        if s is None:
            s = self._sessions[session] = _SessionCuda()
        return s

    def _device(self, uuid: str) -> int:
        index = self.uuids.get(uuid)
        if index is None:
            raise ProtocolError(ErrorCode.NO_CUDA, f"stormd sees no GPU with UUID {uuid!r}; it sees "
                                                   f"{self.devices} (run stormd where all training GPUs are visible)")
        self._use(index)
        return index

    def _use(self, device: int) -> None:
        """Bind ``device``'s primary context to this thread: the runtime calls that follow run there.
        Nothing else in the daemon binds one, so a device bound already needs no call."""
        if device != self._bound:
            check(binding.drv.cuCtxSetCurrent(self._contexts[device])[0], "cuCtxSetCurrent")
            self._bound = device

    def _range(self, s: _SessionCuda, device: int, cuda: dict[str, Any], nbytes: int) -> int:
        """The daemon's address of the client's [offset, offset + nbytes) in its segment."""
        seg = self._segment(s, device, cuda["handle"])
        if cuda["offset"] + nbytes > seg.size:
            raise ProtocolError(ErrorCode.BAD_HANDLE, f"{nbytes} bytes at offset {cuda['offset']} lie past the end "
                                                      f"of the {seg.size}-byte segment the handle names")
        return seg.pointer + cuda["offset"]

    def _segment(self, s: _SessionCuda, device: int, handle: bytes) -> _Segment:
        seg = s.segments.get(handle)
        if seg is not None:
            s.segments.move_to_end(handle)
            return seg
        if len(s.segments) >= MAX_SEGMENTS:
            self._close_idle_segment(s)
        rt = binding.rt
        err, pointer = rt.cudaIpcOpenMemHandle(handle_from_bytes(rt.cudaIpcMemHandle_t, handle),
                                               rt.cudaIpcMemLazyEnablePeerAccess)
        if int(err) != 0:
            rt.cudaGetLastError()
            raise ProtocolError(ErrorCode.BAD_HANDLE, f"the CUDA IPC memory handle does not open ({err.name}): not a "
                                                      f"live cudaMalloc segment of a process on this node's GPU")
        pointer = int(pointer)
        err, base, size = binding.drv.cuMemGetAddressRange(pointer)
        if int(err) != 0 or int(base) != pointer:
            rt.cudaIpcCloseMemHandle(pointer)
            raise CudaError(f"cuMemGetAddressRange of an opened IPC segment failed ({getattr(err, 'name', err)})")
        seg = s.segments[handle] = _Segment(device, pointer, int(size))
        return seg

    def _close_idle_segment(self, s: _SessionCuda) -> None:
        for handle, seg in s.segments.items():  # least recently used first
            if seg.last is None or seg.last.finished():
                del s.segments[handle]
                binding.rt.cudaIpcCloseMemHandle(seg.pointer)
                return
        raise ProtocolError(ErrorCode.COPY_IN_FLIGHT, f"all {MAX_SEGMENTS} segments this session has open have "
                                                      f"copies in flight; wait for some to finish")

    def _event(self, s: _SessionCuda, handle: bytes) -> Any:
        event = s.events.get(handle)
        if event is not None:
            s.events.move_to_end(handle)
            return event
        rt = binding.rt
        if len(s.events) >= MAX_EVENTS:
            rt.cudaEventDestroy(s.events.popitem(last=False)[1])  # safe while pending
        err, event = rt.cudaIpcOpenEventHandle(handle_from_bytes(rt.cudaIpcEventHandle_t, handle))
        if int(err) != 0:
            rt.cudaGetLastError()
            raise ProtocolError(ErrorCode.BAD_HANDLE, f"the CUDA IPC event handle does not open ({err.name}): not an "
                                                      f"interprocess event of a live process")
        s.events[handle] = event
        return event

    def _streams(self, s: _SessionCuda, device: int) -> tuple[Any, Any]:
        pair = s.streams.get(device)
        if pair is None:
            made = []
            for _ in range(2):
                err, stream = binding.rt.cudaStreamCreateWithFlags(binding.rt.cudaStreamNonBlocking)
                check(err, "cudaStreamCreate")
                made.append(stream)
            pair = s.streams[device] = (made[0], made[1])
        return pair

    def _copy(self, s: _SessionCuda, key: int, cuda: dict[str, Any], device: int, direction: int, dst: int,
              src: int, nbytes: int, kind: Any) -> None:
        torch._C._nvtx.rangePushA(_RANGES[direction])  # so a profile (nsys) shows the daemon's copies
        try:
            self._queue(s, key, cuda, device, direction, dst, src, nbytes, kind)
        finally:
            torch._C._nvtx.rangePop()

    def _queue(self, s: _SessionCuda, key: int, cuda: dict[str, Any], device: int, direction: int, dst: int,
               src: int, nbytes: int, kind: Any) -> None:
        ready, done = self._event(s, cuda["ready"]), self._event(s, cuda["done"])
        stream = self._streams(s, device)[direction]
        rt = binding.rt
        # A ready event that has fired needs no wait; one on the GPU waits for another process's work.
        if int(rt.cudaEventQuery(ready)[0]) != 0 and int(rt.cudaStreamWaitEvent(stream, ready, 0)[0]) != 0:
            rt.cudaGetLastError()
            raise ProtocolError(ErrorCode.BAD_HANDLE, "the ready event cannot be waited on from this GPU")
        check(rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)[0], "cudaMemcpyAsync")
        mark = Mark(stream, self._spare_events[device])
        s.busy[key] = s.segments[cuda["handle"]].last = mark
        if int(rt.cudaEventRecord(done, stream)[0]) != 0:
            # the copy stands (busy guards its extent); the client learns of it only through its error reply
            rt.cudaGetLastError()
            raise ProtocolError(ErrorCode.BAD_HANDLE, "the done event cannot be recorded on this GPU (an event "
                                                      "of another device?)")
