"""storm/frames.py: which CUDA saves go in which frame, and each kind round-trips its bytes
(the encoders and decoders the copy streams run, here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from storm.frames import FRAME_MIN_BYTES, KINDS, frame_bytes, frame_codec
from storm.kernels.bits_frame import bits_frame_nbytes
from storm.kernels.frame import frame_nbytes
from stormd.wire.protocol import BITS_FRAME_CODEC, FLOAT32_FRAME_CODEC, FRAME_CODEC, STORED_CODECS, UPCAST_FRAME_CODEC


@pytest.mark.parametrize("setting, device, dtype, nbytes, codec", [
    ("auto", "cuda", "bfloat16", FRAME_MIN_BYTES, FRAME_CODEC),
    ("ancf_exp", "cuda", "bfloat16", FRAME_MIN_BYTES, FRAME_CODEC),
    ("auto", "cuda", "bool", FRAME_MIN_BYTES + 1, BITS_FRAME_CODEC),
    ("ancf_exp", "cuda", "bool", FRAME_MIN_BYTES, None),   # that codec names bf16's frames alone
    ("auto", "cuda", "bool", FRAME_MIN_BYTES - 1, None),   # small: raw
    ("auto", "cuda", "bfloat16", FRAME_MIN_BYTES + 1, None),  # not whole words
    ("auto", "cpu", "bool", FRAME_MIN_BYTES, None),        # CPU tensors: the mover's codecs
    ("ancf_exp", "cuda", "float32", FRAME_MIN_BYTES, None),
    ("auto", "cuda", "float16", FRAME_MIN_BYTES, None),
    ("raw", "cuda", "bool", FRAME_MIN_BYTES, None),
])
def test_the_codec_setting_and_the_dtype_choose_the_frame(setting, device, dtype, nbytes, codec):
    assert frame_codec(setting, device, dtype, nbytes) == codec


@pytest.mark.parametrize("producer, nbytes, codec", [
    ("ToCopyBackward0", FRAME_MIN_BYTES, UPCAST_FRAME_CODEC),  # .float(): widened, its low halves 0
    ("SoftmaxBackward0", FRAME_MIN_BYTES, FLOAT32_FRAME_CODEC),  # float32 of its own: its high halves coded
    ("", FRAME_MIN_BYTES, FLOAT32_FRAME_CODEC),
    ("ToCopyBackward0", FRAME_MIN_BYTES + 2, None),  # not whole 32-bit words
])
def test_an_upcast_frame_takes_a_conversion_output_and_a_float32_frame_the_rest(producer, nbytes, codec):
    assert frame_codec("auto", "cuda", "float32", nbytes, producer) == codec


@pytest.mark.parametrize("codec, raw", [
    (FRAME_CODEC, torch.randn(8192, dtype=torch.bfloat16).view(torch.uint8)),
    (BITS_FRAME_CODEC, (torch.rand(8197) < 0.5).view(torch.uint8)),
    (UPCAST_FRAME_CODEC, torch.randn(4096, dtype=torch.bfloat16).float().view(torch.uint8)),
    (FLOAT32_FRAME_CODEC, torch.randn(64, 512).softmax(-1).view(torch.uint8)),
])
def test_each_kind_round_trips_a_storage_bytes(codec, raw):
    assert codec in STORED_CODECS  # what a PUT may say
    kind = KINDS[codec]
    frame = torch.empty(kind.nbytes(raw.numel()), dtype=torch.uint8)
    kind.encode(raw, frame)
    out = torch.empty_like(raw)
    kind.decode(frame, out)
    assert torch.equal(out, raw)
    assert frame.numel() < raw.numel()


def test_a_kind_whose_frame_overflowed_takes_the_next_frame_or_none():
    """A float16 widened (its low halves not 0) overflows its upcast frame: its kind takes float32
    frames; a kind whose float32 frame overflowed too, or a bf16 one whose frame did, goes raw."""
    wide = ("auto", "cuda", "float32", FRAME_MIN_BYTES, "ToCopyBackward0")
    assert frame_codec(*wide, overflowed={UPCAST_FRAME_CODEC}) == FLOAT32_FRAME_CODEC
    assert frame_codec(*wide, overflowed={UPCAST_FRAME_CODEC, FLOAT32_FRAME_CODEC}) is None
    assert frame_codec("auto", "cuda", "bfloat16", FRAME_MIN_BYTES, overflowed={FRAME_CODEC}) is None


@pytest.mark.parametrize("codec", [UPCAST_FRAME_CODEC, FLOAT32_FRAME_CODEC])
def test_a_32_bit_frame_refuses_another_size_and_bytes_not_in_words(codec):
    from storm.kernels.container import CorruptEncodedError
    kind = KINDS[codec]
    frame = torch.empty(kind.nbytes(64 * 4), dtype=torch.uint8)
    kind.encode(torch.zeros(64).view(torch.uint8), frame)
    with pytest.raises(CorruptEncodedError, match="frame of 260 bytes"):
        kind.decode(frame, torch.empty(65 * 4, dtype=torch.uint8))
    with pytest.raises(CorruptEncodedError, match="32-bit words"):
        kind.encode(torch.zeros(6, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8))


def test_the_device_bytes_of_a_routes_frame():
    """What encoding a save into its route's frame adds on the device while it waits for its copy:
    the frame's size for a frame codec, nothing for a codec that makes none on the device."""
    assert frame_bytes(FRAME_CODEC, 8 << 20) == frame_nbytes(4 << 20)
    assert frame_bytes(BITS_FRAME_CODEC, 8 << 20) == bits_frame_nbytes(8 << 20)
    assert frame_bytes("raw", 8 << 20) == frame_bytes("ancf_exp", 8 << 20) == 0  # a CPU codec's
