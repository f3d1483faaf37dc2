"""The copy interface: what every path between a saved tensor and the store's pool has in common.

After vLLM's kv_offload: one handler per (source, destination) medium behind
one small verb set, registered by ``Route``. Which route a saved tensor takes
is decided at its put (mover.Mover.route), and serves that put and the get of
what it stored. A handler starts a copy into the store (``put``) or out of it
(``get``) and returns at once; what it returns is a ``Copy``, the one
completion type, whichever path made it: a future of the ``Landed`` result,
plus, on CUDA, the event that marks the end of the bytes' copy on its stream.
Once a put's bytes are in the pool, its handler tells the store whatever the
store must hear (``settle``): each handler seals what it copies.
"""

from __future__ import annotations

import abc
import enum
import logging
import sys
import traceback
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from storm.kernels.frame import complete

from ..backend import Backend
from ..errors import StormIntegrityError, StormRequestError, StormUnavailable
from ..replies import Resolved

REQUEST_TIMEOUT = 30.0
log = logging.getLogger("storm")


class Route(enum.Enum):
    """Which handler copies a saved tensor, into the store and back."""

    HOST = "host"      # a CPU tensor: the mover's worker copies it (cpu_to_pool.py)
    OWN = "own"        # a CUDA tensor this process copies on its own streams (cuda_to_pool.py)
    DAEMON = "daemon"  # a CUDA tensor stormd copies out of this process's memory (cuda_by_daemon.py)


@dataclass(frozen=True)
class PutRequest:
    key: int
    step: int
    source: torch.UntypedStorage  # the storage to store, whole
    meta: dict[str, Any]   # dtype, shape, strides, storage_offset of the saved view
    route: Route = Route.HOST
    codec: str = "raw"     # how the handler stores it: a codec name, stormd.wire.protocol.FRAME_CODEC, or "raw"
    ready: Any = None      # gpu.CopyEvent recorded where the tensor was produced (CUDA), or None
    ipc: tuple[bytes, int] | None = None  # Route.DAEMON: the memory's IPC handle and offset in it


@dataclass(frozen=True)
class Landed:
    """What a copy leaves once its result is in: ``nbytes`` stored (the encoded size), for a put;
    ``tensor``, the fetched bytes (uint8), for a get; ``event``, the CUDA event that marks the end
    of the bytes' copy on its stream (None: CPU copies are over when they land); ``frame``, the
    landed frame's header (pool memory), for a put into a frame."""

    nbytes: int = 0
    tensor: torch.Tensor | None = None
    event: Any = None
    frame: torch.Tensor | None = None

    def incomplete(self) -> bool:
        """A put into a frame whose escapes did not all fit: the stored bytes do not hold the tensor,
        which must be stored another way."""
        return self.frame is not None and not complete(self.frame)


class Copy:
    """A copy into the store (a put) or out of it (a get): ``future`` is its Landed result (a
    Future, or a Resolved one where it is in already). Errors are held, not raised, until read:
    ``error()`` reads them. Reading waits for the result, never for the bytes (``done`` and
    ``wait`` look at the event); a result that rides on a store's reply is waited for at most
    REQUEST_TIMEOUT. Futures are safe to read from any thread, so a Copy is.

    ``cancellable``: a put of the worker's that has not started can be dropped (``cancel``)."""

    __slots__ = ("future", "cancellable", "_late")

    def __init__(self, future: Future | Resolved, cancellable: bool = False, late: str | None = None):
        self.future = future
        self.cancellable = cancellable
        self._late = late  # a reply-borne result: what did not answer, for the timeout's error

    @classmethod
    def now(cls, fn: Callable[..., Landed], *args: Any) -> "Copy":
        """``fn(*args)`` run here: landed with its result, or failed with what it raised."""
        try:
            return cls(Resolved(fn(*args)))
        except Exception as e:  # held, as a Future holds it
            return cls(Resolved(error=detached(e)))

    @classmethod
    def on(cls, worker: Executor, fn: Callable[..., Landed], *args: Any, cancellable: bool = False) -> "Copy":
        """``fn(*args)`` run on ``worker``; its error is held detached (see ``detached``)."""
        out: Future = Future()

        def run() -> None:
            if not out.set_running_or_notify_cancel():
                return  # cancelled before the worker came to it
            try:
                out.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the copy holds it; the worker goes on
                out.set_exception(detached(e))

        worker.submit(run)
        return cls(out, cancellable=cancellable)

    @classmethod
    def sent_on(cls, worker: Executor, backend: Backend, op: str, send: Callable[[], Future | Resolved],
                finish: Callable[[dict[str, Any]], Landed]) -> "Copy":
        """An ``op`` request to ``backend`` that ``send()`` makes on ``worker`` (which waits there first
        for what it needs), landed by ``finish`` from its reply as from_reply's: the worker does not
        wait for the reply, so the requests it sends one after the other are in flight together."""
        out: Future = Future()

        def run() -> None:
            if not out.set_running_or_notify_cancel():
                return
            try:
                reply = send()
            except BaseException as e:  # noqa: BLE001 - the copy holds it; the worker goes on
                out.set_exception(detached(e))
                return
            reply.add_done_callback(_landing(out, finish))

        worker.submit(run)
        return cls(out, late=_late(backend, op))

    @classmethod
    def from_reply(cls, backend: Backend, op: str, reply: Future | Resolved,
                   finish: Callable[[dict[str, Any]], Landed]) -> "Copy":
        """Landed by ``finish`` from a store's reply's fields, on whichever thread the reply lands
        (the connection's I/O thread; here for the embedded store): nothing is left to do once stormd
        has queued its own copies, and a worker taking the reply would wake one more thread per tensor,
        whose Python competes with the training thread for the GIL."""
        if isinstance(reply, Resolved):
            return cls.now(lambda: finish(reply.result()))
        out: Future = Future()
        reply.add_done_callback(_landing(out, finish))
        return cls(out, late=_late(backend, op))

    def _exception(self) -> BaseException | None:
        try:
            return self.future.exception(REQUEST_TIMEOUT if self._late else None)
        except CancelledError as e:
            return e
        except TimeoutError:
            return StormUnavailable(self._late)

    def done(self) -> bool:
        """True once the bytes have arrived (or the copy failed); never blocks."""
        if not self.future.done():
            return False
        if self._exception() is not None:
            return True
        event = self.future.result().event
        return event is None or event.query()

    def wait(self) -> None:
        """Block until done(); errors are left for ``error``."""
        if self._exception() is None and (event := self.future.result().event) is not None:
            event.synchronize()

    def error(self) -> BaseException | None:
        return self._exception()

    def result(self) -> Landed:
        """The landed result: raises the copy's error if it failed."""
        error = self._exception()
        if error is not None:
            raise error
        return self.future.result()

    def cancel(self) -> bool:
        """Drop a cancellable put the worker has not started: nothing of it reaches the store, and it
        fails with CancelledError. False where it has started (or cannot be dropped)."""
        return self.cancellable and self.future.cancel()


