"""Host memory <-> the pool: CPU tensors, copied by the mover's worker thread.

The worker sends the PUT itself when it comes to the tensor, copies with
memcpy and checksums (xxh3) what it wrote; GET verifies the checksum on what
it read back (``verify``, on by default: a byte changed in the pool raises
StormIntegrityError instead of becoming data; off saves one hash pass over
every fetched byte). With a codec the worker encodes first (storm.kernels);
GET decodes.

A PUT reserves an extent of the node's shared pool, and one worker can copy
CPU tensors more slowly than a small model saves them: PUTs sent at save time
reserved the whole backlog, many times a step's working set, until clients of
the node were refused for a full pool. Sent by the worker, a client reserves
only the extent it is copying; and a put whose tensor backward no longer
needs before the worker reached it is cancelled (``Copy.cancel``): it takes
neither pool space nor the worker's time.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch
import xxhash

from storm.kernels import CorruptEncodedError, Encoded, decode, encode

from ..backend import Backend
from ..errors import StormIntegrityError
from .base import Copy, CopyHandler, Landed, PutRequest, fetched_fields, wait_reply


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def checksum(buf: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(buf.numpy()) if buf.numel() else 0


class CpuToPool(CopyHandler):
    """CPU tensors to and from the pool, on ``worker`` (one thread: the copies stay in order)."""

    def __init__(self, backend: Backend, worker: Executor):
        self.backend = backend
        self.worker = worker

    def put(self, req: PutRequest) -> Copy:
        return Copy.on(self.worker, self._put, req, cancellable=True)

    def get(self, key: int, nbytes: int, device: torch.device, verify: bool = True) -> Copy:
        return Copy.on(self.worker, self._get, key, nbytes, self.backend.request("GET", key=key), verify)

    def settle(self, key: int, landed: Landed) -> None:
        """Nothing: the worker sealed the put, with its checksum, as soon as it had copied it."""

    def _put(self, req: PutRequest) -> Landed:
        """On the worker: encoded (unless ``req.codec`` is raw), PUT for the size that takes, copied
        into the extent and sealed."""
        raw = req.source.nbytes()
        enc = None
        if req.codec != "raw":
            try:
                enc = encode(torch.empty(0, dtype=getattr(torch, req.meta["dtype"])).set_(req.source), req.codec)
            except ValueError:  # a dtype or a tensor the codec does not take: stored as it is
                pass
        if enc is None or enc.codec == "raw" or enc.nbytes >= raw:
            fields, data = {"nbytes": raw, "codec": "raw"}, storage_bytes(req.source)
        else:
            blob = enc.to_bytes()
            fields = {"nbytes": len(blob), "raw_nbytes": raw, "codec": enc.codec}
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        reply = self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta)
        offset = wait_reply(self.backend, "PUT", reply)["offset"]
        dst = self.backend.pool.view(offset, data.numel())
        dst.copy_(data)
        wait_reply(self.backend, "SEAL", self.backend.request("SEAL", key=req.key, checksum=checksum(dst)))
        return Landed(nbytes=data.numel())

    def _get(self, key: int, nbytes: int, reply: Any, verify: bool) -> Landed:
        r = fetched_fields(self.backend, key, nbytes, wait_reply(self.backend, "GET", reply))
        out = self.backend.pool.view(r["offset"], r["nbytes"]).clone()
        if verify and r["checksum"] is not None and checksum(out) != r["checksum"]:
            raise StormIntegrityError(f"key {key}: the bytes in the pool no longer match their checksum; "
                                      f"the saved tensor is lost (pool memory was overwritten)")
        if r["codec"] != "raw":
            try:
                out = decode(Encoded.from_bytes(out.numpy())).reshape(-1).view(torch.uint8)
            except CorruptEncodedError as e:
                raise StormIntegrityError(f"key {key}: the stored encoding does not decode ({e})") from None
        return Landed(tensor=out)
