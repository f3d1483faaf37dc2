"""The (symbol, raw) field split as the exponent codecs (b: ``ancf_exp``, c: ``huff_exp``)
use it: the histogram of the symbol field over a strided sample, the same elements on
every device, and the raw field's storage (whole bytes as they are, narrower fields
bit-packed). kernels.gpu.fields does the split in registers for the dtypes in FUSED."""
from __future__ import annotations

import numpy as np
import torch

from ..bitpack import pack_bits, unpack_bits
from ..bits import raw_is_bytes, symbol_field
from ..container import require
from ..gpu import use_triton

# dtypes whose split the fused Triton kernels do in registers (kernels.gpu.fields)
FUSED = (torch.bfloat16, torch.int16, torch.float32)
_TABLE_SAMPLE = 1 << 20


def raw_field_encode(raw: torch.Tensor, rbits: int, dtype: torch.dtype) -> torch.Tensor:
    """The raw field's bytes: as they are where they are whole bytes, else bit-packed."""
    if raw_is_bytes(dtype):
        return raw.reshape(-1)
    return pack_bits(raw, rbits)


def raw_field_decode(buf: torch.Tensor, rbits: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Inverse of ``raw_field_encode`` for ``n`` values."""
    if raw_is_bytes(dtype):
        require(buf.numel() == n * (rbits // 8), f"raw field: {buf.numel()} bytes for {n} values")
        return buf
    return unpack_bits(buf, rbits, n)


def sample_symbol_hist(t: torch.Tensor) -> np.ndarray:
    """Histogram (int64[256]) of the symbol field over every ``stride``-th element, the same
    elements on every device (stride = numel // 2**20, at least 1)."""
    flat = t.contiguous().reshape(-1)
    if use_triton(flat) and t.dtype in FUSED:
        return _device_symbol_hist(flat).cpu().numpy().astype(np.int64)
    sym = symbol_field(flat[::sample_stride(flat)].contiguous())
    return torch.bincount(sym.to(torch.int32), minlength=256).cpu().numpy().astype(np.int64)


def sample_stride(t: torch.Tensor) -> int:
    return max(1, t.numel() // _TABLE_SAMPLE)


def _device_symbol_hist(flat: torch.Tensor) -> torch.Tensor:
    """``sample_symbol_hist`` of a flat CUDA bf16/int16/fp32 tensor, left on the device (int32)."""
    from ..gpu.fields import sample_histogram
    return sample_histogram(flat, sample_stride(flat))
