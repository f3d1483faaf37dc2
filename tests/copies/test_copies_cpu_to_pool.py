"""copies/cpu_to_pool.py through the CopyHandler interface, with a fake store injected: a put is
sent, copied, checksummed and sealed by the worker; a get comes back verified and decoded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from copies_fakes import FakeStore, storage
from storm.copies.base import PutRequest, Route
from storm.copies.cpu_to_pool import CpuToPool
from storm.errors import StormIntegrityError, StormRequestError

CPU = torch.device("cpu")


@pytest.fixture
def worker():
    w = ThreadPoolExecutor(1)
    yield w
    w.shutdown()


def test_a_put_lands_sealed_with_its_checksum_and_comes_back_whole(worker):
    store = FakeStore()
    copies = CpuToPool(store, worker)
    src = torch.arange(4096, dtype=torch.int32)
    put = copies.put(PutRequest(1, 1, src.untyped_storage(), {"dtype": "int32"}, Route.HOST, "raw"))
    put.wait()
    assert put.error() is None and put.result().nbytes == src.nbytes and put.result().event is None and put.done()
    assert [op for op, _ in store.sent] == ["PUT", "SEAL"] and store.entries[1]["checksum"] is not None
    got = copies.get(1, src.nbytes, CPU)
    assert torch.equal(got.result().tensor.view(torch.int32), src)


def test_a_codec_stores_fewer_bytes_and_the_get_decodes_them(worker):
    store = FakeStore()
    copies = CpuToPool(store, worker)
    src = torch.zeros(1 << 16, dtype=torch.float32)
    put = copies.put(PutRequest(1, 1, src.untyped_storage(), {"dtype": "float32"}, Route.HOST, "auto"))
    assert put.result().nbytes < src.nbytes and store.entries[1]["codec"] != "raw"
    assert torch.equal(copies.get(1, src.nbytes, CPU).result().tensor.view(torch.float32), src)


@pytest.mark.parametrize("verify", [True, False])
def test_bytes_changed_in_the_pool_are_an_integrity_error_only_when_verified(worker, verify):
    store = FakeStore()
    copies = CpuToPool(store, worker)
    copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.HOST, "raw")).wait()
    store.pool.view(0, 1).fill_(0)
    got = copies.get(1, 4096, CPU, verify=verify)
    got.wait()
    assert isinstance(got.error(), StormIntegrityError) == verify


def test_a_get_of_another_size_than_was_stored_is_an_integrity_error(worker):
    store = FakeStore()
    copies = CpuToPool(store, worker)
    copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.HOST, "raw")).wait()
    with pytest.raises(StormIntegrityError, match="4096 bytes, 8 were stored"):
        copies.get(1, 8, CPU).result()


def test_a_refused_put_is_its_copys_error_and_nothing_is_written(worker):
    copies = CpuToPool(FakeStore(refuse="POOL_FULL"), worker)
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.HOST, "raw"))
    put.wait()
    assert isinstance(put.error(), StormRequestError) and put.error().code == "POOL_FULL"
