"""Frames (storm.kernels.frame): codec b at a size fixed before encoding, as CUDA tensors are
copied to the store. CPU reference here; the Triton path against it in test_kernels_gpu.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_strategies import SPECIAL_BITS, bits_equal, from_bits, tensors
from storm.kernels import CorruptEncodedError
from storm.kernels.frame import complete, decode_frame, encode_frame, escape_slots, frame_nbytes

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "activations" / "minilm_saved.pt"
WORDS = [torch.bfloat16, torch.float16, torch.int16]


def framed(t: torch.Tensor) -> torch.Tensor:
    out = torch.full((frame_nbytes(t.numel()),), 0xAB, dtype=torch.uint8)  # no byte left unwritten by luck
    encode_frame(t, out)
    return out


def roundtrip(t: torch.Tensor) -> None:
    f = framed(t)
    words = t.contiguous().reshape(-1).view(torch.int16)
    if complete(f):
        assert bits_equal(decode_frame(f, t.numel()), words)
    else:
        with pytest.raises(CorruptEncodedError, match="incomplete frame"):
            decode_frame(f, t.numel())


@pytest.mark.parametrize("dtype", WORDS, ids=str)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_bit_pattern_roundtrips_or_reports_itself_incomplete(dtype, data) -> None:
    roundtrip(data.draw(tensors(dtype, max_len=3000)))


def test_special_values_bit_exact() -> None:
    """NaN payloads, -0.0, +-inf, subnormals among normal values; odd lengths; one element; empty."""
    dtype = torch.bfloat16
    specials = from_bits(SPECIAL_BITS[dtype], dtype)
    normal = torch.randn(5001, generator=torch.Generator().manual_seed(1)).to(dtype)
    t = torch.cat([normal[:2500], specials, normal[2500:]])
    for x in (t, t[:1], t[:0], t[:7], t[1::3]):
        f = framed(x)
        assert complete(f)
        assert bits_equal(decode_frame(f, x.numel()).view(dtype), x.contiguous().reshape(-1))


def test_all_distinct_words_overflow_and_say_so() -> None:
    n = 1 << 16
    t = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern once
    f = framed(t)
    assert not complete(f)
    assert int(f[:4].view(torch.int32)[0]) == n - n * 15 // 256  # every word outside the top 15 high bytes
    with pytest.raises(CorruptEncodedError, match="incomplete frame"):
        decode_frame(f, n)


def test_size_is_fixed_by_the_length_alone() -> None:
    a, b = torch.zeros(10_000, dtype=torch.bfloat16), torch.randn(10_000).bfloat16()
    assert framed(a).numel() == framed(b).numel() == frame_nbytes(10_000)
    n = 1 << 20
    assert frame_nbytes(n) == 32 + n // 2 + n + 5 * escape_slots(n)


def test_real_bf16_activations_fit_and_shrink() -> None:
    """Every bf16 tensor of the real autocast step fits its escape slots; byte-weighted ratio."""
    saved = torch.load(FIXTURE, weights_only=True)["tensors"]
    bf16 = [t for k, t in saved.items() if k.startswith("bf16/") and t.dtype == torch.bfloat16]
    raw = stored = 0
    for t in bf16:
        f = framed(t)
        assert complete(f)
        assert bits_equal(decode_frame(f, t.numel()), t.reshape(-1).view(torch.int16))
        raw, stored = raw + 2 * t.numel(), stored + f.numel()
    print(f"frames, bf16 tensors of the bf16 autocast step: {raw / stored:.3f}x")
    assert raw / stored >= 1.25


def test_corrupted_frames_raise() -> None:
    t = torch.randn(4001, generator=torch.Generator().manual_seed(2)).bfloat16()
    t[::400] = 2.0 ** torch.arange(60, 71).bfloat16()  # exponents outside the dictionary: escapes
    good = framed(t)
    assert int(good[:4].view(torch.int32)[0]) > 0  # the cases below need escapes

    def broken(edit) -> torch.Tensor:
        f = good.clone()
        edit(f)
        return f

    pos = 32 + 2001 + 4001
    pos += -pos % 4
    cases = {
        "bad magic": broken(lambda f: f.__setitem__(4, 0)),
        "holds 4002 words": broken(lambda f: f[8:16].view(torch.int64).add_(1)),
        "incomplete frame": broken(lambda f: f[:4].view(torch.int32).fill_(escape_slots(4001) + 1)),
        "escape positions": broken(lambda f: f[pos:pos + 4].view(torch.int32).add_(1)),
        "escape codes": broken(lambda f: f[:4].view(torch.int32).sub_(1)),
    }
    for what, f in cases.items():
        with pytest.raises(CorruptEncodedError, match=what):
            decode_frame(f, 4001)
    with pytest.raises(CorruptEncodedError, match="bytes"):
        decode_frame(good[:-1], 4001)
    with pytest.raises(CorruptEncodedError, match="bytes"):
        decode_frame(good, 4000)


def test_only_16_bit_words() -> None:
    with pytest.raises(ValueError, match="16-bit"):
        encode_frame(torch.zeros(8), torch.empty(frame_nbytes(8), dtype=torch.uint8))
