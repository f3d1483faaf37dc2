"""CUDA side of the mover: page-locking the pool, the per-device copy streams, events.

One device-to-host and one host-to-device stream per GPU, so saving (forward)
and fetching (backward) run at once in both directions of the link, beside
the training's compute stream. Copies are ordered by events, never by
synchronizing the device.

Copies and events go through the CUDA runtime's own Python bindings
(cuda.bindings, which CUDA builds of torch require) on raw pointers: on the
lent machine's CPU one ``torch.cuda.Event()`` with its record took 16 us, a
``torch.cuda.stream()`` context 16 us and a ``copy_`` 9 us, against 1.6 us for
a raw event record and 4 us for a raw cudaMemcpyAsync. The hooks run on the
training thread, so that host time is time the GPU waits for its next kernel.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from stormd.pool import SharedPool

from .errors import StormError

_pin_lock = threading.Lock()
_rt: Any = None  # cuda.bindings.runtime, imported with the first CUDA tensor (CPU builds lack it)


def runtime() -> Any:
    global _rt
    if _rt is None:
        from cuda.bindings import runtime as rt
        _rt = rt
    return _rt


def _check(err: Any, what: str) -> None:
    if err != _rt.cudaError_t.cudaSuccess:
        raise StormError(f"{what} failed: CUDA error {int(err)} ({err.name})")


def pin_pool(pool: SharedPool) -> None:
    """Page-lock the pool once per process (cudaHostRegister), so copies to and from it are DMA.

    Registering pins every page: it takes about a second per GiB and commits the
    memory, so it happens on the first CUDA tensor, not at import."""
    with _pin_lock:
        if pool.cuda_registered:
            return
        # cudaHostRegisterPortable: usable from every CUDA context of the process
        err = torch.cuda.cudart().cudaHostRegister(pool.address(0, pool.size), pool.size, 1)
        if int(err) != 0:
            raise StormError(f"cudaHostRegister of the {pool.size}-byte pool failed with CUDA error {int(err)}; "
                             f"check RLIMIT_MEMLOCK (ulimit -l) and free memory")
        pool.cuda_registered = True


def unpin_pool(pool: SharedPool) -> None:
    """Undo pin_pool; must run before the pool is unmapped, or a later mapping at the same
    address cannot be registered (CUDA error 712)."""
    with _pin_lock:
        if pool.cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(pool.address(0, pool.size))
            pool.cuda_registered = False


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
        _check(_rt.cudaEventRecord(self.handle, stream)[0], "cudaEventRecord")
        return self

    def query(self) -> bool:
        """True once the work before the record has run; never blocks."""
        err = _rt.cudaEventQuery(self.handle)[0]
        if err == _rt.cudaError_t.cudaErrorNotReady:
            return False
        _check(err, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        _check(_rt.cudaEventSynchronize(self.handle)[0], "cudaEventSynchronize")

    done, wait = query, synchronize  # so an event can stand where a Transfer is waited on

    def __del__(self) -> None:
        # Safe while the event is still pending: CUDA releases it once it completes.
        if _rt is not None:
            _rt.cudaEventDestroy(self.handle)


class OnDevice:
    """Make a device the calling thread's current one for a moment: CUDA events belong to the
    device current when they are created, and the mover thread starts on device 0."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        self.previous = _rt.cudaGetDevice()[1]
        if self.previous != self.index:
            _check(_rt.cudaSetDevice(self.index)[0], "cudaSetDevice")

    def __exit__(self, *exc: Any) -> None:
        if self.previous != self.index:
            _rt.cudaSetDevice(self.previous)


def current_stream(device: torch.device) -> int:
    """The raw handle of the stream torch's ops on ``device`` run on now."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def record_ready(device: torch.device) -> CopyEvent:
    """An event marking the point on the compute stream where a saved tensor is complete."""
    runtime()
    with OnDevice(device.index):
        return CopyEvent().record(current_stream(device))


def consume(t: torch.Tensor, arrived: CopyEvent) -> None:
    """Make the compute stream wait for the copy that filled ``t`` (the host does not wait), and
    tell the allocator the compute stream uses ``t``, which was allocated on the copy stream."""
    _check(_rt.cudaStreamWaitEvent(current_stream(t.device), arrived.handle, 0)[0], "cudaStreamWaitEvent")
    t.record_stream(torch.cuda.current_stream(t.device.index))


class DeviceStreams:
    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._d2h, self._h2d = self.d2h.cuda_stream, self.h2d.cuda_stream
        rt = runtime()
        self._to_host, self._to_device = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, rt.cudaMemcpyKind.cudaMemcpyHostToDevice

    def to_host(self, dst: int, src: torch.UntypedStorage, ready: CopyEvent) -> CopyEvent:
        """Queue ``src`` (a device storage) -> pinned address ``dst`` after ``ready``; returns the event
        marking its end."""
        rt = _rt
        with OnDevice(self.device.index):
            _check(rt.cudaStreamWaitEvent(self._d2h, ready.handle, 0)[0], "cudaStreamWaitEvent")
            _check(rt.cudaMemcpyAsync(dst, src.data_ptr(), src.nbytes(), self._to_host, self._d2h)[0],
                   "cudaMemcpyAsync to host")
            return CopyEvent().record(self._d2h)

    def to_device(self, src: int, nbytes: int, after: CopyEvent | None) -> tuple[torch.Tensor, CopyEvent]:
        """Queue pinned address ``src`` -> a new device buffer, after the put's event if it is still running.

        The buffer is allocated on the copy stream, so the allocator orders its reuse
        after the copy, not after whatever the compute stream has queued meanwhile."""
        rt = _rt
        with OnDevice(self.device.index):
            out = self._empty_on_h2d(nbytes)
            if after is not None:
                _check(rt.cudaStreamWaitEvent(self._h2d, after.handle, 0)[0], "cudaStreamWaitEvent")
            _check(rt.cudaMemcpyAsync(out.data_ptr(), src, nbytes, self._to_device, self._h2d)[0],
                   "cudaMemcpyAsync to device")
            return out, CopyEvent().record(self._h2d)

    def _empty_on_h2d(self, nbytes: int) -> torch.Tensor:
        """torch.empty from the copy stream's pool. ``torch.cuda.stream()`` does this by setting the
        current stream, at 16 us a context on the lent host; setting it directly costs a fraction."""
        index = self.device.index
        if torch._C._cuda_getDevice() != index:  # setting a stream also switches the current device
            with torch.cuda.stream(self.h2d):
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        prev = torch._C._cuda_getCurrentStream(index)
        h2d = self.h2d
        torch._C._cuda_setStream(stream_id=h2d.stream_id, device_index=index, device_type=h2d.device_type)
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        finally:
            torch._C._cuda_setStream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
