"""Truncated, corrupted or inconsistent encoded data raises CorruptEncodedError (a ValueError):
never a wrong tensor, never a crash."""
from __future__ import annotations

import random

import pytest
import torch

from kernels_strategies import bits_equal
from storm.kernels import CODECS, CorruptEncodedError, Encoded, decode, encode

CASES = {
    "raw": torch.randn(64, 3),
    "ancf": torch.randn(300).bfloat16().float(),
    "ancf_exp": torch.randn(301).bfloat16(),
    "huff_exp": torch.randn(1000).half(),
    "zero": torch.relu(torch.randn(333)),
    "pack": torch.rand(77) > 0.5,
    "zstd": torch.randn(500).bfloat16(),
}


def test_error_is_a_value_error() -> None:
    assert issubclass(CorruptEncodedError, ValueError)


@pytest.mark.parametrize("codec", list(CODECS))
def test_every_truncation_is_detected(codec: str) -> None:
    blob = encode(CASES[codec], codec).to_bytes()
    for n in list(range(0, 64)) + list(range(64, len(blob), max(1, len(blob) // 97))):
        with pytest.raises(CorruptEncodedError):
            Encoded.from_bytes(blob[:n])
    with pytest.raises(CorruptEncodedError, match="truncated or padded"):
        Encoded.from_bytes(blob + b"\0")


@pytest.mark.parametrize("codec", list(CODECS))
def test_flipped_bits_are_detected(codec: str) -> None:
    blob = encode(CASES[codec], codec).to_bytes()
    rng = random.Random(0)
    for i in rng.sample(range(len(blob)), min(200, len(blob))):
        bad = bytearray(blob)
        bad[i] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptEncodedError):
            decode(Encoded.from_bytes(bytes(bad)))


def test_messages_name_the_problem() -> None:
    blob = encode(CASES["raw"], "raw").to_bytes()
    with pytest.raises(CorruptEncodedError, match="magic"):
        Encoded.from_bytes(b"XXXX" + blob[4:])
    with pytest.raises(CorruptEncodedError, match="version"):
        Encoded.from_bytes(blob[:4] + b"\x63" + blob[5:])
    bad = bytearray(blob)
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptEncodedError, match="checksum"):
        Encoded.from_bytes(bytes(bad))


def _mutations(enc: Encoded):
    """Structurally inconsistent variants of enc (as a writer with a bug would produce them)."""
    for k, v in enc.meta.items():
        for bad in ([-1, 0, 1, 3, 2**40, "x", None] if isinstance(v, int) else [b"", b"\x0f" * 300, 7]):
            if bad != v:
                yield f"meta {k}={bad!r}", Encoded(enc.codec, enc.dtype, enc.shape, {**enc.meta, k: bad}, enc.buffers)
    for k, b in enc.buffers.items():
        variants = {"empty": b[:0], "short": b[:-1],
                    "long": torch.cat([b, b[:1] if b.numel() else torch.zeros(1, dtype=torch.uint8)])}
        for name, nb in variants.items():
            if nb.numel() != b.numel():
                yield f"buffer {k} {name}", Encoded(enc.codec, enc.dtype, enc.shape, enc.meta, {**enc.buffers, k: nb})
    yield "shape", Encoded(enc.codec, enc.dtype, (enc.numel + 8,), enc.meta, enc.buffers)
    other = torch.int64 if enc.dtype != torch.int64 else torch.int8
    yield "dtype", Encoded(enc.codec, other, enc.shape, enc.meta, enc.buffers)
    yield "codec", Encoded("nope", enc.dtype, enc.shape, enc.meta, enc.buffers)


@pytest.mark.parametrize("codec", list(CODECS))
def test_inconsistent_fields_are_detected(codec: str) -> None:
    t = CASES[codec]
    enc = encode(t, codec)
    for what, bad in _mutations(enc):
        try:
            out = decode(bad)
            # the only acceptable non-error outcome: the mutation did not change the meaning
            assert bits_equal(out, t), f"{codec}: {what} decoded to a wrong tensor"
        except CorruptEncodedError:
            pass
        # through bytes too: a valid checksum over inconsistent fields must still be caught
        try:
            out = decode(Encoded.from_bytes(bad.to_bytes()))
        except CorruptEncodedError:
            continue
        except (TypeError, KeyError) as e:  # the header itself could not be written
            pytest.fail(f"{codec}: {what}: {e!r}")
        assert bits_equal(out, t), f"{codec}: {what} decoded to a wrong tensor via bytes"


def test_huffman_stream_garbage_is_detected() -> None:
    t = torch.randn(5000).bfloat16()
    enc = encode(t, "huff_exp")
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        stream = enc.buffers["stream"].clone()
        i = int(torch.randint(0, stream.numel() - 8, (1,), generator=g))
        stream[i] ^= 0x5A
        bad = Encoded(enc.codec, enc.dtype, enc.shape, enc.meta, {**enc.buffers, "stream": stream})
        try:
            out = decode(bad)
        except CorruptEncodedError:
            continue
        # a flip inside one code can map to another code of the same length: the stream
        # stays well-formed; only the checksum (to_bytes/from_bytes) catches that
        assert out.shape == t.shape


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_huffman_lane_lengths_that_keep_the_total_are_detected(device: str, dtype: torch.dtype) -> None:
    """Lane lengths moved between lanes far apart (on the GPU, lanes of different programs,
    whose starts the decoder sums by look-back) keep the stream's length right: every lane must
    still be checked against where its codes end."""
    t = torch.randn(300_000).to(dtype).to(device)  # 1172 lanes
    enc = encode(t, "huff_exp")
    lengths = enc.buffers["lane_bits"].view(torch.int16)
    for i, j, d in ((3, 1100, 5), (0, 1171, 1), (200, 900, -3000), (10, 11, 40000)):
        bad_lengths = lengths.clone()
        bad_lengths[i] = (bad_lengths[i].to(torch.int32) + d).to(torch.int16)  # wraps: negative lengths too
        bad_lengths[j] = (bad_lengths[j].to(torch.int32) - d).to(torch.int16)
        bad = Encoded(enc.codec, enc.dtype, enc.shape, enc.meta,
                      {**enc.buffers, "lane_bits": bad_lengths.view(torch.uint8)})
        with pytest.raises(CorruptEncodedError):
            decode(bad)
    assert bits_equal(decode(enc), t)


@pytest.mark.parametrize("codec,key", [("ancf", "esc_pos"), ("ancf_exp", "esc_pos")])
def test_repeated_escape_position_is_detected(codec: str, key: str) -> None:
    """Counts still agree, but one escape would be left unpatched: must raise."""
    t = torch.randn(20000).bfloat16() * torch.tensor(1e30, dtype=torch.bfloat16) ** torch.randint(0, 2, (20000,))
    enc = encode(t, codec)
    pos = enc.buffers[key].view(torch.int32).clone()
    assert pos.numel() >= 2
    pos[1] = pos[0]
    bad = Encoded(enc.codec, enc.dtype, enc.shape, enc.meta, {**enc.buffers, key: pos.view(torch.uint8)})
    with pytest.raises(CorruptEncodedError):
        decode(bad)
