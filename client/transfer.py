"""The mover: copies storages into pool extents and back, off the training thread.

Saving never waits for a round trip: the training thread sends GET (and PUT
for a CUDA tensor) and hands the rest to one worker thread, which takes the
store's reply and moves the bytes. Those requests are pipelined, so the
store's latency is paid once per burst, not once per tensor.

CPU tensors: the worker sends the PUT itself when it comes to the tensor,
copies with memcpy and checksums (xxh3) what it wrote; GET verifies the
checksum on what it read back (``verify``, on by default: a byte changed in
the pool raises StormIntegrityError instead of becoming data; off saves one
hash pass over every fetched byte). With a codec (``storm.offload(codec=...)``,
or the daemon's ``codec`` setting) the worker encodes first (storm.kernels);
GET decodes. A PUT reserves an extent of the node's shared pool, and one
worker can copy CPU tensors more slowly than a small model saves them: PUTs
sent at save time reserved the whole backlog, many times a step's working set,
until clients of the node were refused for a full pool. Sent by the worker, a
client reserves only the extent it is copying; and a put whose tensor backward
no longer needs before the worker reached it (it unpacked the still-held
tensor, and autograd let go of every handle) is cancelled (``Transfer.cancel``):
it takes neither pool space nor the worker's time.
CUDA tensors through a stormd that copies that GPU's memory (HELLO's
``cuda_devices``): PUT and GET name the tensor's (or destination's) cudaMalloc
segment by its IPC handle, with an interprocess ready event; stormd queues the
copy on its own streams and records the request's interprocess done event,
which the transfer returns, read off the reply without the worker (Replied);
stormd seals the key itself once its copy has finished, so no SEAL is sent.
A PUT whose tensor the GPU has not finished yet is
sent by the worker once it has: stormd's copy stream never waits on another
process's event (W2 at the budget: 277 ms a step through stormd waiting there,
258 sent when ready, 254 embedded). Memory that cannot be exported (expandable_segments)
is logged once and copied here instead; frames (below) are copied here too.
Otherwise (the embedded store, a daemon without CUDA): the worker queues the
copy on a per-device side stream (device to host, or host to device) behind an
event, and returns the event that marks its end; nothing waits on the host. The pool is then page-locked (registered
with CUDA) in this process so those copies run at link speed. CUDA copies are
not checksummed: a host-side hash of every byte would cost more than the copy
(see README).
With codec ``auto`` or ``ancf_exp``, bf16 tensors of at least
FRAME_MIN_BYTES are encoded on the GPU (a codec stream beside the copy stream)
into a frame (storm.kernels.frame, whose size is known before encoding) and the
frame is copied: fewer bytes over the link and in the pool. A frame whose escapes did not fit is reported by
``Transfer.incomplete()`` once it has landed; the session then stores the
tensor raw (it still holds it).
"""

from __future__ import annotations

import logging
import traceback
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import xxhash

from storm.kernels import CorruptEncodedError, Encoded, decode, encode
from storm.kernels.frame import complete, frame_nbytes
from stormd.wire.cuda import device_uuid, register_pool
from stormd.wire.protocol import FRAME_CODEC

from .backend import Backend
from .errors import StormIntegrityError, StormRequestError, StormUnavailable
from .gpu import DeviceStreams, IpcEvent, NotExportable, export, ipc_event
from .replies import Settled

REQUEST_TIMEOUT = 30.0
# Smaller CUDA tensors are copied raw: a frame's kernel launches cost the training thread
# the same host time at any size, while what it saves on the link shrinks with the size.
FRAME_MIN_BYTES = 4 << 20
FRAME_CODECS = ("auto", "ancf_exp")  # codec settings that put CUDA tensors in frames
log = logging.getLogger("storm")


