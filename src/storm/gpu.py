"""CUDA side of the mover: the per-device copy streams, events, IPC export of memory and events.

One device-to-host and one host-to-device stream per GPU, so saving (forward)
and fetching (backward) run at once in both directions of the link, beside
the training's compute stream. Copies are ordered by events, never by
synchronizing the device.

Copies and events go through the CUDA runtime's own Python bindings
(cuda.bindings, which CUDA builds of torch require) on raw pointers: torch's
``torch.cuda.Event()`` with its record, a ``torch.cuda.stream()`` context and
a ``copy_`` each cost several times the host time of the raw event record or
cudaMemcpyAsync they wrap. The hooks run on the training thread, so that host
time is time the GPU waits for its next kernel.
"""

from __future__ import annotations

import collections
import contextlib
import gc
from typing import TYPE_CHECKING, Any

import torch

from stormd.wire import cuda as binding
from stormd.wire.cuda import bindings, check, fired, handle_bytes

from .errors import StormError

if TYPE_CHECKING:
    from .frames import FrameKind


def runtime() -> Any:
    """cuda.bindings.runtime, imported with the first CUDA tensor (CPU builds lack it). The handle is
    the shared binding's (stormd.wire.cuda), which the daemon's copier uses too; once this has run,
    the hooks' hot path reads it as ``binding.rt``, without a call."""
    return bindings()[0]


def _check(err: Any, what: str) -> None:
    check(err, what, StormError)  # the client's CUDA failures are STORM's errors


class NvtxRange:
    """An NVTX range around STORM's host work for a CUDA tensor, so profiles show it
    (two C calls: ``torch.cuda.nvtx.range`` is a generator context, several times dearer)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        torch._C._nvtx.rangePushA(self.name)

    def __exit__(self, *exc: Any) -> None:
        torch._C._nvtx.rangePop()


_PACK, _UNPACK, _NONE = NvtxRange("storm pack"), NvtxRange("storm unpack"), contextlib.nullcontext()


def pack_range(device: torch.device) -> Any:
    return _PACK if device.type == "cuda" else _NONE


def unpack_range(device: torch.device) -> Any:
    return _UNPACK if device.type == "cuda" else _NONE


class CopyEvent:
    """A CUDA event without timing: recorded on one stream, waited on by another or by the host."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        rt = runtime()
        err, self.handle = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
        _check(err, "cudaEventCreate")

    def record(self, stream: int) -> "CopyEvent":
        _check(binding.rt.cudaEventRecord(self.handle, stream)[0], "cudaEventRecord")
        return self

    def query(self) -> bool:
        """True once the work before the record has run; never blocks."""
        return fired(self.handle)

    def synchronize(self) -> None:
        _check(binding.rt.cudaEventSynchronize(self.handle)[0], "cudaEventSynchronize")

    done, wait = query, synchronize  # so an event can stand where a Copy is waited on

    def __del__(self) -> None:
        # Safe while the event is still pending: CUDA releases it once it completes.
        if binding.rt is not None:
            binding.rt.cudaEventDestroy(self.handle)


class IpcEvent(CopyEvent):
    """An interprocess event, which stormd waits on or records through CUDA IPC (``wire``: its handle's
    bytes). They come from a per-device free list: one that nothing references goes back there, since
    creating and exporting one, and stormd opening it, cost more than reuse. Reuse is safe because
    stormd touches an event only while answering the request that named it, and replies come in
    order: a reused event is waited on or queried only after its new request's reply."""

    __slots__ = ("wire", "device")

    def __del__(self) -> None:
        _free_ipc_events[self.device].append((self.handle, self.wire))


_free_ipc_events: dict[int, collections.deque] = collections.defaultdict(collections.deque)


def ipc_event(device: int) -> IpcEvent:
    """An interprocess event of GPU ``device``, from the free list or new."""
    free = _free_ipc_events[device]
    if not free:
        try:
            free.append(_new_ipc_event(device))
        except StormError:  # the process's interprocess events ran out: find those only cycles still hold
            gc.collect()
            if not free:
                raise
    handle, wire = free.pop()
    event = IpcEvent.__new__(IpcEvent)
    event.handle, event.wire, event.device = handle, wire, device
    return event


def _new_ipc_event(device: int) -> tuple[Any, bytes]:
    rt = runtime()
    with OnDevice(device):
        err, handle = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming | rt.cudaEventInterprocess)
        _check(err, "cudaEventCreate (interprocess; a process may have about 20,000)")
        err, exported = rt.cudaIpcGetEventHandle(handle)
        _check(err, "cudaIpcGetEventHandle")
    return handle, handle_bytes(exported)


