"""The copy interface: what every path between a tensor and the store's pool has in common.

After vLLM's kv_offload: one handler per (source, destination) medium behind
one small verb set. A handler starts a copy into the store (``put``) or out
of it (``get``) and returns at once; what it returns is a ``Copy``, the one
completion type the session and the hooks see, whichever path made it. The
mover (client/transfer.py) picks the handler.

A Copy wraps what it waits on: the worker's Future, a store's reply (a Future,
or a ``Resolved`` one from the embedded store), or nothing once it has landed;
and, for a CUDA copy, the event that marks the end of the copy on its stream.
"""

from __future__ import annotations

import abc
import threading
import traceback
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from storm.kernels.frame import complete

from ..backend import Backend
from ..errors import StormIntegrityError, StormRequestError, StormUnavailable
from ..replies import Resolved

REQUEST_TIMEOUT = 30.0


@dataclass(frozen=True)
class PutRequest:
    key: int
    step: int
    source: torch.UntypedStorage  # the storage to store, whole
    meta: dict[str, Any]   # dtype, shape, strides, storage_offset of the saved view
    ready: Any = None      # gpu.CopyEvent recorded where the tensor was produced, or None
    codec: str = "raw"     # the step's codec setting ("raw": stored as it is)


class Copy:
    """A copy into the store (a put) or out of it (a get), in flight or landed.

    In flight it waits on ``pending``: a Future or Resolved whose result is the landed Copy (a
    handler's work on the worker), or, with ``finish``, a store's reply that ``finish`` turns into
    the landed Copy on the thread that first asks (stormd's own copies: nothing is left to do once
    stormd has queued them, so no worker takes the reply; that hop woke one more thread per tensor,
    whose Python competes with the training thread for the GIL). A landed Copy holds:

    - ``nbytes``: bytes stored (the encoded size), for a put;
    - ``tensor``: the fetched bytes (uint8), for a get;
    - ``event``: the CUDA event that marks the end of the copy, or None (CPU copies have finished
      when they land);
    - ``frame``: the landed frame's header (pool memory), for a put into a frame;
    - ``sealed``: the store seals the put itself (stormd's own copies, CPU puts); else the client
      must, once the event has fired.

    ``cancellable``: a put of the worker's that sends nothing to the store until it starts.
    Errors are held, not raised, until a field is read; ``error()`` reads them.

    Any thread may read a Copy: the training threads of one process share its session, so one
    thread's poll resolves a copy another thread's graph is letting go of. It lands once, under
    its lock, and ``_landed`` is set only after every landed field."""

    __slots__ = ("_pending", "_finish", "_error", "cancellable", "_landed", "_nbytes", "_tensor", "_event", "_frame",
                 "_sealed", "_lock")

    def __init__(self, pending: Future | Resolved | None = None, finish: Callable[[], "Copy"] | None = None,
                 cancellable: bool = False):
        self._pending, self._finish, self.cancellable = pending, finish, cancellable
        self._error: BaseException | None = None
        self._landed = pending is None
        self._nbytes, self._tensor, self._event, self._frame, self._sealed = 0, None, None, None, False
        self._lock = threading.Lock()

    @classmethod
    def landed(cls, *, nbytes: int = 0, tensor: torch.Tensor | None = None, event: Any = None,
               frame: torch.Tensor | None = None, sealed: bool = False) -> "Copy":
        """A copy whose result is in (its bytes may still be on their way: ``event``)."""
        c = cls()
        c._nbytes, c._tensor, c._event, c._frame, c._sealed = nbytes, tensor, event, frame, sealed
        return c

    @classmethod
    def failed(cls, error: BaseException) -> "Copy":
        c = cls()
        c._error = detached(error)
        return c

    def _resolve(self) -> "Copy":
        """Take the result once it is in (blocks until then): the fields are this Copy's from now on."""
        if self._landed:
            return self
        with self._lock:
            if self._landed:  # another thread took it while this one waited for the lock
                return self
            out = None
            if self._finish is None:  # the worker's: a Future holds its error as it was raised
                self._error = self._pending.exception()
                if self._error is None:
                    out = self._pending.result()
            else:
                try:
                    out = self._finish()
                except Exception as e:  # held, as a Future holds it; raising would give it this caller's frames
                    self._error = detached(e)
            if out is not None:
                out._resolve()
                self._nbytes, self._tensor, self._event, self._frame, self._sealed = (
                    out._nbytes, out._tensor, out._event, out._frame, out._sealed)
                self._error = out._error
            self._landed = True  # before the pending goes: a reader that finds no pending finds it landed
            self._pending, self._finish = None, None
        return self

    def done(self) -> bool:
        """True once the bytes have arrived (or the copy failed); never blocks."""
        pending = self._pending
        if pending is not None and not pending.done():
            return False
        c = self._resolve()
        return c._error is not None or c._event is None or c._event.query()

    def wait(self) -> None:
        """Block until done(); errors are left for ``error``."""
        if self._resolve()._error is None and self._event is not None:
            self._event.synchronize()

    def error(self) -> BaseException | None:
        return self._resolve()._error

    def result(self) -> "Copy":
        """This Copy, landed: raises its error if it failed."""
        if self._resolve()._error is not None:
            raise self._error
        return self

    def cancel(self) -> bool:
        """Drop a cancellable put the worker has not started: nothing of it reaches the store, and it
        fails with CancelledError. False where it has started (or cannot be dropped)."""
        with self._lock:
            if not (self.cancellable and not self._landed and self._pending.cancel()):
                return False
            self._error = CancelledError()
            self._landed = True
            self._pending = None
        return True

    def incomplete(self) -> bool:
        """A landed put into a frame whose escapes did not all fit: the stored bytes do not hold the
        tensor, which must be stored another way."""
        return self.error() is None and self._frame is not None and not complete(self._frame)

    def drop_event(self) -> None:
        """Forget the event of a landed put: the session holds the Copy with its step (the storm.offload
        context holds the step for its stats), and interprocess events are limited (about 20,000 per
        process)."""
        self._event = None

    # The landed fields (class docstring); reading one waits for the result (not for the bytes).
    @property
    def nbytes(self) -> int:
        return self._resolve()._nbytes

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._resolve()._tensor

    @property
    def event(self) -> Any:
        return self._resolve()._event

    @property
    def frame(self) -> torch.Tensor | None:
        return self._resolve()._frame

    @property
    def sealed(self) -> bool:
        return self._resolve()._sealed


