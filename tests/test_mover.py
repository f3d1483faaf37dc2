"""The mover (client/transfer.py): who seals a put, and the worker thread it runs the copies on.
The completion type's tests are in tests/copies/test_copies_base.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from client import transfer
from client.copies.base import Copy
from client.copies.cpu_to_pool import HostCopies
from client.copies.cuda_by_daemon import DaemonCopies
from client.copies.cuda_to_pool import PoolCopies
from client.replies import resolve


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


def test_only_puts_the_store_does_not_seal_itself_are_sealed_by_the_client():
    backend = RecordingBackend()
    mover = transfer.Mover(backend)
    try:
        mover.seal(1, Copy.landed(nbytes=4096, sealed=True))  # stormd copied it
        mover.seal(2, Copy.landed(nbytes=4096))  # this process copied it
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


class CudaBackend(Backend):
    cuda_devices = frozenset({"GPU-served"})


@pytest.mark.parametrize("uuid, daemon_may_copy, handler", [
    ("GPU-served", True, DaemonCopies),  # stormd copies this GPU's memory, and may copy this tensor
    ("GPU-served", False, PoolCopies),   # a frame, or a tensor whose ready event stormd cannot wait on
    ("GPU-other", True, PoolCopies),     # stormd does not copy this GPU's memory (or no CUDA at all)
])
def test_copies_are_routed_by_medium_and_what_the_daemon_copies(uuid, daemon_may_copy, handler):
    mover = transfer.Mover(CudaBackend(), uuid_of=lambda index: uuid)
    try:
        assert isinstance(mover.route(torch.device("cpu"), daemon_may_copy), HostCopies)
        assert isinstance(mover.route(torch.device("cuda", 0), daemon_may_copy), handler)
        assert mover.daemon_copies(torch.device("cuda", 0)) == (uuid == "GPU-served")
    finally:
        mover.close()


def test_movers_made_at_once_leave_the_default_thread_count_as_it_was(monkeypatch):
    """Each Mover's worker sets torch's process default to 1 and the constructor puts back what it
    read; a second Mover that read between the two took 1 for the default and put that back, so
    threads started later ran single-threaded (other reductions, other gradient bits). The first
    worker is held after its setting so that, unguarded, the second Mover reads inside that window."""
    real = transfer._one_cpu_thread

    def held() -> None:
        real()
        time.sleep(0.4)

    monkeypatch.setattr(transfer, "_one_cpu_thread", held)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        movers: list = []

        def make(delay: float) -> None:
            time.sleep(delay)
            movers.append(transfer.Mover(Backend()))

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