class NotExportable(StormError):
    """This process's CUDA memory cannot go through cudaIpcGetMemHandle."""


def export(pointer: int, device: int) -> tuple[bytes, int]:
    """The IPC handle of the cudaMalloc segment holding ``pointer``, and the offset of ``pointer`` in
    it (a handle names a whole segment; the allocator carves tensors out of segments)."""
    rt, drv = bindings()
    with OnDevice(device):
        err, base, _ = drv.cuMemGetAddressRange(pointer)
        if int(err) == 0:
            base = int(base)
            err, handle = rt.cudaIpcGetMemHandle(base)
        if int(err) != 0:
            rt.cudaGetLastError()
            raise NotExportable(
                f"this process's CUDA memory cannot be exported through CUDA IPC (CUDA error {int(err)}, "
                f"{getattr(err, 'name', err)}): PyTorch's expandable_segments (PYTORCH_CUDA_ALLOC_CONF) and "
                f"allocators other than cudaMalloc make memory that cudaIpcGetMemHandle refuses")
    return handle_bytes(handle), pointer - base


class OnDevice:
    """Make a device the calling thread's current one for a moment: CUDA events belong to the
    device current when they are created, and the mover thread starts on device 0."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        self.previous = binding.rt.cudaGetDevice()[1]
        if self.previous != self.index:
            _check(binding.rt.cudaSetDevice(self.index)[0], "cudaSetDevice")

    def __exit__(self, *exc: Any) -> None:
        if self.previous != self.index:
            binding.rt.cudaSetDevice(self.previous)


def allocated(device: torch.device) -> int:
    """Bytes the caching allocator has handed out on ``device`` now: ``torch.cuda.memory_allocated``
    without its flattening of every statistic into one dict, which costs an order of magnitude more
    host time a call (it is read at each of backward's markers, many a step)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["current"]


def allocated_or_none(device: torch.device) -> int | None:
    """``allocated`` on a CUDA device; None elsewhere (no caching allocator to read)."""
    return allocated(device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> int:
    """The raw handle of the stream torch's ops on ``device`` run on now."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def record_ready(device: torch.device, interprocess: bool = False) -> CopyEvent:
    """An event marking the point on the compute stream where a saved tensor is complete
    (``interprocess``: one stormd can wait on, when it copies the tensor itself)."""
    runtime()
    with OnDevice(device.index):
        event = ipc_event(device.index) if interprocess else CopyEvent()
        return event.record(current_stream(device))


def consume(t: torch.Tensor, arrived: CopyEvent) -> None:
    """Make the compute stream wait for the copy that filled ``t`` (the host does not wait), and
    tell the allocator the compute stream uses ``t``, which was allocated on the copy stream. A copy
    already done (prefetched) needs no wait: the compute stream then never waits on another
    process's event, a wait that costs more than a local one."""
    wait_on_compute(t.device, arrived)
    t.record_stream(torch.cuda.current_stream(t.device.index))


def wait_on_compute(device: torch.device, event: CopyEvent) -> None:
    """Make the compute stream of ``device`` wait for ``event``, unless it has fired already."""
    if not event.query():
        _check(binding.rt.cudaStreamWaitEvent(current_stream(device), event.handle, 0)[0], "cudaStreamWaitEvent")


class OnStream:
    """Make ``stream`` torch's current stream for a moment, so that torch.empty allocates from its
    pool and Triton launches on it. ``torch.cuda.stream()`` does this too, at several times the host
    time of setting it directly."""

    __slots__ = ("stream", "previous", "fallback")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream

    def __enter__(self) -> None:
        s = self.stream
        self.fallback = None
        if torch._C._cuda_getDevice() != s.device_index:  # setting a stream also switches the current device
            self.fallback = torch.cuda.stream(s)
            self.fallback.__enter__()
            return
        self.previous = torch._C._cuda_getCurrentStream(s.device_index)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def __exit__(self, *exc: Any) -> None:
        if self.fallback is not None:
            self.fallback.__exit__(*exc)
            return
        p = self.previous
        torch._C._cuda_setStream(stream_id=p[0], device_index=p[1], device_type=p[2])


class DeviceStreams:
    """The copy streams of one GPU, and two codec streams for frames, so that encoding the next
    tensor overlaps copying this one. The codec streams have high priority: their kernels are
    short and memory-bound, and a copy waits on them while the link idles.

    Buffers made here are allocated on the stream that fills them; one read on another stream is
    marked with record_stream, so the allocator hands it out again only after that read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._d2h, self._h2d = self.d2h.cuda_stream, self.h2d.cuda_stream
        self._on_h2d = OnStream(self.h2d)
        self._codec: tuple[OnStream, OnStream] | None = None  # (encode, decode), made with the first frame
        kinds = runtime().cudaMemcpyKind
        self._to_host, self._to_device = kinds.cudaMemcpyDeviceToHost, kinds.cudaMemcpyHostToDevice

    def _codec_streams(self) -> tuple[OnStream, OnStream]:
        if self._codec is None:
            # priority -1: a stream of torch's high-priority pool
            self._codec = (OnStream(torch.cuda.Stream(self.device, priority=-1)),
                           OnStream(torch.cuda.Stream(self.device, priority=-1)))
        return self._codec

    def to_host(self, dst: int, src: torch.UntypedStorage, ready: CopyEvent) -> CopyEvent:
        """Queue ``src`` (a device storage) -> pinned address ``dst`` after ``ready``; returns the event
        marking its end."""
        with OnDevice(self.device.index):
            self._wait(self._d2h, ready)
            self._copy(dst, src.data_ptr(), src.nbytes(), self._to_host, self._d2h)
            return CopyEvent().record(self._d2h)

    def encode(self, src: torch.UntypedStorage, ready: CopyEvent, kind: FrameKind) -> tuple[torch.Tensor, CopyEvent]:
        """Encode ``src`` into a new frame of ``kind`` (storm/frames.py) on the encode stream after
        ``ready``; returns the frame and the event marking the end of its encoding."""
        encode = self._codec_streams()[0]
        with OnDevice(self.device.index):
            stream = encode.stream.cuda_stream
            self._wait(stream, ready)
            with encode:
                raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(src)
                frame = torch.empty(kind.nbytes(raw.numel()), dtype=torch.uint8, device=self.device)
                kind.encode(raw, frame)
            return frame, CopyEvent().record(stream)

    def to_host_frame(self, dst: int, src: torch.UntypedStorage, ready: CopyEvent, kind: FrameKind) -> CopyEvent:
        """Encode ``src`` into a frame of ``kind`` and queue the frame -> ``dst`` on the device-to-host
        stream after that; returns the event marking the copy's end."""
        frame, encoded = self.encode(src, ready, kind)
        with OnDevice(self.device.index):
            self._wait(self._d2h, encoded)
            self._copy(dst, frame.data_ptr(), frame.numel(), self._to_host, self._d2h)
            frame.record_stream(self.d2h)
            return CopyEvent().record(self._d2h)

    def destination(self, nbytes: int) -> tuple[torch.Tensor, IpcEvent]:
        """A new device buffer for stormd to copy into, and the interprocess event after which it may
        (allocated on the host-to-device stream, which orders the buffer's earlier uses)."""
        with OnDevice(self.device.index):
            with self._on_h2d:
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return out, ipc_event(self.device.index).record(self._h2d)

    def to_device(self, src: int, nbytes: int) -> tuple[torch.Tensor, CopyEvent]:
        """Queue pinned address ``src`` -> a new device buffer (the session fetches a key only once its
        put's copy has finished)."""
        with OnDevice(self.device.index):
            with self._on_h2d:
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._copy(out.data_ptr(), src, nbytes, self._to_device, self._h2d)
            return out, CopyEvent().record(self._h2d)

    def decode(self, frame: torch.Tensor, raw_nbytes: int, arrived: CopyEvent,
               kind: FrameKind) -> tuple[torch.Tensor, CopyEvent]:
        """Decode ``frame`` of ``kind`` (on the device once ``arrived`` fires) into a new buffer of
        ``raw_nbytes`` on the decode stream; returns that buffer and the event marking the end of its
        decoding."""
        decode = self._codec_streams()[1]
        with OnDevice(self.device.index):
            stream = decode.stream.cuda_stream
            self._wait(stream, arrived)
            with decode:
                out = torch.empty(raw_nbytes, dtype=torch.uint8, device=self.device)
                kind.decode(frame, out)
            frame.record_stream(decode.stream)
            return out, CopyEvent().record(stream)

    def to_device_frame(self, src: int, nbytes: int, raw_nbytes: int,
                        kind: FrameKind) -> tuple[torch.Tensor, CopyEvent]:
        """Queue the frame of ``kind`` at pinned address ``src`` (``nbytes``) -> the device, then its decoding."""
        frame, arrived = self.to_device(src, nbytes)
        return self.decode(frame, raw_nbytes, arrived, kind)

    @staticmethod
    def _wait(stream: int, event: CopyEvent | None) -> None:
        if event is not None:
            _check(binding.rt.cudaStreamWaitEvent(stream, event.handle, 0)[0], "cudaStreamWaitEvent")

    @staticmethod
    def _copy(dst: int, src: int, nbytes: int, kind: Any, stream: int) -> None:
        _check(binding.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)[0], "cudaMemcpyAsync")
