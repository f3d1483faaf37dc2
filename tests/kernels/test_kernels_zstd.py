"""``zstd`` (zstandard on byte planes, on the host) and ``auto`` weighing it for host tensors (issue 41, item 4)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard

from storm.kernels import CorruptEncodedError, Encoded, decode, encode
from storm.kernels.registry import AUTO_MIN_BYTES

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "activations" / "minilm_saved.pt"


def test_planes_compress_what_repeats_and_roundtrip_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g).bfloat16()
    enc = encode(t, "zstd")
    assert set(enc.buffers) == {"plane0", "plane1"}
    # the high byte (sign, exponent) repeats a few values; the low (mantissa) byte does not
    assert enc.buffers["plane1"].numel() < enc.buffers["plane0"].numel() / 2
    assert torch.equal(decode(enc).view(torch.int16), t.view(torch.int16))


def test_a_plane_that_inflates_past_its_tensor_is_corrupt_data_not_an_allocation() -> None:
    t = torch.zeros(1000, dtype=torch.float32)
    enc = encode(t, "zstd")
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 << 20))  # 256 MiB in a few KiB
    bad = Encoded("zstd", enc.dtype, enc.shape, enc.meta,
                  {**enc.buffers, "plane0": torch.frombuffer(bytearray(bomb), dtype=torch.uint8)})
    with pytest.raises(CorruptEncodedError, match="plane 0"):
        decode(bad)
    # the same without the content size in the frame header (a streaming writer's frame)
    stream = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * (256 << 20))
    bad = Encoded("zstd", enc.dtype, enc.shape, enc.meta,
                  {**enc.buffers, "plane0": torch.frombuffer(bytearray(stream), dtype=torch.uint8)})
    with pytest.raises(CorruptEncodedError, match="plane 0"):
        decode(bad)


def test_auto_is_never_larger_than_zstd_on_real_activations() -> None:
    """On held-out real activations (all-MiniLM-L6-v2's saved tensors), auto weighed without zstd
    came out below zstd alone; now every tensor auto codes is at most zstd's size, and so the step."""
    saved = torch.load(FIXTURE, weights_only=True)["tensors"]
    raw = auto = plain = 0
    for name, t in saved.items():
        a, z = encode(t, "auto").nbytes, encode(t, "zstd").nbytes
        if t.numel() * t.element_size() >= AUTO_MIN_BYTES:  # below, auto stores raw: headers outweigh savings
            assert a <= z, (name, a, z)
        raw, auto, plain = raw + t.numel() * t.element_size(), auto + a, plain + z
    assert raw / auto >= raw / plain
