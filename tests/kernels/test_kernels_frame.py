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
from storm.kernels.frame import TILE, complete, decode_frame, encode_frame, escape_slots, frame_nbytes, layout

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
    for n in (0, 1, 2049, 1 << 20):
        assert frame_nbytes(n) == 32 + 8 * -(-n // TILE) + (n + 1) // 2 + n + escape_slots(n)


def test_escapes_take_slots_in_element_order() -> None:
    """An escape's slot is its rank among the escapes (no positions are stored), and each tile's
    end counts the escapes up to it, so a decoder finds any tile's first slot."""
    t = torch.full((3 * TILE + 5,), 1.0).bfloat16()
    at = [3, TILE - 1, TILE + 7, 3 * TILE + 4]  # tiles 0, 0, 1, 3
    t[at] = torch.tensor([2.0 ** 100, -(2.0 ** 90), 2.0 ** -120, 2.0 ** 80]).bfloat16()
    common = [4.0 ** -k for k in range(1, 15)]  # 14 high bytes besides 1.0's: the dictionary is full
    t[10:10 + 14 * 100] = torch.tensor(common).repeat(100).bfloat16()
    f, lay = framed(t), layout(t.numel())
    assert int(f[:4].view(torch.int32)[0]) == 4
    high = (t.view(torch.int16)[at].to(torch.int32) >> 8 & 0xFF).tolist()
    assert f[lay.sym:lay.sym + 4].tolist() == high
    assert (f[32:lay.codes].view(torch.int64) >> 2).tolist() == [2, 3, 3, 4]
    assert bits_equal(decode_frame(f, t.numel()), t.view(torch.int16))


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
    assert raw / stored >= 1.31


def test_corrupted_frames_raise() -> None:
    t = torch.randn(4001, generator=torch.Generator().manual_seed(2)).bfloat16()
    t[::400] = 2.0 ** torch.arange(60, 71).bfloat16()  # exponents outside the dictionary: escapes
    good = framed(t)
    assert int(good[:4].view(torch.int32)[0]) > 0  # the cases below need escapes

    def broken(edit) -> torch.Tensor:
        f = good.clone()
        edit(f)
        return f

    lay = layout(4001)
    cases = {
        "bad magic": broken(lambda f: f.__setitem__(4, 0)),
        "holds 4002 words": broken(lambda f: f[8:16].view(torch.int64).add_(1)),
        "incomplete frame": broken(lambda f: f[:4].view(torch.int32).fill_(escape_slots(4001) + 1)),
        "escape ends": broken(lambda f: f[32:40].view(torch.int64).add_(4)),
        "not a tile end": broken(lambda f: f[32:40].view(torch.int64).sub_(1)),
        "escape count": broken(lambda f: f[:4].view(torch.int32).sub_(1)),
        "escape codes": broken(lambda f: f.__setitem__(lay.codes, 0xFF)),
    }
    for what, f in cases.items():
        with pytest.raises(CorruptEncodedError, match=what):
            decode_frame(f, 4001)
    with pytest.raises(CorruptEncodedError, match="bytes"):
        decode_frame(good[:-1], 4001)
    with pytest.raises(CorruptEncodedError, match="bytes"):
        decode_frame(good, 4000)
    shifted = torch.empty(good.numel() + 1, dtype=torch.uint8)[1:]
    shifted.copy_(good)
    with pytest.raises(CorruptEncodedError, match="8-byte aligned"):
        decode_frame(shifted, 4001)
    with pytest.raises(CorruptEncodedError, match="8-byte aligned"):
        encode_frame(t, shifted)


def test_only_16_bit_words() -> None:
    with pytest.raises(ValueError, match="16-bit"):
        encode_frame(torch.zeros(8), torch.empty(frame_nbytes(8), dtype=torch.uint8))
