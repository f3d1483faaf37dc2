"""Fakes the copy handlers' tests inject: a store that answers PUT, SEAL and GET over a pool that is
a plain tensor, CUDA events that fire when told, and a device's copy streams that record what
they were asked to queue (the CUDA paths, driven on the CPU)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from storm.replies import Resolved, resolve


class FakePool:
    def __init__(self, size: int = 1 << 20):
        self.buf = torch.zeros(size, dtype=torch.uint8)
        self.cuda_registered = True

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset:offset + nbytes]

    def address(self, offset: int, nbytes: int) -> int:
        return self.buf.data_ptr() + offset


class FakeStore:
    """A backend: extents handed out one after the other; ``later``: replies wait until ``answer()``."""

    name = "a fake store"

    def __init__(self, cuda_devices: frozenset[str] = frozenset(), later: bool = False,
                 refuse: str | None = None):
        self.pool = FakePool()
        self.cuda_devices = cuda_devices
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.entries: dict[int, dict[str, Any]] = {}
        self._next = 0
        self._later = later
        self._waiting: list[tuple[Future, dict[str, Any]]] = []
        self._refuse = refuse  # an error code every request gets

    def request(self, op: str, **fields: Any) -> Future | Resolved:
        self.sent.append((op, fields))
        reply = self._answer(op, fields)
        if not self._later:
            return Resolved.reply(reply)
        fut: Future = Future()
        self._waiting.append((fut, reply))
        return fut

    def answer(self) -> None:
        for fut, reply in self._waiting:
            resolve(fut, reply)
        self._waiting.clear()

    def _answer(self, op: str, f: dict[str, Any]) -> dict[str, Any]:
        if self._refuse:
            return {"ok": False, "error": self._refuse, "message": "refused"}
        if op == "PUT":
            e = self.entries[f["key"]] = {"offset": self._next, "nbytes": f["nbytes"], "codec": f["codec"],
                                          "raw_nbytes": f.get("raw_nbytes", f["nbytes"]), "checksum": None}
            self._next += f["nbytes"]
            return {"ok": True, "offset": e["offset"]}
        if op == "SEAL":
            self.entries[f["key"]]["checksum"] = f.get("checksum")
            return {"ok": True}
        if op == "GET":
            return {"ok": True, **self.entries[f["key"]]}
        return {"ok": True}


class FakeEvent:
    def __init__(self, fired: bool = True, wire: bytes = b"event"):
        self.fired = fired
        self.wire = wire
        self.synchronized = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.synchronized = self.fired = True


class FakeStreams:
    """A device's copy streams: each copy is recorded, and its event returned (not fired)."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, tuple]] = []

    def _queue(self, what: str, *args: Any) -> FakeEvent:
        self.queued.append((what, args))
        return FakeEvent(fired=False)

    def to_host(self, dst: int, src: torch.UntypedStorage, ready: Any) -> FakeEvent:
        return self._queue("to_host", dst, src.nbytes(), ready)

    def to_host_frame(self, dst: int, src: torch.UntypedStorage, ready: Any, kind: Any) -> FakeEvent:
        return self._queue("to_host_frame", dst, src.nbytes(), ready, kind)

    def to_device(self, src: int, nbytes: int) -> tuple[torch.Tensor, FakeEvent]:
        return torch.empty(nbytes, dtype=torch.uint8), self._queue("to_device", src, nbytes)

    def to_device_frame(self, src: int, nbytes: int, raw_nbytes: int, kind: Any) -> tuple[torch.Tensor, FakeEvent]:
        return torch.empty(raw_nbytes, dtype=torch.uint8), self._queue("to_device_frame", src, nbytes, raw_nbytes,
                                                                        kind)

    def destination(self, nbytes: int) -> tuple[torch.Tensor, FakeEvent]:
        return torch.empty(nbytes, dtype=torch.uint8), FakeEvent(wire=b"destination ready")


def storage(nbytes: int, fill: int = 7) -> torch.UntypedStorage:
    return torch.full((nbytes,), fill, dtype=torch.uint8).untyped_storage()


class CudaStorage:
    """What the handlers read of a CUDA tensor's storage: its device, address and size."""

    def __init__(self, nbytes: int, device: torch.device = torch.device("cuda", 0)):
        self.device = device
        self._nbytes = nbytes

    def data_ptr(self) -> int:
        return 1 << 40

    def nbytes(self) -> int:
        return self._nbytes
