"""storm.kernels.float32_frame: codec b on float32's high halves, the low halves raw."""

from __future__ import annotations

import pytest
import torch

from storm.kernels.container import CorruptEncodedError
from storm.kernels.float32_frame import decode_float32_frame, encode_float32_frame, float32_frame_nbytes
from storm.kernels.frame_layout import complete


def framed(t: torch.Tensor) -> torch.Tensor:
    frame = torch.empty(float32_frame_nbytes(t.numel() * 4), dtype=torch.uint8)
    encode_float32_frame(t, frame)
    return frame


def test_probabilities_and_every_special_pattern_round_trip_every_bit():
    special = torch.tensor([0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000000, 0x80000000, 0x00000001,
                            0x807FFFFF, 0x7F800000, 0xFF800000], dtype=torch.int64).to(torch.int32)
    probs = torch.randn(32, 1000, generator=torch.Generator().manual_seed(0)).softmax(-1).reshape(-1)
    t = torch.cat([special.view(torch.float32), probs])
    frame = framed(t)
    assert complete(frame[:16]) and frame.numel() < t.numel() * 4
    out = torch.empty_like(t)
    kept = frame.clone()
    assert torch.equal(decode_float32_frame(frame, out).view(torch.int32), t.view(torch.int32))
    assert torch.equal(frame[:-t.numel() * 2], kept[:-t.numel() * 2])  # the ancf_exp frame is read alone


def test_high_halves_of_no_pattern_overflow_the_frame_and_its_decode_refuses():
    noise = torch.randint(-(2**31), 2**31 - 1, (8192,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(1)).to(torch.int32).view(torch.float32)
    frame = framed(noise)
    assert not complete(frame[:16])
    with pytest.raises(CorruptEncodedError, match="incomplete frame"):
        decode_float32_frame(frame, torch.empty_like(noise))
