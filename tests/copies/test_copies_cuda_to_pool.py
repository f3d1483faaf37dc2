"""copies/cuda_to_pool.py through the CopyHandler interface, with a fake store and fake copy
streams injected (the real streams run on tests/test_gpu.py's GPU): what PUT and GET ask for, which
copy is queued where in the pool, raw or as a frame, and on which thread."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from copies_fakes import FakeEvent, FakeStore, FakeStreams, storage
from storm.copies.base import PutRequest, Route
from storm.copies.cuda_to_pool import CudaToPool
from storm.errors import StormRequestError
from storm.frames import KINDS
from storm.kernels.frame import frame_nbytes
from stormd.wire.protocol import BITS_FRAME_CODEC, FLOAT32_FRAME_CODEC, FRAME_CODEC, UPCAST_FRAME_CODEC

GPU = torch.device("cuda", 0)  # a name only: the fake streams copy nothing


@pytest.fixture
def worker():
    w = ThreadPoolExecutor(1)
    yield w
    w.shutdown()


def handler(store: FakeStore, worker) -> tuple[CudaToPool, FakeStreams]:
    streams = FakeStreams()
    return CudaToPool(store, worker, streams=lambda device: streams), streams


def test_a_raw_put_is_queued_into_its_extent_after_the_ready_event_and_sealed_once_settled(worker):
    store = FakeStore()
    copies, streams = handler(store, worker)
    ready = FakeEvent()
    store.request("PUT", key=99, nbytes=64, codec="raw")  # an extent before it: the offset counts
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.OWN, "raw", ready))
    assert store.sent[-1] == ("PUT", {"key": 1, "step": 1, "nbytes": 4096, "codec": "raw", "dtype": "uint8"})
    assert streams.queued == [("to_host", (store.pool.address(64, 4096), 4096, ready))]
    assert not put.done() and put.result().nbytes == 4096 and put.result().frame is None
    assert [op for op, _ in store.sent] == ["PUT", "PUT"]  # not sealed: its bytes are still on their way
    put.result().event.fired = True
    assert put.done()
    copies.settle(1, put.result())
    assert store.sent[-1] == ("SEAL", {"key": 1})


@pytest.mark.parametrize("codec, dtype, framed", [(FRAME_CODEC, "bfloat16", frame_nbytes((8 << 20) // 2)),
                                                  (BITS_FRAME_CODEC, "bool", 16 + (1 << 20)),
                                                  (UPCAST_FRAME_CODEC, "float32", 16 + (4 << 20)),
                                                  (FLOAT32_FRAME_CODEC, "float32",
                                                   -(-frame_nbytes(2 << 20) // 8) * 8 + (4 << 20))])
def test_a_framed_put_asks_for_the_frames_size_and_lands_with_its_header(worker, codec, dtype, framed):
    store = FakeStore()
    copies, streams = handler(store, worker)
    raw = 8 << 20
    put = copies.put(PutRequest(1, 1, storage(raw), {"dtype": dtype}, Route.OWN, codec, FakeEvent()))
    assert store.sent[-1][1] | {"nbytes": 0} == {"key": 1, "step": 1, "nbytes": 0, "raw_nbytes": raw,
                                                  "codec": codec, "dtype": dtype}
    assert store.sent[-1][1]["nbytes"] == framed == put.result().nbytes
    what, args = streams.queued[0]
    assert what == "to_host_frame" and args[-1] is KINDS[codec] and put.result().frame.numel() == 16


def test_a_reply_not_in_yet_is_waited_for_on_the_worker(worker):
    store = FakeStore(later=True)
    copies, streams = handler(store, worker)
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.OWN, "raw", FakeEvent()))
    assert not put.done() and streams.queued == []
    store.answer()
    assert put.result().nbytes == 4096 and [what for what, _ in streams.queued] == ["to_host"]


@pytest.mark.parametrize("codec", ["raw", FRAME_CODEC, BITS_FRAME_CODEC, UPCAST_FRAME_CODEC, FLOAT32_FRAME_CODEC])
def test_a_get_is_queued_out_of_its_extent_and_decoded_if_framed(worker, codec):
    """The session fetches a key only once its put's event has fired (it let the tensor go then):
    the copy out waits on nothing."""
    store = FakeStore()
    copies, streams = handler(store, worker)
    raw = 8 << 20
    put = copies.put(PutRequest(1, 1, storage(raw), {"dtype": "bfloat16"}, Route.OWN, codec, FakeEvent()))
    got = copies.get(1, raw, GPU)
    assert store.sent[-1] == ("GET", {"key": 1})
    what, args = streams.queued[-1]
    assert what == ("to_device" if codec == "raw" else "to_device_frame")
    assert args[:2] == (store.pool.address(0, put.result().nbytes), put.result().nbytes)  # waiting on nothing
    assert codec == "raw" or args[-1] is KINDS[codec]  # decoded as its kind
    assert got.result().tensor.numel() == raw and got.result().event is not None and not got.done()


def test_a_refused_put_is_its_copys_error_and_nothing_is_queued(worker):
    copies, streams = handler(FakeStore(refuse="QUOTA"), worker)
    put = copies.put(PutRequest(1, 1, storage(4096), {"dtype": "uint8"}, Route.OWN, "raw", FakeEvent()))
    assert put.done() and isinstance(put.error(), StormRequestError) and streams.queued == []
