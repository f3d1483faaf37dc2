"""The mover's Replied: a copy stormd makes resolves from its reply, on the calling thread, with the
errors a worker's Future would carry (CPU; tests/test_gpu_daemon_copies.py runs it on stormd's copies);
errors kept by transfers made on the calling thread."""

from __future__ import annotations

import gc
import threading
import weakref
from concurrent.futures import Future

import pytest
import torch

from client import transfer
from client.replies import Settled, settle
from client.errors import StormIntegrityError, StormRequestError, StormUnavailable
from client.transfer import Replied


class Backend:
    name = "stormd under test"


def test_it_resolves_from_the_reply_once_and_only_once_it_is_in():
    reply: Future = Future()
    calls = []
    r = Replied(Backend(), "GET", reply, lambda fields: calls.append(fields) or fields["nbytes"] * 2)
    assert not r.done()
    settle(reply, {"ok": True, "nbytes": 21})
    assert r.done()
    assert r.exception() is None
    assert r.result() == 42 and r.result() == 42
    assert calls == [{"ok": True, "nbytes": 21}]  # mapped once


def test_an_error_reply_is_its_exception_and_every_result_raises_it():
    reply: Future = Future()
    r = Replied(Backend(), "PUT", reply, lambda fields: pytest.fail("an error reply is not mapped"))
    settle(reply, {"ok": False, "error": "POOL_FULL", "message": "no room"})
    err = r.exception()
    assert isinstance(err, StormRequestError) and "POOL_FULL" in str(err)
    for _ in range(2):
        with pytest.raises(StormRequestError):
            r.result()


def test_a_reply_the_mapping_refuses_is_the_transfers_error():
    reply: Future = Future()

    def refuse(fields):
        raise StormIntegrityError(f"store returned {fields['nbytes']} bytes")
    r = Replied(Backend(), "GET", reply, refuse)
    settle(reply, {"ok": True, "nbytes": 3})
    assert isinstance(r.exception(), StormIntegrityError)
    with pytest.raises(StormIntegrityError, match="3 bytes"):
        r.result()


def test_a_reply_that_never_comes_is_unavailable_after_the_request_timeout(monkeypatch):
    monkeypatch.setattr(transfer, "REQUEST_TIMEOUT", 0.05)
    r = Replied(Backend(), "GET", Future(), lambda fields: fields)
    with pytest.raises(StormUnavailable, match="did not answer GET"):
        r.result()
    assert isinstance(r.exception(), StormUnavailable)


class RecordingBackend(Backend):
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def request(self, op: str, **fields) -> Future:
        self.sent.append((op, fields))
        reply: Future = Future()
        settle(reply, {"ok": True})
        return reply


def test_only_puts_the_store_does_not_seal_itself_are_sealed_by_the_client():
    backend = RecordingBackend()
    mover = transfer.Mover(backend)
    try:
        mover.seal(1, transfer.Transfer(Settled(transfer.Put(4096, None, sealed=True))))  # stormd copied it
        mover.seal(2, transfer.Transfer(Settled(transfer.Put(4096, None))))  # this process copied it
    finally:
        mover.close()
    assert backend.sent == [("SEAL", {"key": 2})]


def test_the_mover_copies_on_one_cpu_thread_and_leaves_the_callers_threads_as_they_were():
    """The worker's own OpenMP team beside the training thread's made a 2-core machine's CPU steps
    2.5x slower; the worker runs single-threaded and the caller and later threads keep the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a count the worker must not take, even on a one-core machine
    try:
        mover = transfer.Mover(Backend())
        try:
            assert mover._worker.submit(torch.get_num_threads).result() == 1
        finally:
            mover.close()
        assert torch.get_num_threads() == 2
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
    finally:
        torch.set_num_threads(before)


class Canary:
    """A local of the frame that started a transfer: alive only as long as that frame is."""


def failed_start(mover: transfer.Mover) -> tuple[transfer.Transfer, weakref.ref]:
    """A CUDA put whose reply is in and refused: the copy is queued on this thread, and fails here."""
    canary = Canary()
    reply = Settled.reply({"ok": False, "error": "POOL_FULL", "message": "no room"})
    return mover._start(reply, object(), mover._put, None, reply, object(), None), weakref.ref(canary)


def failed_reply() -> tuple[transfer.Transfer, weakref.ref]:
    """A copy stormd refused, its error read on this thread."""
    canary = Canary()
    reply: Future = Future()
    settle(reply, {"ok": False, "error": "POOL_FULL", "message": "no room"})
    t = transfer.Transfer(Replied(Backend(), "PUT", reply, lambda fields: fields))
    assert t.done()
    return t, weakref.ref(canary)


@pytest.mark.parametrize("how", ["started here", "replied"])
def test_a_kept_error_holds_none_of_the_frames_that_started_the_transfer(how):
    """The error's traceback linked, through each frame's caller, to the frames that saved the tensor
    (the model's forward, with its tensors and the save's Handle): on CUDA every save the store refused
    outlived its step, with or without the garbage collector (bench/results/refused-saves-*)."""
    mover = transfer.Mover(Backend())
    gc.disable()
    try:
        t, canary = failed_start(mover) if how == "started here" else failed_reply()
        assert isinstance(t.error(), StormRequestError) and t.error().code == "POOL_FULL"
        assert canary() is None
    finally:
        gc.enable()
        mover.close()


def test_an_error_the_store_did_not_send_keeps_where_it_was_raised_as_a_note():
    def broken(fields):
        raise KeyError("offset")
    t = transfer.Transfer(Replied(Backend(), "GET", Settled({"ok": True}), broken))
    err = t.error()
    assert isinstance(err, KeyError) and err.__traceback__ is None
    assert "in broken" in err.__notes__[0]
