"""A GPU <-> the pool, copied by stormd through CUDA IPC (a daemon whose HELLO lists the GPU in
``cuda_devices``).

PUT and GET name the tensor's (or destination's) cudaMalloc segment by its
IPC handle, with an interprocess ready event; stormd queues the copy on its
own streams and records the request's interprocess done event, which the Copy
holds, read off the reply without the worker. stormd seals the key itself once
its copy has finished, so no SEAL is sent. A PUT whose tensor the GPU has not
finished yet is sent by the worker once it has (the worker waits for the GPU,
not for the reply): stormd's copy stream never waits on another process's
event, since such waits held back the copies of every client behind it. The
mover exports the tensor's memory when it routes the save (``export``): memory
that cannot be exported (expandable_segments) raises NotExportable there, and
the save takes cuda_to_pool instead.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any, Callable

import torch

from stormd.wire.cuda import device_uuid

from ..backend import Backend
from ..errors import StormIntegrityError
from ..gpu import DeviceStreams, IpcEvent, export, ipc_event
from ..replies import Resolved
from .base import Copy, CopyHandler, Landed, PutRequest


class CudaByDaemon(CopyHandler):
    """CUDA tensors that stormd copies out of (and into) this process's memory. ``streams``: a device's
    streams (the destination of a get is allocated on its host-to-device stream); ``export`` and
    ``ipc_event`` (storm/gpu.py's, by default) name memory and make events for stormd;
    ``uuid_of``: a device index's UUID."""

    def __init__(self, backend: Backend, worker: Executor, streams: Callable[[torch.device], DeviceStreams],
                 export: Callable[[int, int], tuple[bytes, int]] = export,
                 ipc_event: Callable[[int], IpcEvent] = ipc_event,
                 uuid_of: Callable[[int], str | None] = device_uuid):
        self.backend = backend
        self.worker = worker
        self.streams = streams
        self._export, self._ipc_event, self._uuid_of = export, ipc_event, uuid_of
        self._uuids: dict[int, str | None] = {}  # device index -> its UUID where the store copies its memory

    def serves(self, device: torch.device) -> bool:
        """Whether the store copies this GPU's memory itself."""
        u = self._uuids.get(device.index, False)
        if u is False:
            u = self._uuid_of(device.index)
            u = self._uuids[device.index] = u if u in self.backend.cuda_devices else None
        return u is not None

    def export(self, source: torch.UntypedStorage) -> tuple[bytes, int]:
        """The IPC handle of the memory holding ``source`` and its offset in it; NotExportable where
        CUDA IPC cannot name it."""
        return self._export(source.data_ptr(), source.device.index)

    def put(self, req: PutRequest) -> Copy:
        """stormd copies the storage out of this process's memory, named by ``req.ipc`` (the session
        holds it until then). Raw: frames are this process's to copy."""
        device = req.source.device
        handle, offset = req.ipc
        done = self._ipc_event(device.index)
        fields = {"nbytes": req.source.nbytes(), "codec": "raw"}
        cuda = {"handle": handle, "offset": offset, "device": self._uuids[device.index], "ready": req.ready.wire,
                "done": done.wire}
        landed = Landed(nbytes=fields["nbytes"], event=done)
        def send() -> Future | Resolved:
            return self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta, cuda=cuda)

        if not req.ready.query():
            # stormd's copy stream would wait on this process's event, and such waits held its copies back
            # (module docstring): the worker sends the PUT once the tensor is complete, and goes on to the
            # next without waiting for the reply
            def when_ready() -> Future | Resolved:
                req.ready.synchronize()  # the runtime lets go of the GIL while it waits
                return send()
            return Copy.sent_on(self.worker, self.backend, "PUT", when_ready, lambda _: landed)
        return Copy.from_reply(self.backend, "PUT", send(), lambda _: landed)  # stormd has queued the copy

    def settle(self, key: int, landed: Landed) -> None:
        """Nothing: stormd seals what it copies, once its copy has finished."""

    def get(self, key: int, nbytes: int, device: torch.device, verify: bool = True) -> Copy:
        """stormd copies the stored bytes into a buffer this process allocated (after the put, which
        stormd's own streams ordered)."""
        buf, ready = self.streams(device).destination(nbytes)
        handle, offset = self._export(buf.data_ptr(), device.index)
        done = self._ipc_event(device.index)
        reply = self.backend.request("GET", key=key, cuda={"handle": handle, "offset": offset, "ready": ready.wire,
                                                           "device": self._uuids[device.index], "done": done.wire})
        # ``ready`` is held until the reply (the future holds its callbacks): recorded again for another
        # request before stormd waited on it, it could make stormd's copy wait for work that waits for this copy
        reply.add_done_callback(lambda _, held=ready: None)

        def queued(r: dict[str, Any]) -> Landed:
            if r["nbytes"] != buf.numel() or r["codec"] != "raw":
                raise StormIntegrityError(f"key {key}: store returned {r['nbytes']} bytes ({r['codec']}), "
                                          f"{buf.numel()} raw bytes were stored")
            return Landed(tensor=buf, event=done)
        return Copy.from_reply(self.backend, "GET", reply, queued)