def frameable(device_type: str, dtype: str, nbytes: int) -> bool:
    """Whether a frame codec puts a storage of this device type, saved view dtype (its name, as in
    a PUT's meta) and size in a frame: CUDA bf16 of at least FRAME_MIN_BYTES, whole 16-bit words."""
    return device_type == "cuda" and dtype == "bfloat16" and nbytes >= FRAME_MIN_BYTES and nbytes % 2 == 0


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def checksum(buf: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(buf.numpy()) if buf.numel() else 0


def detached(e: BaseException) -> BaseException:
    """``e``, to keep, without its traceback, whose frames are cleared too. Caught on the training
    thread, the traceback's frames link through ``f_back`` to their callers' (the pack hook's, the
    model's forward with its tensors, the save's Handle), which then lived as long as the error: on
    W1 through a pool too small for a step, every refused save stayed on the GPU after its step
    (bench/results/refused-saves-*). Raised on the worker, they hold the put's request (the tensor's
    storage) and its reply, which holds the error again: a cycle until the garbage collector ran.
    An error the store did not send keeps its traceback as a note."""
    if not isinstance(e, StormRequestError):
        e.add_note("".join(traceback.format_tb(e.__traceback__)).rstrip())
    traceback.clear_frames(e.__traceback__)
    return e.with_traceback(None)


def _log_failure(fut: Future) -> None:
    if fut.exception() is not None:
        log.warning("storm: a request to the store failed: %s", fut.exception())


@dataclass(frozen=True)
class PutRequest:
    key: int
    step: int
    source: torch.UntypedStorage  # the storage to store, whole
    meta: dict[str, Any]   # dtype, shape, strides, storage_offset of the saved view
    ready: Any = None      # gpu.CopyEvent recorded where the tensor was produced, or None
    encode: bool = True    # False: store it raw whatever the codec


class Put(NamedTuple):
    """What a finished put resolves to."""
    nbytes: int            # bytes stored (the encoded size)
    event: Any             # CUDA event marking the copy's end, or None
    frame: torch.Tensor | None = None  # the landed frame's header (pool memory), for a frame put
    sealed: bool = False   # the store seals it itself (stormd's own copies); else the client must, once copied


class Transfer:
    """A copy in flight. ``result`` resolves to a Put, or for a get to (fetched tensor, CUDA event
    or None). ``cancellable``: a put of the worker's that has sent nothing to the store until it
    starts (a CPU put)."""

    def __init__(self, result: Future | Settled | Replied, cancellable: bool = False):
        self.result = result
        self.cancellable = cancellable

    def cancel(self) -> bool:
        """Drop a cancellable put the worker has not started: nothing of it reaches the store, and it
        fails with CancelledError. False where it has started (or cannot be dropped)."""
        if not (self.cancellable and self.result.cancel()):
            return False
        self.result = Settled(error=CancelledError())  # what the Future raises, kept as the transfer's error
        return True

    def done(self) -> bool:
        """True once the bytes have arrived (or the transfer failed); never blocks."""
        if not self.result.done():
            return False
        if self.result.exception() is not None:
            return True
        event = self.result.result()[1]
        return event is None or event.query()

    def wait(self) -> None:
        """Block until done(); errors are left for ``error``."""
        if self.result.exception() is None:
            event = self.result.result()[1]
            if event is not None:
                event.synchronize()

    def error(self) -> BaseException | None:
        return self.result.exception()

    def incomplete(self) -> bool:
        """A finished put into a frame whose escapes did not all fit: the stored bytes do not hold
        the tensor, which must be stored another way."""
        if self.result.exception() is not None:
            return False
        frame = self.result.result().frame
        return frame is not None and not complete(frame)

    def settle(self) -> None:
        """Forget the event of a finished put: the Stored that keeps this transfer lives on with its
        step (the storm.offload context keeps it for its stats), and interprocess events are limited
        (about 20,000 per process)."""
        self.result = Settled(self.result.result()._replace(event=None))

    @property
    def event(self) -> Any:
        """The CUDA event that marks the end of the copy (``done()``, ``wait()``), or None (CPU, whose
        copy has finished when the result is there, or failed)."""
        return None if self.result.exception() is not None else self.result.result()[1]


class Replied:
    """The result of a copy stormd makes, read off its reply when asked. Once stormd has queued the
    copy nothing is left to do here, so no worker takes the reply: that hop woke one more thread per
    tensor, whose Python competes with the training thread for the GIL (W1 through stormd at a
    500 MB budget, H100: 1.06-1.11x the embedded step against 1.11-1.21x with the hop). The part of
    Future's interface that Transfer uses; the reply is waited on for at most REQUEST_TIMEOUT."""

    __slots__ = ("_backend", "_op", "_reply", "_then", "_out")

    def __init__(self, backend: Backend, op: str, reply: Future | Settled, then: Callable[[dict[str, Any]], Any]):
        self._backend, self._op, self._reply, self._then = backend, op, reply, then
        self._out: Settled | None = None

    def done(self) -> bool:
        return self._reply.done()

    def result(self, timeout: float | None = None) -> Any:
        return self._settled().result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._settled().exception()  # not raised: raising would give it this caller's frames

    def _settled(self) -> Settled:
        if self._out is None:
            try:
                self._out = Settled(self._then(_wait(self._backend, self._op, self._reply)))
            except Exception as e:  # kept, as a Future keeps it: every later result() raises it again
                self._out = Settled(error=detached(e))
        return self._out


class Mover:
    def __init__(self, backend: Backend):
        self.backend = backend
        intra_op = torch.get_num_threads()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="storm-mover")
        self._worker.submit(_one_cpu_thread).result()
        torch.set_num_threads(intra_op)  # the worker set the default for threads yet to start: back to the caller's
        self.verify = True  # check fetched CPU bytes against their checksum (storm.offload(verify=...))
        self.codec = "raw"  # how CPU tensors are encoded (storm.offload(codec=...), else the store's)
        self._streams: dict[int, DeviceStreams] = {}
        self._uuids: dict[int, str | None] = {}  # device index -> its UUID where the store copies its memory

    def _streams_for(self, device: torch.device, local: bool = True) -> DeviceStreams:
        """``local``: this process copies (into the pool, which it then page-locks), not stormd."""
        if local and not self.backend.pool.cuda_registered:
            register_pool(self.backend.pool)
        s = self._streams.get(device.index)
        if s is None:
            s = self._streams[device.index] = DeviceStreams(device)
        return s

    def daemon_copies(self, device: torch.device) -> bool:
        """Whether the store copies this GPU's memory itself (stormd, through CUDA IPC)."""
        u = self._uuids.get(device.index, False)
        if u is False:
            u = device_uuid(device.index)
            u = self._uuids[device.index] = u if u in self.backend.cuda_devices else None
        return u is not None

    def _no_daemon_copies(self, device: torch.device, why: NotExportable) -> None:
        log.warning("storm: %s; this process copies its CUDA tensors into the pool itself from now on", why)
        self._uuids[device.index] = None

    def put(self, req: PutRequest) -> Transfer:
        if not req.source.is_cuda:  # the worker sends the PUT as it comes to the tensor (module docstring)
            return Transfer(self._worker.submit(self._put_host, req, self.codec if req.encode else "raw"),
                            cancellable=True)
        nbytes = req.source.nbytes()
        framed = req.encode and self.codec in FRAME_CODECS and frameable(req.source.device.type, req.meta["dtype"],
                                                                         nbytes)
        fields = ({"nbytes": frame_nbytes(nbytes // 2), "raw_nbytes": nbytes, "codec": FRAME_CODEC} if framed
                  else {"nbytes": nbytes, "codec": "raw"})
        # Frames are copied here even where stormd could copy them: through stormd, W2 with frames
        # took 635 ms a step against 464 ms with client-side copies (bench/results, README).
        if isinstance(req.ready, IpcEvent) and not framed and self.daemon_copies(req.source.device):
            try:
                return self._put_by_daemon(req, fields)
            except NotExportable as e:
                self._no_daemon_copies(req.source.device, e)
        reply = self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta)
        streams = self._streams_for(req.source.device)
        return self._start(reply, streams, self._put, req, reply, streams, fields["nbytes"] if framed else None)

    def _put_by_daemon(self, req: PutRequest, fields: dict[str, Any]) -> Transfer:
        """stormd copies the storage out of this process's memory (the session holds it until then)."""
        device = req.source.device
        handle, offset = export(req.source.data_ptr(), device.index)
        done = ipc_event(device.index)
        cuda = {"handle": handle, "offset": offset, "device": self._uuids[device.index], "ready": req.ready.wire,
                "done": done.wire}
        if not req.ready.query():
            # stormd's copy stream would wait on this process's event, and such waits held its copies back
            # (module docstring): the worker sends the PUT once the tensor is complete
            return Transfer(self._worker.submit(self._put_when_ready, req, fields, cuda, done))
        reply = self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta, cuda=cuda)
        return Transfer(Replied(self.backend, "PUT", reply, lambda _: Put(fields["nbytes"], done, sealed=True)))

    def _put_when_ready(self, req: PutRequest, fields: dict[str, Any], cuda: dict[str, Any], done: IpcEvent) -> Put:
        req.ready.synchronize()  # the runtime lets go of the GIL while it waits
        _wait(self.backend, "PUT", self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta,
                                                        cuda=cuda))
        return Put(fields["nbytes"], done, sealed=True)  # stormd has queued the copy; ``done`` fires when it is over

    def get(self, key: int, nbytes: int, device: torch.device, put: Transfer | None = None) -> Transfer:
        """Fetch a key's bytes into a fresh uint8 tensor on ``device``; ``put``: the key's put."""
        if device.type == "cuda" and put is not None and put.result.result().frame is None \
                and self.daemon_copies(device):
            try:
                return self._get_by_daemon(key, nbytes, device)
            except NotExportable as e:
                self._no_daemon_copies(device, e)
        reply = self.backend.request("GET", key=key)
        streams = self._streams_for(device) if device.type == "cuda" else None
        after = put.event if put is not None else None
        return self._start(reply, streams, self._get, key, nbytes, reply, streams, after)

    def _get_by_daemon(self, key: int, nbytes: int, device: torch.device) -> Transfer:
        """stormd copies the stored bytes into a buffer this process allocated."""
        streams = self._streams_for(device, local=False)
        buf, ready = streams.destination(nbytes)
        handle, offset = export(buf.data_ptr(), device.index)
        done = ipc_event(device.index)
        reply = self.backend.request("GET", key=key, cuda={"handle": handle, "offset": offset, "ready": ready.wire,
                                                           "device": self._uuids[device.index], "done": done.wire})
        # ``ready`` is held until the reply (the future keeps its callbacks): recorded again for another
        # request before stormd waited on it, it could make stormd's copy wait for work that waits for this copy
        reply.add_done_callback(lambda _, held=ready: None)

        def queued(r: dict[str, Any]) -> tuple[torch.Tensor, Any]:
            if r["nbytes"] != buf.numel() or r["codec"] != "raw":
                raise StormIntegrityError(f"key {key}: store returned {r['nbytes']} bytes ({r['codec']}), "
                                          f"{buf.numel()} raw bytes were stored")
            return buf, done
        return Transfer(Replied(self.backend, "GET", reply, queued))

    def _start(self, reply: Future | Settled, streams: DeviceStreams | None, fn: Any, *args: Any) -> Transfer:
        """Run ``fn`` on the worker; or here, when the reply is in (the embedded store answers at
        once) and the copy is a CUDA one, which only queues work on a stream: a hop to the worker
        would cost more than that, and its Python competes with the training thread for the GIL."""
        if streams is None or not reply.done():
            return Transfer(self._worker.submit(fn, *args))
        try:
            return Transfer(Settled(fn(*args)))
        except Exception as e:  # the worker's Future would carry it too
            return Transfer(Settled(error=detached(e)))

    def request(self, op: str, **fields: Any) -> Future:
        """A request queued behind the transfers already submitted (so STATS sees earlier FREEs)."""
        return self._worker.submit(lambda: _wait(self.backend, op, self.backend.request(op, **fields)))

    def seal(self, key: int, put: Transfer) -> None:
        """Tell the store ``put``, a CUDA copy into ``key``'s extent, has finished, unless the store
        seals it itself (CPU puts seal themselves, stormd's own copies are sealed by stormd)."""
        if not put.result.result().sealed:
            self.backend.request("SEAL", key=key).add_done_callback(_log_failure)

    def free(self, keys: list[int]) -> None:
        """Sent from the calling thread, like PUT, so a step's PUTs never overtake the FREEs of the
        step before (through the mover's queue they could, and find the pool still full)."""
        if keys:
            self.backend.request("FREE", keys=keys).add_done_callback(_log_failure)

    def _put(self, req: PutRequest, reply: Future | Settled, streams: DeviceStreams, frame: int | None) -> Put:
        """A CUDA put: the copy into the extent the PUT reserved. ``frame``: the frame's size, for a put
        into a frame."""
        offset = _wait(self.backend, "PUT", reply)["offset"]
        pool = self.backend.pool  # CUDA puts are sealed once the event has fired (seal())
        if frame is not None:
            return Put(frame, streams.to_host_frame(pool.address(offset, frame), req.source, req.ready),
                       pool.view(offset, 16))
        nbytes = req.source.nbytes()
        return Put(nbytes, streams.to_host(pool.address(offset, nbytes), req.source, req.ready))

    def _put_host(self, req: PutRequest, codec: str) -> Put:
        """A CPU put, on the worker: encoded (unless ``codec`` is raw), PUT for the size that takes,
        copied into the extent and sealed."""
        raw = req.source.nbytes()
        enc = None
        if codec != "raw":
            try:
                enc = encode(torch.empty(0, dtype=getattr(torch, req.meta["dtype"])).set_(req.source), codec)
            except ValueError:  # a dtype or a tensor the codec does not take: stored as it is
                pass
        if enc is None or enc.codec == "raw" or enc.nbytes >= raw:
            fields, data = {"nbytes": raw, "codec": "raw"}, storage_bytes(req.source)
        else:
            blob = enc.to_bytes()
            fields = {"nbytes": len(blob), "raw_nbytes": raw, "codec": enc.codec}
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        reply = self.backend.request("PUT", key=req.key, step=req.step, **fields, **req.meta)
        return Put(self._write(req.key, _wait(self.backend, "PUT", reply)["offset"], data), None)

    def _write(self, key: int, offset: int, data: torch.Tensor) -> int:
        """Copy ``data`` (uint8) into the extent at ``offset`` and seal it with its checksum."""
        dst = self.backend.pool.view(offset, data.numel())
        dst.copy_(data)
        _wait(self.backend, "SEAL", self.backend.request("SEAL", key=key, checksum=checksum(dst)))
        return data.numel()

    def _get(self, key: int, nbytes: int, reply: Future | Settled, streams: DeviceStreams | None,
             after: Any) -> tuple[torch.Tensor, Any]:
        r = _wait(self.backend, "GET", reply)
        if r["raw_nbytes"] != nbytes:
            raise StormIntegrityError(f"key {key}: store returned {r['raw_nbytes']} bytes, {nbytes} were stored")
        if streams is not None:
            src = self.backend.pool.address(r["offset"], r["nbytes"])
            if r["codec"] == FRAME_CODEC:
                return streams.to_device_frame(src, r["nbytes"], nbytes, after)
            return streams.to_device(src, nbytes, after)
        out = self.backend.pool.view(r["offset"], r["nbytes"]).clone()
        if self.verify and r["checksum"] is not None and checksum(out) != r["checksum"]:
            raise StormIntegrityError(f"key {key}: the bytes in the pool no longer match their checksum; "
                                      f"the saved tensor is lost (pool memory was overwritten)")
        if r["codec"] != "raw":
            try:
                out = decode(Encoded.from_bytes(out.numpy())).reshape(-1).view(torch.uint8)
            except CorruptEncodedError as e:
                raise StormIntegrityError(f"key {key}: the stored encoding does not decode ({e})") from None
        return out, None

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _one_cpu_thread() -> None:
    """Run on the worker: its CPU copies and codecs use this thread alone. A second OpenMP team
    beside the training thread's makes libgomp count more threads than cores and cut its
    workers' spin-waits short, so every parallel op of the training thread pays futex wake-ups:
    on the 2-core dev machine a small CPU model's forward took 6.1 ms before any offload and
    12.6 ms after (24.1 against 11.9 ms backward; bench/cpu_threads.py) while the worker's
    team existed.
    get_num_threads first: ATen applies the process default to a thread at its first parallel
    op, which would undo a setting made before it."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def _wait(backend: Backend, op: str, reply: Future | Settled) -> dict[str, Any]:
    try:
        return reply.result(REQUEST_TIMEOUT)
    except TimeoutError:
        raise StormUnavailable(f"{backend.name} did not answer {op} within {REQUEST_TIMEOUT:g} s") from None
