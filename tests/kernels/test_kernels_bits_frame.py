"""storm.kernels.bits_frame: a bool tensor at a bit an element, its largest byte in the header."""

from __future__ import annotations

import pytest
import torch

from storm.kernels.bits_frame import bits_frame_nbytes, decode_bits_frame, encode_bits_frame
from storm.kernels.container import CorruptEncodedError
from storm.kernels.frame import encode_frame, frame_nbytes
from storm.kernels.frame_layout import complete


def framed(t: torch.Tensor) -> torch.Tensor:
    frame = torch.empty(bits_frame_nbytes(t.numel()), dtype=torch.uint8)
    encode_bits_frame(t, frame)
    return frame


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096, 4103])
def test_a_mask_round_trips_at_a_bit_an_element(n):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.9
    frame = framed(mask)
    assert frame.numel() == 16 + (n + 7) // 8 and complete(frame[:16])
    out = torch.empty(n, dtype=torch.bool)
    assert decode_bits_frame(frame, out) is out and torch.equal(out, mask)


def test_bytes_other_than_0_and_1_make_the_frame_incomplete_and_its_decode_refuse():
    raw = torch.tensor([0, 1, 2, 1, 255, 0, 1, 1, 0], dtype=torch.uint8)
    frame = framed(raw.view(torch.bool))
    assert not complete(frame[:16])
    with pytest.raises(CorruptEncodedError, match="a byte of 255"):
        decode_bits_frame(frame, torch.empty(9, dtype=torch.uint8))


def test_a_frame_of_another_kind_or_size_is_refused():
    frame = framed(torch.ones(16, dtype=torch.bool))
    with pytest.raises(CorruptEncodedError, match="a bit frame of 17 elements"):
        decode_bits_frame(frame, torch.empty(17, dtype=torch.bool))
    words = torch.zeros(4096, dtype=torch.int16)  # an ancf_exp frame: its own magic
    ancf = torch.empty(frame_nbytes(words.numel()), dtype=torch.uint8)
    encode_frame(words, ancf)
    assert complete(ancf[:16])
    with pytest.raises(CorruptEncodedError, match="bad magic"):
        decode_bits_frame(ancf[:bits_frame_nbytes(64)].clone(), torch.empty(64, dtype=torch.bool))
    with pytest.raises(ValueError, match="contiguous bytes"):
        encode_bits_frame(torch.ones(8, dtype=torch.int16), torch.empty(17, dtype=torch.uint8))
