"""The CUDA runtime binding stormd and its clients share: the bindings, IPC handle bytes, events, the pool's page-lock.

Both sides reach CUDA through the runtime's own Python bindings (cuda.bindings,
which CUDA builds of torch bring; CPU builds do not, so they load on first
use). What must match between the two sides lives here once: how an IPC handle
travels as bytes, how a GPU is named (by UUID, since indices differ between
processes under CUDA_VISIBLE_DEVICES), and the one page-lock of the pool per
process, which the daemon takes at start and a client with its first CUDA copy
of its own. The daemon's copier is stormd/copier.py, the client's streams
storm.gpu.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import torch

from .pool import SharedPool
from .protocol import IPC_HANDLE_BYTES

# cuda.bindings' runtime and driver modules, once bindings() has run: the one handle on them that
# storm.gpu and stormd/copier.py share. Their hot paths read ``binding.rt`` (an attribute, no call);
# each runs bindings() first where nothing before it has (a first CUDA copy, the copier's start).
rt: Any = None
drv: Any = None
_register_lock = threading.Lock()


def bindings() -> tuple[Any, Any]:
    """cuda.bindings' runtime and driver modules (CUDA builds of torch bring them; CPU builds do not),
    imported on first use and kept in ``rt`` and ``drv``."""
    global rt, drv
    if rt is None:
        from cuda.bindings import driver as _driver
        from cuda.bindings import runtime as _runtime
        rt, drv = _runtime, _driver
    return rt, drv


class CudaError(RuntimeError):
    """A CUDA call of this process's own failed (not something a peer sent): the daemon's calls, an
    event query or the pool's page-lock on either side."""


def check(err: Any, what: str, error: type[Exception] = CudaError) -> None:
    """Raise ``error`` naming the call ``what`` and the CUDA error, unless ``err`` is success. The
    client passes its own StormError, so that its CUDA failures stay STORM's errors."""
    if int(err) != 0:
        raise error(f"{what} failed: CUDA error {int(err)} ({getattr(err, 'name', err)})")


def fired(event: Any) -> bool:
    """Whether the work before the event's last record has run (an event never recorded has);
    never blocks."""
    err = rt.cudaEventQuery(event)[0]
    if err == rt.cudaError_t.cudaErrorNotReady:
        return False
    check(err, "cudaEventQuery")
    return True


def handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of an IPC memory or event handle, as they travel in a message."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def handle_from_bytes(cls: Any, data: bytes) -> Any:
    """An IPC handle of type ``cls`` (cudaIpcMemHandle_t, cudaIpcEventHandle_t) from its bytes in a message."""
    h = cls()
    ctypes.memmove(h.getPtr(), data, IPC_HANDLE_BYTES)
    return h


def device_uuid(index: int) -> str:
    """The UUID of the GPU this process calls ``index``, spelt as torch spells it: the client sends
    it with each copy and stormd's HELLO lists its own, so both must spell it the same."""
    return str(torch.cuda.get_device_properties(index).uuid)


_locking = threading.local()  # per thread: a client times its training thread's saves apart from its mover's


def record_locking(seconds: float) -> None:
    """This thread spent ``seconds`` page-locking a pool (or growing it, which page-locks what it adds)."""
    _locking.s = locking_s() + seconds


def locking_s() -> float:
    """Seconds this thread has spent page-locking pools: a cost of a pool's bytes, paid once, which a
    client leaves out of the host time it reads per save (storm.stats.OffloadStats.lock_s)."""
    return getattr(_locking, "s", 0.0)


def register_pool(pool: SharedPool) -> None:
    """Page-lock the pool once per process (cudaHostRegister, portable: usable from every device's
    context), so copies to and from it are DMA at link speed. It pins every page, about a second per
    GiB, so it runs once: at the daemon's start, or with a client's first CUDA copy of its own."""
    with _register_lock:
        if pool.cuda_registered:
            return
        _register(pool, 0, pool.size)
        pool.cuda_registered = True


def grow_pool(pool: SharedPool, size: int) -> None:
    """Grow the pool in place to ``size`` bytes (SharedPool.grow), page-locking what it adds first
    when the pool is page-locked, so that every byte an extent may use is locked alike. Raises
    CudaError, leaving the pool as it was, when the lock fails."""
    with _register_lock:
        if pool.cuda_registered and size > pool.size:
            _register(pool, pool.size, size - pool.size)
        pool.grow(size)


def _register(pool: SharedPool, offset: int, nbytes: int) -> None:
    runtime, _ = bindings()
    base = pool.address(0, 0)  # the start of the mapping, which reaches past pool.size when it may grow
    t0 = time.perf_counter()
    err = runtime.cudaHostRegister(base + offset, nbytes, runtime.cudaHostRegisterPortable)[0]
    record_locking(time.perf_counter() - t0)
    if int(err) != 0:
        raise CudaError(f"cudaHostRegister of {nbytes} bytes of the pool failed with CUDA error {int(err)}; "
                        f"check RLIMIT_MEMLOCK (ulimit -l) and free memory")
    pool.cuda_ranges.append((offset, nbytes))


def unregister_pool(pool: SharedPool) -> None:
    """Undo register_pool (and what grow_pool locked); must run before the pool is unmapped, or a
    later mapping at the same address cannot be registered (CUDA error 712)."""
    with _register_lock:
        if pool.cuda_ranges:
            base = pool.address(0, 0)
            for offset, _ in pool.cuda_ranges:
                bindings()[0].cudaHostUnregister(base + offset)
        pool.cuda_ranges.clear()
        pool.cuda_registered = False