class CopyHandler(abc.ABC):
    """The copies between one medium (host memory, a GPU) and the store's pool, both ways."""

    @abc.abstractmethod
    def put(self, req: PutRequest) -> Copy:
        """Start copying ``req.source`` into the store, stored as ``req.codec`` says."""

    @abc.abstractmethod
    def get(self, key: int, nbytes: int, device: torch.device, verify: bool = True) -> Copy:
        """Start fetching ``key``'s ``nbytes`` raw bytes into a new uint8 tensor on ``device``;
        ``verify``: check the bytes against the checksum the store holds, where this medium has one."""

    @abc.abstractmethod
    def settle(self, key: int, landed: Landed) -> None:
        """The put of ``key`` has landed and its bytes are in the pool (its event has fired): tell the
        store what it must hear, if anything: each handler seals what it copies."""


def _landing(out: Future, finish: Callable[[dict[str, Any]], Landed]) -> Callable[[Future | Resolved], None]:
    """A reply's done-callback that lands ``out`` by ``finish`` from the reply's fields, or holds the
    error (the store's, or finish's) detached."""
    def land(reply: Future | Resolved) -> None:
        try:
            out.set_result(finish(reply.result()))
        except Exception as e:  # noqa: BLE001 - the copy holds it
            out.set_exception(detached(e))
    return land


def _late(backend: Backend, op: str) -> str:
    """What a copy says when ``backend`` has not answered its ``op`` within REQUEST_TIMEOUT."""
    return f"{backend.name} did not answer {op} within {REQUEST_TIMEOUT:g} s"


def detached(e: BaseException) -> BaseException:
    """``e``, to hold, without its traceback, whose frames are cleared too. Held with its traceback,
    the frames link through ``f_back`` to the callers' (the pack hook's, the model's forward with
    its tensors), which then lived as long as the error; raised on the worker, they hold the put's
    request (the tensor's storage). tests/copies/test_copies_base.py holds this. An error the store
    did not send keeps its traceback as a note."""
    if not isinstance(e, StormRequestError):
        note = "".join(traceback.format_tb(e.__traceback__)).rstrip()
        if sys.version_info >= (3, 11):
            e.add_note(note)
        else:  # what add_note does (PEP 678), which Python 3.10 has not: its tracebacks leave it out
            e.__notes__ = [*getattr(e, "__notes__", ()), note]  # type: ignore[attr-defined]  # 3.10's typeshed
    traceback.clear_frames(e.__traceback__)
    return e.with_traceback(None)


def log_failure(reply: Future | Resolved) -> None:
    """A done-callback for a request whose reply nobody waits for (SEAL, FREE): its failure is logged."""
    if reply.exception() is not None:
        log.warning("storm: a request to the store failed: %s", reply.exception())


def wait_reply(backend: Backend, op: str, reply: Future | Resolved) -> dict[str, Any]:
    """The reply's fields, waited on for at most REQUEST_TIMEOUT; raises what the store sent."""
    try:
        return reply.result(REQUEST_TIMEOUT)
    except TimeoutError:
        raise StormUnavailable(_late(backend, op)) from None


def fetched_fields(backend: Backend, key: int, nbytes: int, fields: dict[str, Any]) -> dict[str, Any]:
    """A GET's reply fields, checked to hold the ``nbytes`` raw bytes that were stored under ``key``."""
    if fields["raw_nbytes"] != nbytes:
        raise StormIntegrityError(f"key {key}: store returned {fields['raw_nbytes']} bytes, {nbytes} were stored")
    return fields
