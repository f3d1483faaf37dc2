"""The mover (storm/mover.py): the route a save takes, decided once; which handler tells the
store a put has landed; and the worker thread it runs the copies on. The completion type's tests
are in tests/copies/test_copies_base.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from storm import mover as moving
from storm.copies.base import Landed, Route
from storm.gpu import NotExportable
from storm.replies import resolve
from stormd.wire.protocol import BITS_FRAME_CODEC, FLOAT32_FRAME_CODEC, FRAME_CODEC, UPCAST_FRAME_CODEC


class Backend:
    name = "stormd under test"


class RecordingBackend(Backend):
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def request(self, op: str, **fields) -> Future:
        self.sent.append((op, fields))
        reply: Future = Future()
        resolve(reply, {"ok": True})
        return reply


def test_only_puts_this_process_copied_on_its_streams_are_sealed_once_landed():
    backend = RecordingBackend()
    m = moving.Mover(backend)
    try:
        m.settle(Route.DAEMON, 1, Landed(nbytes=4096))  # stormd copied it, and seals it itself
        m.settle(Route.OWN, 2, Landed(nbytes=4096))     # this process copied it
        m.settle(Route.HOST, 3, Landed(nbytes=4096))    # a CPU put seals itself, with its checksum
    finally:
        m.close()
    assert backend.sent == [("SEAL", {"key": 2})]


def test_the_mover_copies_on_one_cpu_thread_and_leaves_the_callers_threads_as_they_were():
    """The worker's own OpenMP team beside the training thread's made a 2-core machine's CPU steps
    2.5x slower; the worker runs single-threaded and the caller and later threads keep the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a count the worker must not take, even on a one-core machine
    try:
        m = moving.Mover(Backend())
        try:
            assert m._worker.submit(torch.get_num_threads).result() == 1
        finally:
            m.close()
        assert torch.get_num_threads() == 2
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
    finally:
        torch.set_num_threads(before)


class CudaBackend(Backend):
    cuda_devices = frozenset({"GPU-served"})


class Storage:
    """What routing reads of a CUDA storage, without a GPU."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, nbytes: int):
        self._nbytes = nbytes

    def nbytes(self) -> int:
        return self._nbytes

    def data_ptr(self) -> int:
        return 1 << 20


MIB = 1 << 20


@pytest.mark.parametrize("uuid, dtype, nbytes, codec, route, stored_as, producer", [
    ("GPU-served", "float32", MIB, "raw", Route.DAEMON, "raw", ""),             # stormd copies this GPU's memory
    ("GPU-served", "bfloat16", 8 * MIB, "auto", Route.OWN, FRAME_CODEC, ""),   # a frame: this process encodes it
    ("GPU-served", "bfloat16", MIB, "auto", Route.DAEMON, "raw", ""),          # too small for a frame
    ("GPU-other", "float32", MIB, "raw", Route.OWN, "raw", ""),                # stormd does not copy this GPU
    ("GPU-served", "bool", 8 * MIB, "auto", Route.OWN, BITS_FRAME_CODEC, ""),  # a mask: a bit an element
    ("GPU-served", "float32", 8 * MIB, "auto", Route.OWN, UPCAST_FRAME_CODEC, "ToCopyBackward0"),  # .float()
    ("GPU-served", "float32", 8 * MIB, "auto", Route.OWN, FLOAT32_FRAME_CODEC, "SoftmaxBackward0"),  # its own
])
def test_a_save_is_routed_once_by_medium_codec_and_what_the_daemon_copies(uuid, dtype, nbytes, codec, route,
                                                                         stored_as, producer):
    m = moving.Mover(CudaBackend(), uuid_of=lambda index: uuid, export=lambda ptr, index: (b"h", ptr - 4096))
    try:
        cpu = torch.empty(16, dtype=torch.uint8).untyped_storage()
        assert m.route(cpu, "uint8", "auto") == (Route.HOST, "auto", None)
        assert m.route(Storage(nbytes), dtype, codec, producer) == (
            route, stored_as, (b"h", MIB - 4096) if route is Route.DAEMON else None)
    finally:
        m.close()


def test_memory_cuda_ipc_cannot_name_takes_this_processs_copies_from_then_on(caplog):
    tried = []

    def export(ptr: int, index: int) -> tuple[bytes, int]:
        tried.append(ptr)
        raise NotExportable("expandable segments")

    m = moving.Mover(CudaBackend(), uuid_of=lambda index: "GPU-served", export=export)
    try:
        routes = [m.route(Storage(MIB), "float32", "raw") for _ in range(3)]
    finally:
        m.close()
    assert routes == [(Route.OWN, "raw", None)] * 3 and len(tried) == 1
    assert [r.levelname for r in caplog.records if "expandable segments" in r.getMessage()] == ["WARNING"]


def test_movers_made_at_once_leave_the_default_thread_count_as_it_was(monkeypatch):
    """Each Mover's worker sets torch's process default to 1 and the constructor puts back what it
    read; a second Mover that read between the two took 1 for the default and put that back, so
    threads started later ran single-threaded (other reductions, other gradient bits). The first
    worker is held after its setting so that, unguarded, the second Mover reads inside that window."""
    real = moving._one_cpu_thread

    def held() -> None:
        real()
        time.sleep(0.4)

    monkeypatch.setattr(moving, "_one_cpu_thread", held)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        movers: list = []

        def make(delay: float) -> None:
            time.sleep(delay)
            movers.append(moving.Mover(Backend()))

        threads = [threading.Thread(target=make, args=(d,)) for d in (0.0, 0.2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for m in movers:
            m.close()
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert len(movers) == 2 and later == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_frees_gather_into_one_request_sent_before_the_next_put_request_or_close(monkeypatch):
    """Backward lets go of saves one at a time: a FREE each was a third of a daemon's requests. Keys
    gather until FREE_BATCH, and whatever gathered goes before another request (STATS counts them
    freed), a PUT (which must find the pool without them) and at close."""
    monkeypatch.setattr(moving, "FREE_BATCH", 4)
    backend = RecordingBackend()
    backend.alive = True
    m = moving.Mover(backend)
    try:
        m.free([1, 2])
        m.free([3])
        assert backend.sent == []
        m.free([4, 5])  # five gathered: one FREE
        assert backend.sent == [("FREE", {"keys": [1, 2, 3, 4, 5]})]
        m.free([6])
        m.request("STATS").result(timeout=10)
        assert backend.sent[1:] == [("FREE", {"keys": [6]}), ("STATS", {})]
        m.flush_frees()  # nothing gathered: nothing sent
        m.free([7])
    finally:
        m.close()
    assert backend.sent[3:] == [("FREE", {"keys": [7]})]


def test_a_store_that_is_gone_is_sent_no_free():
    """It freed its keys as it went."""
    backend = RecordingBackend()
    backend.alive = False
    m = moving.Mover(backend)
    m.free(list(range(moving.FREE_BATCH)))
    m.close()
    assert backend.sent == []
