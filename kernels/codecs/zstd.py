"""``zstd``: zstandard at level 1 on byte planes, for tensors on the host.

The elements' bytes are split into planes (byte 0 of every element, then byte 1, ...): an
activation's high bytes (sign and exponent) repeat a few values and compress well, its low
mantissa bytes are close to random and cost zstd little to pass through, so each plane is
compressed on its own rather than the interleaved bytes. Host only: a CUDA tensor would have to
be copied to the host first, which is what offloading it already does; on the GPU the frame
codecs (``ancf_exp``) do this work.
"""
from __future__ import annotations

import torch
import zstandard

from ..container import CorruptEncodedError, Encoded, require
from .base import Buffers, CodecNotApplicable, Meta, as_bytes

LEVEL = 1  # the fastest level that still finds the repeated exponent bytes


def _planes(t: torch.Tensor) -> torch.Tensor:
    """(element size, numel) uint8: row i holds byte i of every element."""
    return as_bytes(t).view(-1, t.element_size()).t().contiguous()


def _compressed(t: torch.Tensor) -> list[bytes]:
    compressor = zstandard.ZstdCompressor(level=LEVEL)
    return [compressor.compress(plane.numpy().tobytes()) for plane in _planes(t)]


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    if t.device.type != "cpu":
        raise CodecNotApplicable(f"zstd encodes tensors on the host, not on {t.device.type}")
    return {}, {f"plane{i}": torch.frombuffer(bytearray(data), dtype=torch.uint8)
                for i, data in enumerate(_compressed(t))}


def compressed_nbytes(t: torch.Tensor) -> int:
    """The bytes ``encode`` would store for a host tensor ``t`` (``auto`` weighs it on a sample)."""
    return sum(map(len, _compressed(t)))


def decode(e: Encoded) -> torch.Tensor:
    n, width = e.numel, e.dtype.itemsize
    decompressor = zstandard.ZstdDecompressor()
    planes = torch.empty((width, n), dtype=torch.uint8)
    for i in range(width):
        data = e.buffer(f"plane{i}")
        try:
            # bounded: a frame that claims or yields more than one plane's bytes is corrupt data,
            # not a reason to allocate what it asks
            out = decompressor.decompress(data.cpu().numpy().tobytes(), max_output_size=n)
        except zstandard.ZstdError as err:
            raise CorruptEncodedError(f"zstd: plane {i}: {err}") from None
        require(len(out) == n, f"zstd: plane {i} holds {len(out)} bytes, expected {n}")
        if n:
            planes[i] = torch.frombuffer(bytearray(out), dtype=torch.uint8)
    flat = planes.t().contiguous().reshape(-1)
    return flat.view(e.dtype).reshape(e.shape) if n else torch.empty(e.shape, dtype=e.dtype)
