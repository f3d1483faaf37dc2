"""``zstd``: zstandard at level 1 on byte planes.

The elements' bytes are split into planes (byte 0 of every element, then byte 1, ...): an
activation's high bytes (sign and exponent) repeat a few values and compress well, its low
mantissa bytes are close to random and cost zstd little to pass through, so each plane is
compressed on its own rather than the interleaved bytes. zstandard runs on the host: a CUDA
tensor's planes are copied there and its buffers copied back, which makes it a codec for host
tensors (``auto`` weighs it for those only; on the GPU the frame codecs do this work) that still
encodes and decodes any tensor, on any device, to the same bytes.
"""
from __future__ import annotations

import torch
import zstandard

from ..container import CorruptEncodedError, Encoded, require
from .base import Buffers, Meta, as_bytes

LEVEL = 1  # the fastest level that still finds the repeated exponent bytes


def _planes(t: torch.Tensor) -> torch.Tensor:
    """(element size, numel) uint8: row i holds byte i of every element."""
    return as_bytes(t).view(-1, t.element_size()).t().contiguous()


def _compressed(t: torch.Tensor) -> list[bytes]:
    compressor = zstandard.ZstdCompressor(level=LEVEL)
    return [compressor.compress(plane.numpy().tobytes()) for plane in _planes(t).cpu()]


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    return {}, {f"plane{i}": torch.frombuffer(bytearray(data), dtype=torch.uint8).to(t.device)
                for i, data in enumerate(_compressed(t))}


def compressed_nbytes(t: torch.Tensor) -> int:
    """The bytes ``encode`` would store for ``t`` (``auto`` weighs it on a sample)."""
    return sum(map(len, _compressed(t)))


def decode(e: Encoded) -> torch.Tensor:
    n, width = e.numel, e.dtype.itemsize
    device = e.buffer("plane0").device
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
    flat = planes.t().contiguous().reshape(-1).to(device)
    return flat.view(e.dtype).reshape(e.shape) if n else torch.empty(e.shape, dtype=e.dtype, device=device)
