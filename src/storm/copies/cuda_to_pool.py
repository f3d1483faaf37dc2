"""A GPU <-> the pool, copied by this process on its own streams (storm/gpu.py), raw or as a frame.

The path of the embedded store and of a daemon that does not copy this GPU's
memory (or whose CUDA IPC this process's memory cannot go through), and of
every frame. The PUT goes out at save time; the copy is queued on a
per-device side stream (device to host, or host to device) behind an event,
and the Copy holds the event that marks its end: nothing waits on the host.
Once that event has fired, ``settle`` seals the key: the store must not hand
out bytes this process is still copying in.
The pool is page-locked (registered with CUDA) in this process so those
copies run at link speed. CUDA copies are not checksummed: a host-side hash
of every byte would cost more than the copy.

Frames: where the codec setting takes them (storm/frames.py: bf16 tensors of
at least FRAME_MIN_BYTES in ancf_exp frames, bool ones in bit frames, float32
ones in upcast or float32 frames) the
mover sends them here as frames, whose size is known before encoding, encoded
on the GPU on a codec stream beside the copy stream: fewer bytes over the
link and in the pool. A frame that does not hold its tensor (escapes that did
not fit) is reported by ``Copy.incomplete()`` once it has landed; the session
then stores the tensor raw (it still holds it).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any, Callable

import torch

from ..backend import Backend
from ..frames import KINDS, FrameKind
from ..gpu import DeviceStreams
from ..replies import Resolved
from .base import Copy, CopyHandler, Landed, PutRequest, fetched_fields, log_failure, wait_reply


class CudaToPool(CopyHandler):
    """CUDA tensors copied into and out of the mapped pool by this process. ``streams``: the copy
    streams of a device (made on first use; the pool is page-locked then)."""

    def __init__(self, backend: Backend, worker: Executor, streams: Callable[[torch.device], DeviceStreams]):
        self.backend = backend
        self.worker = worker
        self.streams = streams

    def put(self, req: PutRequest) -> Copy:
        nbytes = req.source.nbytes()
        kind = KINDS.get(req.codec)
        fields = ({"nbytes": kind.nbytes(nbytes), "raw_nbytes": nbytes, "codec": req.codec} if kind is not None
                  else {"nbytes": nbytes, "codec": "raw"})
        reply = self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta)
        streams = self.streams(req.source.device)
        return self._start(reply, self._put, req, reply, streams, kind)

    def get(self, key: int, nbytes: int, device: torch.device, verify: bool = True) -> Copy:
        reply = self.backend.request("GET", key=key)
        return self._start(reply, self._get, key, nbytes, reply, self.streams(device))

    def settle(self, key: int, landed: Landed) -> None:
        """The copy into ``key``'s extent has finished: the store may hand its bytes out now."""
        self.backend.request("SEAL", key=key).add_done_callback(log_failure)

    def _start(self, reply: Future | Resolved, fn: Callable[..., Landed], *args: Any) -> Copy:
        """Run ``fn`` on the worker; or here, when the reply is in (the embedded store answers at
        once): the copy only queues work on a stream, a hop to the worker would cost more than
        that, and its Python competes with the training thread for the GIL."""
        if not reply.done():
            return Copy.on(self.worker, fn, *args)
        return Copy.now(fn, *args)

    def _put(self, req: PutRequest, reply: Future | Resolved, streams: DeviceStreams, kind: FrameKind | None) -> Landed:
        """The copy into the extent the PUT reserved. ``kind``: the frame's, for a put into a frame.
        Sealed by ``settle`` once the event has fired."""
        offset = wait_reply(self.backend, "PUT", reply)["offset"]
        pool = self.backend.pool
        if kind is not None:
            frame = kind.nbytes(req.source.nbytes())
            return Landed(nbytes=frame, frame=pool.view(offset, 16),
                          event=streams.to_host_frame(pool.address(offset, frame), req.source, req.ready, kind))
        nbytes = req.source.nbytes()
        return Landed(nbytes=nbytes, event=streams.to_host(pool.address(offset, nbytes), req.source, req.ready))

    def _get(self, key: int, nbytes: int, reply: Future | Resolved, streams: DeviceStreams) -> Landed:
        """The copy out of the key's extent, which its put's copy has filled: the session fetches only
        what it has let go of, once that copy's event fired."""
        r = fetched_fields(self.backend, key, nbytes, wait_reply(self.backend, "GET", reply))
        src = self.backend.pool.address(r["offset"], r["nbytes"])
        kind = KINDS.get(r["codec"])
        if kind is not None:
            out, event = streams.to_device_frame(src, r["nbytes"], nbytes, kind)
        else:
            out, event = streams.to_device(src, nbytes)
        return Landed(tensor=out, event=event)
