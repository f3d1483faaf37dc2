"""storm.kernels.upcast_frame: float32 widened from bf16 at its high halves, flagged where not."""

from __future__ import annotations

import pytest
import torch

from storm.kernels.container import CorruptEncodedError
from storm.kernels.frame_layout import complete
from storm.kernels.upcast_frame import decode_upcast_frame, encode_upcast_frame, upcast_frame_nbytes


def framed(t: torch.Tensor) -> torch.Tensor:
    frame = torch.empty(upcast_frame_nbytes(t.numel() * t.element_size()), dtype=torch.uint8)
    encode_upcast_frame(t, frame)
    return frame


def special_bf16() -> torch.Tensor:
    """Every bf16 pattern's corner: NaN payloads, both zeros, subnormals, infinities, random values."""
    bits = torch.tensor([0x7FC1, 0xFFFF, 0x7F81, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80],
                        dtype=torch.int32).to(torch.int16)
    return torch.cat([bits.view(torch.bfloat16), torch.randn(4093, generator=torch.Generator().manual_seed(1))
                      .to(torch.bfloat16)])


def test_an_upcast_round_trips_at_half_its_bytes_every_bit():
    wide = special_bf16().float()  # widening keeps every bit pattern, NaN payloads included
    assert torch.equal((wide.view(torch.int32) & 0xFFFF), torch.zeros_like(wide, dtype=torch.int32))
    frame = framed(wide)
    assert frame.numel() == 16 + wide.numel() * 2 and complete(frame[:16])
    out = torch.full_like(wide, 7.0)
    decode_upcast_frame(frame, out)
    assert torch.equal(out.view(torch.int32), wide.view(torch.int32))


def test_a_word_with_a_low_half_makes_the_frame_incomplete_and_its_decode_refuse():
    for low in (1, -1):  # the low half's largest and smallest both count
        words = torch.zeros(64, dtype=torch.int32)
        words[17] = low & 0xFFFF if low > 0 else -1
        frame = framed(words.view(torch.float32))
        assert not complete(frame[:16])
        with pytest.raises(CorruptEncodedError, match="low half is not 0"):
            decode_upcast_frame(frame, torch.empty(64, dtype=torch.float32))
    assert complete(framed(torch.zeros(0))[:16])