class CopyHandler(abc.ABC):
    """The copies between one medium (host memory, a GPU) and the store's pool, both ways."""

    @abc.abstractmethod
    def put(self, req: PutRequest, codec: str) -> Copy:
        """Start copying ``req.source`` into the store, encoded with ``codec`` (a codec name, or
        stormd.wire.protocol.FRAME_CODEC for a frame, or "raw")."""

    @abc.abstractmethod
    def get(self, key: int, nbytes: int, device: torch.device, after: Any = None, verify: bool = True) -> Copy:
        """Start fetching ``key``'s ``nbytes`` raw bytes into a new uint8 tensor on ``device``;
        ``after``: the key's put's event, when that copy may still be running; ``verify``: check
        the bytes against the checksum the store holds, where this medium has one."""


def detached(e: BaseException) -> BaseException:
    """``e``, to hold, without its traceback, whose frames are cleared too. Caught on the training
    thread, the traceback's frames link through ``f_back`` to their callers' (the pack hook's, the
    model's forward with its tensors, the save's Handle), which then lived as long as the error:
    through a pool too small for a step, every refused save stayed on the GPU after its step
    (bench/results/refused-saves-*). Raised on the worker, they hold the put's request (the tensor's
    storage) and its reply, which holds the error again: a cycle until the garbage collector ran.
    An error the store did not send holds its traceback as a note."""
    if not isinstance(e, StormRequestError):
        e.add_note("".join(traceback.format_tb(e.__traceback__)).rstrip())
    traceback.clear_frames(e.__traceback__)
    return e.with_traceback(None)


def wait_reply(backend: Backend, op: str, reply: Future | Resolved) -> dict[str, Any]:
    """The reply's fields, waited on for at most REQUEST_TIMEOUT; raises what the store sent."""
    try:
        return reply.result(REQUEST_TIMEOUT)
    except TimeoutError:
        raise StormUnavailable(f"{backend.name} did not answer {op} within {REQUEST_TIMEOUT:g} s") from None


def fetched_fields(backend: Backend, key: int, nbytes: int, reply: Future | Resolved) -> dict[str, Any]:
    """A GET's reply, checked to hold the ``nbytes`` raw bytes that were stored under ``key``."""
    r = wait_reply(backend, "GET", reply)
    if r["raw_nbytes"] != nbytes:
        raise StormIntegrityError(f"key {key}: store returned {r['raw_nbytes']} bytes, {nbytes} were stored")
    return r
