"""CUDA side of the mover: page-locking the pool and the per-device copy streams.

One device-to-host and one host-to-device stream per GPU, so saving (forward)
and fetching (backward) run at once in both directions of the link, beside
the training's compute stream. Copies are ordered by events, never by
synchronizing the device.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from stormd.pool import SharedPool

from .errors import StormError

_pin_lock = threading.Lock()


def pin_pool(pool: SharedPool) -> None:
    """Page-lock the pool once per process (cudaHostRegister), so copies to and from it are DMA.

    Registering pins every page: it takes about a second per GiB and commits the
    memory, so it happens on the first CUDA tensor, not at import."""
    with _pin_lock:
        if pool.cuda_registered:
            return
        base = pool.view(0, pool.size)
        # cudaHostRegisterPortable: usable from every CUDA context of the process
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), pool.size, 1)
        if int(err) != 0:
            raise StormError(f"cudaHostRegister of the {pool.size}-byte pool failed with CUDA error {int(err)}; "
                             f"check RLIMIT_MEMLOCK (ulimit -l) and free memory")
        pool.cuda_registered = True


def unpin_pool(pool: SharedPool) -> None:
    """Undo pin_pool; must run before the pool is unmapped, or a later mapping at the same
    address cannot be registered (CUDA error 712)."""
    with _pin_lock:
        if pool.cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(pool.view(0, pool.size).data_ptr())
            pool.cuda_registered = False


def hook_range(name: str, device: torch.device) -> Any:
    """An NVTX range around a pack or unpack hook of a CUDA tensor, so profiles show STORM's host time."""
    return torch.cuda.nvtx.range(name) if device.type == "cuda" else contextlib.nullcontext()


class DeviceStreams:
    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, ready: Any) -> torch.cuda.Event:
        """Queue src (device) -> dst (pinned pool) after ``ready``; returns the event marking its end."""
        done = torch.cuda.Event()
        with torch.cuda.stream(self.d2h), torch.cuda.nvtx.range(f"storm to host {src.numel()} B"):
            self.d2h.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done.record(self.d2h)
        return done

    def to_device(self, src: torch.Tensor, after: Any) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue src (pinned pool) -> a new device buffer, after the put's event if it is still running."""
        done = torch.cuda.Event()
        with torch.cuda.stream(self.h2d), torch.cuda.nvtx.range(f"storm to device {src.numel()} B"):
            if after is not None:
                self.h2d.wait_event(after)
            out = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(src, non_blocking=True)
            done.record(self.h2d)
        return out, done
