"""copies/cuda_to_pool.py through the CopyHandler interface, with a fake store and fake copy
streams injected (the real streams run on tests/test_gpu.py's GPU): what PUT and GET ask for, which
copy is queued where in the pool, raw or as a frame, and on which thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from client.copies.base import PutRequest
from client.copies.cuda_to_pool import PoolCopies
from client.errors import StormRequestError
from storm.kernels.frame import frame_nbytes
from stormd.wire.protocol import FRAME_CODEC

from copies_fakes import FakeEvent, FakeStore, FakeStreams, storage

GPU = torch.device("cuda", 0)  # a name only: the fake streams copy nothing


@pytest.fixture
def worker():
    w = ThreadPoolExecutor(1)
    yield w
    w.shutdown()


def handler(store: FakeStore, worker) -> tuple[PoolCopies, FakeStreams]:
    streams = FakeStreams()
    return PoolCopies(store, worker, streams=lambda device: streams), streams


def test_a_raw_put_is_queued_into_its_extent_after_the_ready_event_and_left_for_the_client_to_seal(worker):
    store = FakeStore()
    copies, streams = handler(store, worker)
    ready = FakeEvent()
    store.request("PUT", key=99, nbytes=64, codec="raw")  # an extent before it: the offset counts
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, ready), "raw")
    assert store.sent[-1] == ("PUT", {"key": 1, "step": 1, "nbytes": 4096, "codec": "raw", "dtype": "uint8"})
    assert streams.queued == [("to_host", (store.pool.address(64, 4096), 4096, ready))]
    assert not put.done() and put.nbytes == 4096 and not put.sealed and put.frame is None
    put.event.fired = True
    assert put.done()


def test_a_framed_put_asks_for_the_frames_size_and_lands_with_its_header(worker):
    store = FakeStore()
    copies, streams = handler(store, worker)
    raw = 8 << 20
    put = copies.put(PutRequest(1, 1, storage(raw), {"dtype": "bfloat16"}, FakeEvent()), FRAME_CODEC)
    assert store.sent[-1][1] | {"nbytes": 0} == {"key": 1, "step": 1, "nbytes": 0, "raw_nbytes": raw,
                                                  "codec": FRAME_CODEC, "dtype": "bfloat16"}
    assert store.sent[-1][1]["nbytes"] == frame_nbytes(raw // 2) == put.nbytes
    assert streams.queued[0][0] == "to_host_frame" and put.frame.numel() == 16


def test_a_reply_not_in_yet_is_waited_for_on_the_worker(worker):
    store = FakeStore(later=True)
    copies, streams = handler(store, worker)
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, FakeEvent()), "raw")
    assert not put.done() and streams.queued == []
    store.answer()
    assert put.result().nbytes == 4096 and [what for what, _ in streams.queued] == ["to_host"]


@pytest.mark.parametrize("codec", ["raw", FRAME_CODEC])
def test_a_get_is_queued_out_of_its_extent_after_the_puts_event_and_decoded_if_framed(worker, codec):
    store = FakeStore()
    copies, streams = handler(store, worker)
    raw = 8 << 20
    put = copies.put(PutRequest(1, 1, storage(raw), {"dtype": "bfloat16"}, FakeEvent()), codec)
    got = copies.get(1, raw, GPU, after=put.event)
    assert store.sent[-1] == ("GET", {"key": 1})
    what, args = streams.queued[-1]
    assert what == ("to_device" if codec == "raw" else "to_device_frame")
    assert args[0] == store.pool.address(0, put.nbytes) and args[-1] is put.event
    assert got.tensor.numel() == raw and got.event is not None and not got.done()


def test_a_refused_put_is_its_copys_error_and_nothing_is_queued(worker):
    copies, streams = handler(FakeStore(refuse="QUOTA"), worker)
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, FakeEvent()), "raw")
    assert put.done() and isinstance(put.error(), StormRequestError) and streams.queued == []
