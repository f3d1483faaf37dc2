"""``pack`` (codec e): tensors with at most 4 distinct bit patterns (bool masks, ternary
{-1, 0, 1} tensors, 0/1 floats) as a table of the patterns and 1- or 2-bit codes
(kernels.bitpack, whose Triton kernels are kernels.gpu.bitpack)."""
from __future__ import annotations

import torch

from ..bitpack import pack_bits, unpack_bits
from ..bits import INT_VIEW
from ..container import Encoded, require
from .base import Buffers, CodecNotApplicable, Meta, as_bytes, native, read


def _distinct_upto4(v: torch.Tensor) -> torch.Tensor | None:
    """The sorted distinct values of v if there are at most 4, else None.

    One-byte tensors: a 256-bin histogram. Wider ones: the distinct values of a
    strided sample, confirmed on the whole tensor; a full sort only when the
    sample missed a value.
    """
    if v.element_size() == 1:
        hist = torch.bincount(v.view(torch.uint8).to(torch.int32), minlength=256)
        present = torch.nonzero(hist).reshape(-1)
        if present.numel() > 4:
            return None
        return present.to(torch.uint8).view(v.dtype).sort().values
    cand = torch.unique(v[:: max(1, v.numel() // 65536)])
    if cand.numel() <= 4:
        idx = torch.searchsorted(cand, v).clamp_(max=cand.numel() - 1)
        if bool((cand[idx] == v).all()):
            return cand
    table = torch.unique(v)
    return table if table.numel() <= 4 else None


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    v = native(t)
    table = _distinct_upto4(v) if v.numel() else v[:0]
    if table is None:
        raise CodecNotApplicable("pack: more than 4 distinct values")
    width = 1 if table.numel() <= 2 else 2
    codes = torch.searchsorted(table, v) if table.numel() > 1 else torch.zeros_like(v, dtype=torch.int64)
    meta = {"width": width, "table_len": int(table.numel())}
    return meta, {"table": as_bytes(table), "codes": pack_bits(codes, width)}


def decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    width = e.meta_int("width", 1, 2)
    tlen = e.meta_int("table_len", 0, 1 << width)
    require(n == 0 or tlen > 0, "pack: empty table for a non-empty tensor")
    table = read(e.buffer("table"), INT_VIEW[e.dtype.itemsize], tlen, "pack: table")
    codes = unpack_bits(e.buffer("codes"), width, n)
    require(n == 0 or int(codes.max()) < tlen, "pack: code beyond the table")
    out = table[codes] if n else table[:0]
    return out.view(e.dtype).reshape(e.shape)

