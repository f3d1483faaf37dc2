"""The one completion type, copies.base.Copy: a copy stormd makes lands from its reply on the thread
that receives the reply, with the errors a worker's Future would carry (CPU; tests/test_gpu_daemon_copies.py
runs it on stormd's copies); a worker's copy resolves from its Future; a put the worker has not
begun can be cancelled; errors held by copies hold none of the frames that started them."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import pytest
import torch

from storm.copies import base
from storm.copies.base import Copy, Landed, PutRequest, Route
from storm.copies.cuda_to_pool import CudaToPool
from storm.errors import StormIntegrityError, StormRequestError, StormUnavailable
from storm.replies import Resolved, resolve


class Backend:
    name = "stormd under test"


def from_reply(reply, then):
    """A Copy read off ``reply`` (as stormd's copies are): ``then`` maps the reply's fields to what landed."""
    return Copy.from_reply(Backend(), "GET", reply, then)


def test_it_resolves_from_the_reply_once_and_only_once_it_is_in():
    reply: Future = Future()
    calls = []
    c = from_reply(reply, lambda fields: calls.append(fields) or Landed(nbytes=fields["nbytes"] * 2))
    assert not c.done()
    resolve(reply, {"ok": True, "nbytes": 21})
    assert c.done()
    assert c.error() is None
    assert c.result().nbytes == 42 and c.result().event is None and c.result().tensor is None
    assert calls == [{"ok": True, "nbytes": 21}]  # mapped once


def test_an_error_reply_is_its_error_and_every_result_raises_it():
    reply: Future = Future()
    c = from_reply(reply, lambda fields: pytest.fail("an error reply is not mapped"))
    resolve(reply, {"ok": False, "error": "POOL_FULL", "message": "no room"})
    err = c.error()
    assert isinstance(err, StormRequestError) and "POOL_FULL" in str(err)
    for _ in range(2):
        with pytest.raises(StormRequestError):
            c.result()


def test_a_reply_the_mapping_refuses_is_the_copys_error():
    reply: Future = Future()

    def refuse(fields):
        raise StormIntegrityError(f"store returned {fields['nbytes']} bytes")
    c = from_reply(reply, refuse)
    resolve(reply, {"ok": True, "nbytes": 3})
    assert isinstance(c.error(), StormIntegrityError)
    with pytest.raises(StormIntegrityError, match="3 bytes"):
        c.result()


def test_a_reply_that_never_comes_is_unavailable_after_the_request_timeout(monkeypatch):
    monkeypatch.setattr(base, "REQUEST_TIMEOUT", 0.05)
    c = from_reply(Future(), lambda fields: Landed())
    with pytest.raises(StormUnavailable, match="did not answer GET"):
        c.result()
    assert isinstance(c.error(), StormUnavailable)


def test_a_workers_copy_lands_with_its_futures_result_and_its_event_decides_done():
    class Event:
        fired = False

        def query(self):
            return self.fired

    fut: Future = Future()
    event = Event()
    c = Copy(fut)
    assert not c.done()
    fut.set_result(Landed(nbytes=7, event=event))
    assert not c.done() and c.result().nbytes == 7  # the result is in, the bytes are not
    event.fired = True
    assert c.done()


def test_only_a_put_the_worker_has_not_begun_can_be_cancelled():
    c = Copy(Future(), cancellable=True)
    assert c.cancel() and c.done() and isinstance(c.error(), CancelledError)
    running: Future = Future()
    running.set_running_or_notify_cancel()
    assert not Copy(running, cancellable=True).cancel() and not running.cancelled()
    assert not Copy(Future()).cancel()  # a CUDA put: its PUT went out at save time


class Canary:
    """A local of the frame that started a copy: alive only as long as that frame is."""


class RefusingBackend(Backend):
    def request(self, op, **fields):
        return Resolved.reply({"ok": False, "error": "POOL_FULL", "message": "no room"})


def failed_start(worker) -> tuple[Copy, weakref.ref]:
    """A CUDA put whose reply is in and refused: the copy would be queued on this thread, and fails here."""
    canary = Canary()
    copies = CudaToPool(RefusingBackend(), worker, streams=lambda device: object())
    req = PutRequest(1, 1, torch.empty(4096, dtype=torch.uint8).untyped_storage(), {"dtype": "uint8"}, Route.OWN)
    return copies.put(req), weakref.ref(canary)


def failed_reply() -> tuple[Copy, weakref.ref]:
    """A copy stormd refused, its error read on this thread."""
    canary = Canary()
    reply: Future = Future()
    resolve(reply, {"ok": False, "error": "POOL_FULL", "message": "no room"})
    c = from_reply(reply, lambda fields: Landed())
    assert c.done()
    return c, weakref.ref(canary)


@pytest.mark.parametrize("how", ["started here", "replied"])
def test_a_held_error_holds_none_of_the_frames_that_started_the_copy(how):
    """The error's traceback linked, through each frame's caller, to the frames that saved the tensor
    (the model's forward, with its tensors and the save's Handle): on CUDA every save the store refused
    outlived its step, with or without the garbage collector (bench/results/refused-saves-*)."""
    worker = ThreadPoolExecutor(1)
    gc.disable()
    try:
        c, canary = failed_start(worker) if how == "started here" else failed_reply()
        assert isinstance(c.error(), StormRequestError) and c.error().code == "POOL_FULL"
        assert canary() is None
    finally:
        gc.enable()
        worker.shutdown()


def test_an_error_the_store_did_not_send_holds_where_it_was_raised_as_a_note():
    def broken(fields):
        raise KeyError("offset")
    c = from_reply(Resolved({"ok": True}), broken)
    err = c.error()
    assert isinstance(err, KeyError) and err.__traceback__ is None
    assert "in broken" in err.__notes__[0]


def test_on_python_3_10_the_note_is_kept_without_add_note(monkeypatch):
    """Python 3.10, which storm supports, has no BaseException.add_note: detached() must not call it."""
    monkeypatch.setattr(base.sys, "version_info", (3, 10, 13, "final", 0))

    class NoNotes(KeyError):  # stands for 3.10's exceptions: calling add_note fails the test
        def add_note(self, note: str) -> None:
            raise AssertionError("add_note called on Python 3.10")

    def broken(fields):
        raise NoNotes("offset")
    err = from_reply(Resolved({"ok": True}), broken).error()
    assert isinstance(err, NoNotes) and err.__traceback__ is None
    assert len(err.__notes__) == 1 and "in broken" in err.__notes__[0]


@pytest.mark.parametrize("round", range(20))
@pytest.mark.parametrize("made_by", ["worker", "reply"])
def test_threads_that_read_one_copy_together_all_see_it_landed(round, made_by):
    """The training threads of a process share its session: one thread's poll resolves a copy while
    another's graph asks whether it failed (storm.partitioner in two threads died here with
    "'NoneType' object has no attribute 'result'"). Threads start together on each copy, with the
    interpreter switching threads as often as it can."""
    import sys
    import threading
    readers, copies = 4, 200
    pendings, made = [], []
    for _ in range(copies):
        p: Future = Future()
        pendings.append(p)
        if made_by == "worker":
            made.append(Copy(p))
        else:
            made.append(from_reply(p, lambda fields: Landed(nbytes=fields["nbytes"])))
    start = threading.Barrier(readers + 1)
    errors: list[BaseException] = []

    def read() -> None:
        start.wait()
        try:
            for c in made:
                while not c.done():
                    pass
                assert c.error() is None
        except BaseException as e:  # noqa: BLE001 - any failure of a reader fails the test below
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(readers)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        start.wait()
        for i, p in enumerate(pendings):
            if made_by == "worker":
                p.set_result(Landed(nbytes=i))
            else:
                resolve(p, {"ok": True, "nbytes": i})
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert [c.result().nbytes for c in made] == list(range(copies))
