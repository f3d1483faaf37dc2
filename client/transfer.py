"""The mover: copies tensors' bytes into pool extents and back, on one worker thread.

The training thread never waits for a round trip when saving: it hands the
storage to the mover, which asks the store for an extent (PUT), copies,
checksums and seals it. Fetches (GET) run on the same thread, so a prefetch
overlaps the training thread's compute.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .backend import Backend
from .errors import StormIntegrityError, StormUnavailable

REQUEST_TIMEOUT = 30.0
log = logging.getLogger("storm")


def _log_failure(fut: Future) -> None:
    if fut.exception() is not None:
        log.warning("storm: freeing keys failed: %s", fut.exception())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage ``t`` views (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def checksum(buf: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(buf.numpy()) if buf.numel() else 0


@dataclass(frozen=True)
class PutRequest:
    key: int
    step: int
    source: torch.Tensor   # uint8 view of the storage to store
    meta: dict[str, Any]   # dtype, shape, strides, storage_offset of the saved view
    ready: Any = None      # torch.cuda.Event recorded where the tensor was produced, or None


class Mover:
    def __init__(self, backend: Backend):
        self.backend = backend
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="storm-mover")

    def put(self, req: PutRequest) -> Future:
        """Future of the stored bytes' checksum; raises StormRequestError when the store refuses."""
        return self._worker.submit(self._put, req)

    def get(self, key: int, nbytes: int) -> Future:
        """Future of a fresh CPU uint8 tensor holding the key's bytes, checksum verified."""
        return self._worker.submit(self._get, key, nbytes)

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            return self.backend.request(op, **fields).result(REQUEST_TIMEOUT)
        except TimeoutError:
            raise StormUnavailable(f"{self.backend.name} did not answer {op} within {REQUEST_TIMEOUT:g} s") from None

    def _put(self, req: PutRequest) -> int:
        nbytes = req.source.numel()
        reply = self._call("PUT", key=req.key, step=req.step, nbytes=nbytes, codec="raw", **req.meta)
        if req.ready is not None:
            req.ready.synchronize()  # the producing stream has written the tensor
        dst = self.backend.pool.view(reply["offset"], nbytes)
        dst.copy_(req.source)
        digest = checksum(dst)
        self._call("SEAL", key=req.key, checksum=digest)
        return digest

    def _get(self, key: int, nbytes: int) -> torch.Tensor:
        reply = self._call("GET", key=key)
        if reply["nbytes"] != nbytes:
            raise StormIntegrityError(f"key {key}: store returned {reply['nbytes']} bytes, {nbytes} were stored")
        out = self.backend.pool.view(reply["offset"], nbytes).clone()
        if checksum(out) != reply["checksum"]:
            raise StormIntegrityError(f"key {key}: the bytes in the pool no longer match their checksum; "
                                      f"the saved tensor is lost (pool memory was overwritten)")
        return out

    def request(self, op: str, **fields: Any) -> Future:
        """A request queued behind the copies already submitted (so STATS sees earlier FREEs)."""
        return self._worker.submit(self._call, op, **fields)

    def free(self, keys: list[int]) -> None:
        if keys:
            self.request("FREE", keys=keys).add_done_callback(_log_failure)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
