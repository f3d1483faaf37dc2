"""copies/cuda_by_daemon.py through the CopyHandler interface, with a fake store, fake IPC export
and events injected (stormd's real copies run in tests/test_gpu_daemon_copies.py): which GPUs it
serves, what PUT and GET carry, when the PUT goes out, and what lands."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from copies_fakes import CudaStorage, FakeEvent, FakeStore, FakeStreams
from storm.copies.base import PutRequest, Route
from storm.copies.cuda_by_daemon import CudaByDaemon
from storm.errors import StormIntegrityError, StormRequestError

GPU = torch.device("cuda", 0)


@pytest.fixture
def worker():
    w = ThreadPoolExecutor(1)
    yield w
    w.shutdown()


def handler(store: FakeStore, worker, uuid: str = "GPU-served") -> CudaByDaemon:
    return CudaByDaemon(store, worker, streams=lambda device: FakeStreams(),
                        export=lambda pointer, device: (b"segment", 16),
                        ipc_event=lambda device: FakeEvent(fired=False, wire=b"done"), uuid_of=lambda index: uuid)


def request(ready: FakeEvent) -> PutRequest:
    """A save the mover routed to stormd: raw, its memory exported as handler() exports it."""
    return PutRequest(1, 1, CudaStorage(4096), {"dtype": "uint8"}, Route.DAEMON, "raw", ready, (b"segment", 16))


def test_it_serves_only_the_gpus_the_daemon_copies_and_exports_their_memory(worker):
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}))
    assert not handler(store, worker, uuid="GPU-other").serves(GPU)
    copies = handler(store, worker)
    assert copies.serves(GPU) and copies.export(CudaStorage(4096)) == (b"segment", 16)


def test_a_put_of_a_finished_tensor_names_its_memory_and_lands_from_the_reply(worker):
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}), later=True)
    copies = handler(store, worker)
    assert copies.serves(GPU)
    put = copies.put(request(FakeEvent(wire=b"ready")))
    op, fields = store.sent[-1]  # sent at once, from this thread
    assert op == "PUT" and fields["nbytes"] == 4096 and fields["codec"] == "raw"
    assert fields["cuda"] == {"handle": b"segment", "offset": 16, "device": "GPU-served", "ready": b"ready",
                              "done": b"done"}
    assert not put.done()
    store.answer()
    assert put.result().nbytes == 4096 and not put.done()  # landed; stormd's copy runs until ``done``
    put.result().event.fired = True
    assert put.done()
    copies.settle(1, put.result())
    assert [op for op, _ in store.sent] == ["PUT"]  # stormd seals what it copies


def test_a_put_of_a_tensor_still_being_made_is_sent_by_the_worker_once_it_is_ready(worker):
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}))
    copies = handler(store, worker)
    copies.serves(GPU)
    ready = FakeEvent(fired=False)
    put = copies.put(request(ready))
    assert put.result().nbytes == 4096 and ready.synchronized and [op for op, _ in store.sent] == ["PUT"]


def test_the_worker_sends_the_next_put_without_waiting_for_a_reply(worker):
    """Puts of tensors still being made go out one after the other as each is ready: none waits for
    the reply to the one before, which lands later, on whichever thread the reply comes."""
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}), later=True)
    copies = handler(store, worker)
    copies.serves(GPU)
    puts = [copies.put(request(FakeEvent(fired=False))) for _ in range(3)]
    worker.submit(lambda: None).result(timeout=120)  # the worker has had its turn at all three
    assert [op for op, _ in store.sent] == ["PUT"] * 3 and not any(p.future.done() for p in puts)
    store.answer()
    assert all(p.result().nbytes == 4096 and p.error() is None for p in puts)


def test_a_refused_put_is_its_copys_error(worker):
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}), refuse="POOL_FULL")
    copies = handler(store, worker)
    copies.serves(GPU)
    put = copies.put(request(FakeEvent()))
    assert put.done() and isinstance(put.error(), StormRequestError)


def test_a_get_names_a_fresh_buffer_and_refuses_a_reply_of_another_size(worker):
    store = FakeStore(cuda_devices=frozenset({"GPU-served"}))
    copies = handler(store, worker)
    copies.serves(GPU)
    store.request("PUT", key=1, nbytes=4096, codec="raw")
    got = copies.get(1, 4096, GPU)
    op, fields = store.sent[-1]
    assert op == "GET" and fields["key"] == 1 and fields["cuda"]["ready"] == b"destination ready"
    assert got.result().tensor.numel() == 4096 and got.result().event.wire == b"done"
    with pytest.raises(StormIntegrityError, match="4096 bytes"):
        copies.get(1, 8, GPU).result()
