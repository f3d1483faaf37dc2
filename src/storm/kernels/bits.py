"""Bit-level views of tensors: raw bit patterns, and the (symbol, raw) field split.

Codecs never do float arithmetic on values: they work on bit patterns, so NaN
payloads, -0.0, infinities and subnormals survive unchanged.

Field split used by the exponent codecs (b, c), chosen so that the part with
low entropy goes to the symbol and the nearly random part is stored raw:

========  =============================  ==============================
dtype     symbol (<= 8 bits)             raw bits
========  =============================  ==============================
bfloat16  high byte: sign + 7 exp bits   low byte: exp LSB + 7 mantissa
float16   exponent (5 bits)              sign + mantissa (11 bits)
float32   exponent (8 bits)              sign + mantissa (24 bits)
integers  most significant byte          the other bytes
========  =============================  ==============================

The bf16 split keeps both streams byte-aligned (the GPU kernels then move whole
bytes); on the real MiniLM bf16 sample it gives up little against coding the
full (sign, 8-bit exponent): see docs/results.md for the measured ratios.
"""
from __future__ import annotations

import torch

# the integer dtype of each element width: bit patterns viewed without widening
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical elements of ``t`` (any strides) as a flat uint8 tensor in C order."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def bit_keys(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of every element as a non-negative int64 (int64 dtypes: the raw int64)."""
    w = t.element_size()
    v = flat_bytes(t).view(INT_VIEW[w])
    if w == 8:
        return v
    return v.to(torch.int64) & ((1 << (8 * w)) - 1)


def keys_to_tensor(keys: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``bit_keys``."""
    w = dtype.itemsize
    if w == 8:
        v = keys
    elif w == 1:
        v = keys.to(torch.uint8)
    else:
        # wrap into the signed range of the view type before narrowing
        half = 1 << (8 * w - 1)
        v = (((keys + half) & ((1 << (8 * w)) - 1)) - half).to(INT_VIEW[w])
    return v.view(dtype).reshape(shape)


def raw_bits(dtype: torch.dtype) -> int:
    """The width in bits of ``split_fields``' raw part for ``dtype``."""
    if dtype in (torch.float16, torch.float32):
        return 11 if dtype == torch.float16 else 24
    return 8 * (dtype.itemsize - 1)


def split_fields(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Return (symbols uint8 [n], raw int64 [n] or uint8 [n, k], raw bit width)."""
    if t.dtype in (torch.float16, torch.float32):
        k = bit_keys(t)
        mbits = 10 if t.dtype == torch.float16 else 23
        ebits = 5 if t.dtype == torch.float16 else 8
        sym = ((k >> mbits) & ((1 << ebits) - 1)).to(torch.uint8)
        raw = (k & ((1 << mbits) - 1)) | ((k >> (mbits + ebits)) << mbits)
        return sym, raw, raw_bits(t.dtype)
    b = flat_bytes(t)
    w = t.element_size()
    rows = b.view(-1, w)
    return rows[:, w - 1].contiguous(), rows[:, : w - 1].contiguous(), raw_bits(t.dtype)


def symbol_field(t: torch.Tensor) -> torch.Tensor:
    """The symbol part of ``split_fields`` alone (uint8 [n])."""
    if t.dtype in (torch.float16, torch.float32):
        mbits, ebits = (10, 5) if t.dtype == torch.float16 else (23, 8)
        v = flat_bytes(t).view(torch.int16 if t.dtype == torch.float16 else torch.int32)
        return ((v >> mbits) & ((1 << ebits) - 1)).to(torch.uint8)
    w = t.element_size()
    return flat_bytes(t).view(-1, w)[:, w - 1]


def merge_fields(sym: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``split_fields``."""
    if dtype in (torch.float16, torch.float32):
        mbits = 10 if dtype == torch.float16 else 23
        ebits = 5 if dtype == torch.float16 else 8
        raw = raw.to(torch.int64)
        k = (raw & ((1 << mbits) - 1)) | (sym.to(torch.int64) << mbits) | ((raw >> mbits) << (mbits + ebits))
        return keys_to_tensor(k, dtype, shape)
    w = dtype.itemsize
    rows = torch.cat([raw.reshape(-1, w - 1), sym.reshape(-1, 1)], dim=1) if w > 1 else sym.reshape(-1, 1)
    return rows.reshape(-1).view(dtype).reshape(shape)


def raw_is_bytes(dtype: torch.dtype) -> bool:
    """True where ``split_fields`` returns the raw part as whole bytes (no bit packing needed)."""
    return dtype not in (torch.float16, torch.float32)


def verify_lossless(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff a and b have the same dtype, shape and bit pattern in every element.

    Compares raw bits, so NaN == NaN with the same payload, and -0.0 != +0.0.
    """
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    return bool(torch.equal(flat_bytes(a), flat_bytes(b)))
