"""Every codec round-trips every bit pattern of every dtype, in memory and through bytes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_strategies import DTYPES, SPECIAL_BITS, bits_equal, from_bits, tensors
from storm.kernels import CODECS, CodecNotApplicable, Encoded, decode, encode, verify_lossless

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def roundtrip(t: torch.Tensor, codec: str) -> Encoded | None:
    try:
        enc = encode(t, codec)
    except CodecNotApplicable:
        return None
    assert bits_equal(decode(enc), t), codec
    blob = enc.to_bytes()
    assert len(blob) == enc.nbytes
    assert bits_equal(decode(Encoded.from_bytes(blob)), t), codec
    return enc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", list(CODECS) + ["auto"])
@SETTINGS
@given(data=st.data())
def test_roundtrip_property(dtype: torch.dtype, codec: str, data) -> None:
    roundtrip(data.draw(tensors(dtype)), codec)


@pytest.mark.parametrize("dtype", list(SPECIAL_BITS), ids=str)
@pytest.mark.parametrize("codec", list(CODECS) + ["auto"])
def test_special_values(dtype: torch.dtype, codec: str) -> None:
    t = from_bits(SPECIAL_BITS[dtype] * 50, dtype)
    roundtrip(t, codec)
    roundtrip(t[:1], codec)
    roundtrip(t[:0], codec)


@pytest.mark.parametrize("codec", list(CODECS) + ["auto"])
def test_all_distinct_16bit_patterns(codec: str) -> None:
    """Every one of the 65536 bf16 and fp16 bit patterns, once each."""
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        roundtrip(t[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(1))], codec)


@pytest.mark.parametrize("codec", list(CODECS) + ["auto"])
def test_non_contiguous_and_shapes(codec: str) -> None:
    x = torch.randn(6, 10, 12).bfloat16()
    for t in (x.transpose(0, 2), x[:, ::3, 1:], x.expand(2, 6, 10, 12), x[0, 0, 0]):
        enc = roundtrip(t, codec)
        if enc is not None:
            out = decode(enc)
            assert out.is_contiguous() and out.shape == t.shape


def test_decode_into_out() -> None:
    t = torch.randn(100, 7)
    out = torch.empty(100, 7)
    assert decode(encode(t, "huff_exp"), out=out) is out
    assert verify_lossless(out, t)
    with pytest.raises(ValueError):
        decode(encode(t, "huff_exp"), out=torch.empty(7, 100))


def test_verify_lossless_compares_bits() -> None:
    a = torch.tensor([0.0, float("nan")])
    assert verify_lossless(a, a.clone())
    assert not verify_lossless(a, torch.tensor([-0.0, float("nan")]))
    nan2 = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not verify_lossless(nan2[:1], nan2[1:])
    assert not verify_lossless(a, a.double())
    assert not verify_lossless(a, a.reshape(2, 1))


def test_auto_never_expands_and_prefers_raw_when_incompressible() -> None:
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32)
    enc = encode(noise, "auto")
    assert enc.codec == "raw" and enc.payload_nbytes <= enc.raw_nbytes
    relu = torch.relu(torch.randn(1 << 16, generator=g)).bfloat16()
    # on the host zstd is weighed too: it or a codec of the exponents, whichever is smaller
    enc = encode(relu, "auto")
    assert enc.codec in ("zero", "huff_exp", "zstd") and enc.ratio > 1.5
    assert enc.nbytes <= min(encode(relu, c).nbytes for c in ("zero", "huff_exp", "zstd"))
    mask = torch.rand(1 << 16, generator=g) > 0.1
    enc = encode(mask, "auto")
    assert enc.codec == "pack" and enc.ratio > 7
    tern = torch.randint(-1, 2, (1 << 16,), generator=g, dtype=torch.int8)
    # three equiprobable symbols: Huffman's estimate (1.67 bits) beats 2-bit packing's (2 bits); on the
    # host zstd is encoded beside the pick and kept where smaller
    enc = encode(tern, "auto")
    assert enc.codec in ("huff_exp", "zstd") and enc.nbytes <= encode(tern, "huff_exp").nbytes
    enc = encode(tern, "pack")
    assert enc.meta["width"] == 2 and enc.ratio > 3.9


def test_auto_speed_floor_excludes_slow_codecs() -> None:
    from storm.kernels.registry import ENCODE_GBPS

    t = torch.randn(1 << 15, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert encode(t, "auto").codec == "huff_exp"
    between = (ENCODE_GBPS["huff_exp"] + ENCODE_GBPS["ancf_exp"]) / 2  # huff_exp is the slower of the two
    assert encode(t, "auto", min_gbps=between).codec == "ancf_exp"
    assert encode(t, "auto", min_gbps=5000).codec == "raw"


def test_unknown_codec_and_dtype() -> None:
    with pytest.raises(ValueError):
        encode(torch.zeros(3), "lz77")
    with pytest.raises(ValueError):
        encode(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(CodecNotApplicable):
        encode(torch.arange(10), "pack")
