"""stormd's own CUDA copies (stormd/copier.py) as the protocol and the service see them, on CPU: the
``cuda`` field's checks, NO_CUDA where the daemon copies no GPU memory, and the rule that no
extent is freed, sealed or handed to another PUT while a copy into or out of it may still run.

A scripted copier stands in for CUDA here (the service's bookkeeping is what is under test);
tests/test_gpu.py runs the real one against real IPC handles."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from helpers import put_fields
from stormd.service import Service
from stormd.store_options import StoreOptions
from stormd.wire.cuda import CudaError
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError

FORGED = {"handle": b"\x01" * 64, "offset": 0, "device": "GPU-0", "ready": b"\x02" * 64, "done": b"\x03" * 64}


class ScriptedCopier:
    """Copies that run until the test says they finished; a handle of b'\\xff' * 64 does not open."""

    devices = ["GPU-0"]

    def __init__(self) -> None:
        self.running: set[tuple[int, int]] = set()
        self.copies: list[tuple[str, int, int, int]] = []  # (direction, session, key, nbytes)
        self.closed: list[int] = []

    def _start(self, direction: str, session: int, key: int, cuda: dict, nbytes: int) -> None:
        if cuda["handle"] == b"\xff" * 64:
            raise ProtocolError(ErrorCode.BAD_HANDLE, "the CUDA IPC memory handle does not open")
        self.running.add((session, key))
        self.copies.append((direction, session, key, nbytes))

    def to_host(self, session, key, cuda, dst, nbytes):
        self._start("to_host", session, key, cuda, nbytes)

    def to_device(self, session, key, cuda, src, nbytes):
        self._start("to_device", session, key, cuda, nbytes)

    def busy(self, session, keys):
        return [k for k in keys if (session, k) in self.running]

    def idle(self, session):
        return not any(s == session for s, _ in self.running)

    def close_session(self, session):
        self.closed.append(session)

    def open_segments(self):
        return len({c[1] for c in self.copies} - set(self.closed))  # one segment per session here

    def finish(self, session, key):
        self.running.discard((session, key))


@pytest.fixture
def pool():
    p = SharedPool.anonymous(1 << 20)
    yield p
    p.close()


def hello(service: Service) -> tuple[dict, dict]:
    r = service.handle_message({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": os.getpid(),
                                "host": "test"})
    assert r["ok"], r
    return r, {"session": r["session"], "token": r["token"]}


def call(service: Service, auth: dict, op: str, **fields) -> dict:
    return service.handle_message({"op": op, "id": 7, **auth, **fields})


def used(service: Service) -> int:
    return service.node_stats()["used"]


@pytest.mark.parametrize("defect", ["missing", "extra", "short handle", "long event", "negative offset",
                                    "str handle", "int device", "not a map"])
def test_a_malformed_cuda_field_is_bad_field_and_stores_nothing(pool, defect):
    service = Service(pool, cuda=ScriptedCopier())
    _, auth = hello(service)
    cuda = dict(FORGED)
    if defect == "missing":
        del cuda["done"]
    elif defect == "extra":
        cuda["pid"] = 3
    elif defect == "short handle":
        cuda["handle"] = b"\x01" * 63
    elif defect == "long event":
        cuda["ready"] = b"\x01" * 65
    elif defect == "negative offset":
        cuda["offset"] = -1
    elif defect == "str handle":
        cuda["handle"] = "x" * 64
    elif defect == "int device":
        cuda["device"] = 0
    else:
        cuda = [FORGED["handle"]]
    r = call(service, auth, "PUT", **put_fields(1, 4096), cuda=cuda)
    assert r["error"] == ErrorCode.BAD_FIELD and "cuda" in r["message"], r
    assert used(service) == 0 and call(service, auth, "STATS")["session"]["keys"] == 0


def test_a_daemon_without_cuda_says_so_at_hello_and_refuses_cuda_copies(pool):
    service = Service(pool)
    r, auth = hello(service)
    assert r["cuda_devices"] == []
    put = call(service, auth, "PUT", **put_fields(1, 4096), cuda=FORGED)
    assert put["error"] == ErrorCode.NO_CUDA and "no CUDA" in put["message"], put
    assert used(service) == 0 and call(service, auth, "GET", key=1)["error"] == ErrorCode.NOT_FOUND
    # a key stored the CPU way cannot be fetched into GPU memory either
    assert call(service, auth, "PUT", **put_fields(2, 4096))["ok"] and call(service, auth, "SEAL", key=2)["ok"]
    assert call(service, auth, "GET", key=2, cuda=FORGED)["error"] == ErrorCode.NO_CUDA


def test_hello_lists_the_gpus_the_daemon_copies(pool):
    assert hello(Service(pool, cuda=ScriptedCopier()))[0]["cuda_devices"] == ["GPU-0"]


def test_a_copy_that_cannot_start_stores_nothing(pool):
    service = Service(pool, cuda=ScriptedCopier())
    _, auth = hello(service)
    r = call(service, auth, "PUT", **put_fields(1, 4096), cuda={**FORGED, "handle": b"\xff" * 64})
    assert r["error"] == ErrorCode.BAD_HANDLE, r
    session = call(service, auth, "STATS")["session"]
    assert used(service) == 0 and session["keys"] == 0
    # nor counted as stored (before: STATS and stormctl counted it)
    assert (session["puts"], session["bytes_in"], session["peak_held_bytes"]) == (0, 0, 0), session
    assert call(service, auth, "PUT", **put_fields(1, 4096), cuda=FORGED)["ok"]  # the key is free to use


def test_a_copy_out_that_cannot_start_hands_nothing_back_and_leaves_the_tensor_free_to_spill(pool):
    """A GET whose copy is refused counts no GET, and its tensor is not taken for fetched (which
    keeps a tensor in the pool until FREE: before, one refused GET kept it from spilling for good)."""
    service = Service(pool, cuda=ScriptedCopier())
    r, auth = hello(service)
    assert call(service, auth, "PUT", **put_fields(1, 4096))["ok"] and call(service, auth, "SEAL", key=1)["ok"]
    got = call(service, auth, "GET", key=1, cuda={**FORGED, "handle": b"\xff" * 64})
    assert got["error"] == ErrorCode.BAD_HANDLE, got
    session = call(service, auth, "STATS")["session"]
    assert (session["gets"], session["bytes_out"]) == (0, 0), session
    assert service.store.find(r["session"], 1).fetched is False
    assert call(service, auth, "GET", key=1, cuda=FORGED)["ok"] and service.store.find(r["session"], 1).fetched


def test_no_extent_is_sealed_freed_or_reused_while_its_copy_runs(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    _, b = hello(service)
    put = call(service, a, "PUT", **put_fields(1, 4096), cuda=FORGED)
    assert put["ok"] and copier.copies == [("to_host", a["session"], 1, 4096)]
    sealed = call(service, a, "SEAL", key=1)  # not needed (the daemon seals it), and refused while it runs
    assert sealed["error"] == ErrorCode.COPY_IN_FLIGHT, sealed
    # FREE answers at once (the client may go on) but the extent stays taken
    assert call(service, a, "FREE", keys=[1]) == {"id": 7, "ok": True, "freed": 1}
    assert used(service) == 4096
    other = call(service, b, "PUT", **put_fields(9, 4096))
    assert other["ok"] and other["offset"] != put["offset"]
    copier.finish(a["session"], 1)
    assert call(service, b, "PING")["ok"]  # any request releases what waited
    assert used(service) == 4096 and call(service, a, "STATS")["session"]["keys"] == 0
    again = call(service, a, "PUT", **put_fields(2, 4096))
    assert again["ok"] and again["offset"] == put["offset"]


def test_the_daemon_seals_what_its_copies_filled_once_they_have_finished(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    for key in (1, 2, 3):
        assert call(service, a, "PUT", **put_fields(key, 4096), cuda=FORGED)["ok"]
    early = call(service, a, "GET", key=2, cuda=FORGED)
    assert early["error"] == ErrorCode.COPY_IN_FLIGHT and "done event" in early["message"], early
    # copies may finish out of order (several GPUs): a GET takes its key whatever runs before it
    copier.finish(a["session"], 2)
    got = call(service, a, "GET", key=2, cuda=FORGED)
    assert got["ok"] and got["checksum"] is None, got
    copier.finish(a["session"], 1)
    copier.finish(a["session"], 3)
    assert call(service, a, "PING")["ok"]  # any request seals what has finished since
    for key in (1, 3):
        assert call(service, a, "GET", key=key, cuda=FORGED)["ok"]


def test_a_key_freed_before_the_daemon_sealed_it_is_not_sealed_in_its_next_life(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    assert call(service, a, "PUT", **put_fields(1, 4096), cuda=FORGED)["ok"]
    assert call(service, a, "PUT", **put_fields(2, 4096), cuda=FORGED)["ok"]
    copier.finish(a["session"], 2)  # key 1's copy still runs, so key 2 waits behind it to be sealed
    assert call(service, a, "FREE", keys=[2])["freed"] == 1
    assert call(service, a, "PUT", **put_fields(2, 4096))["ok"]  # stored anew, by a CPU copy not yet made
    copier.finish(a["session"], 1)
    assert call(service, a, "GET", key=1, cuda=FORGED)["ok"]
    assert call(service, a, "GET", key=2)["error"] == ErrorCode.NOT_SEALED  # its client has not sealed it


def test_what_the_daemons_copies_filled_is_spilled_once_sealed_never_while_they_run():
    spill_dir = tempfile.mkdtemp(prefix="stormd-spill-test-", dir="/var/tmp")  # on disk, as stormd requires
    small = SharedPool.anonymous(64 << 10)
    copier = ScriptedCopier()
    service = Service(small, cuda=copier, store_options=StoreOptions(spill_dir=spill_dir, spill_limit=1 << 20))
    try:
        _, a = hello(service)
        for key in (1, 2, 3, 4):  # the pool is full of copies still running
            assert call(service, a, "PUT", **put_fields(key, 16 << 10), cuda=FORGED)["ok"]
        full = call(service, a, "PUT", **put_fields(5, 16 << 10))
        assert full["error"] == ErrorCode.POOL_FULL, full  # nothing sealed: nothing may move
        copier.finish(a["session"], 1)
        assert call(service, a, "PUT", **put_fields(5, 16 << 10))["ok"]  # key 1, sealed by stormd, went to disk
        assert call(service, a, "STATS")["session"]["spilled_bytes"] == 16 << 10
        assert call(service, a, "GET", key=1, cuda=FORGED)["error"] == ErrorCode.POOL_FULL  # no room to read back
        copier.finish(a["session"], 2)
        assert call(service, a, "GET", key=1, cuda=FORGED)["ok"]  # key 2 made room
        assert call(service, a, "STATS")["node"]["read_back_total"] == 16 << 10
    finally:
        service.store.close()
        small.close()
        shutil.rmtree(spill_dir, ignore_errors=True)


def test_a_fetch_in_flight_holds_its_extent_through_free_by_step(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    assert call(service, a, "PUT", **put_fields(1, 4096, step=3))["ok"] and call(service, a, "SEAL", key=1)["ok"]
    assert call(service, a, "PUT", **put_fields(2, 4096, step=3))["ok"] and call(service, a, "SEAL", key=2)["ok"]
    got = call(service, a, "GET", key=1, cuda=FORGED)
    assert got["ok"] and copier.copies == [("to_device", a["session"], 1, 4096)]
    assert call(service, a, "FREE", step=3)["freed"] == 2
    assert used(service) == 4096  # key 2 is gone, key 1 waits for its copy
    copier.finish(a["session"], 1)
    service.settle_copies()  # what the server's reaper does when no request comes
    assert used(service) == 0


def test_a_session_that_ends_with_copies_running_is_freed_once_they_finish(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    _, b = hello(service)
    assert call(service, a, "PUT", **put_fields(1, 4096), cuda=FORGED)["ok"]
    assert call(service, a, "PUT", **put_fields(2, 8192))["ok"]
    assert call(service, a, "BYE")["freed"] == 2
    assert call(service, a, "STATS")["error"] == ErrorCode.UNAUTHORIZED  # the session is gone at once
    assert used(service) == 4096 + 8192 and copier.closed == []  # its extents and handles wait
    assert call(service, b, "PING")["ok"] and copier.closed == []
    copier.finish(a["session"], 1)
    service.settle_copies()
    assert used(service) == 0 and copier.closed == [a["session"]]


def test_a_cuda_failure_while_releasing_costs_one_reply_not_the_daemon(pool):
    copier = ScriptedCopier()
    service = Service(pool, cuda=copier)
    _, a = hello(service)
    assert call(service, a, "PUT", **put_fields(1, 4096), cuda=FORGED)["ok"]
    assert call(service, a, "FREE", keys=[1])["ok"]  # deferred: its copy runs

    def broken(session, keys):
        raise CudaError("cudaEventQuery failed: CUDA error 700 (cudaErrorIllegalAddress)")
    copier.busy = broken
    r = call(service, a, "PING")
    assert r["error"] == ErrorCode.INTERNAL and "cudaEventQuery" in r["message"], r
    assert call(service, a, "PUT", **put_fields(2, 4096))["ok"]  # CPU tensors are still served


class CountingRuntime:
    """The few runtime calls a Mark makes, counted: events are integers."""

    cudaEventDisableTiming = 2

    def __init__(self) -> None:
        self.created = self.records = 0

    def cudaEventCreateWithFlags(self, flags):
        self.created += 1
        return 0, self.created

    def cudaEventRecord(self, event, stream):
        self.records += 1
        return (0,)


def test_a_mark_takes_a_spare_event_and_gives_it_back_once_nothing_holds_it(monkeypatch):
    """The daemon records one of its own events per copy: made once and reused, not created and
    destroyed per request (a host cost on the loop every rank waits on)."""
    from stormd import copier
    from stormd.wire import cuda as binding

    fake = CountingRuntime()
    monkeypatch.setattr(binding, "rt", fake)
    spare: list = []
    first = copier.Mark("stream", spare)
    event = first.event
    assert fake.created == 1 and fake.records == 1 and spare == []
    del first  # nothing holds it: its event is a spare again
    assert spare == [event]
    second = copier.Mark("stream", spare)
    assert second.event == event and fake.created == 1 and fake.records == 2 and spare == []
    held = copier.Mark("stream", spare)  # none spare while the second is held: a new one
    assert held.event != event and fake.created == 2
