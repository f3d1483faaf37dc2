"""``zero`` (codec d): a 1-bit bitmap of "bit pattern is not all-zero" (kernels.bitpack) plus
the non-zero elements compacted with the scan (kernels.scan); -0.0 is non-zero."""
from __future__ import annotations

import torch

from ..bitpack import pack_bits, unpack_bits
from ..bits import INT_VIEW
from ..container import Encoded, require
from ..scan import compact
from .base import Buffers, Meta, as_bytes, native, read


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    v = native(t)
    nz = v != 0
    (vals,) = compact(nz, v)
    return {"nonzeros": int(vals.numel())}, {"bitmap": pack_bits(nz, 1), "values": as_bytes(vals)}


def decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    nnz = e.meta_int("nonzeros", 0, n)
    itype = INT_VIEW[e.dtype.itemsize]
    nz = unpack_bits(e.buffer("bitmap"), 1, n).to(torch.bool)
    vals = read(e.buffer("values"), itype, nnz, "zero: values")
    require(int(nz.sum()) == nnz, "zero: bitmap population does not match the value count")
    out = torch.zeros(n, dtype=itype, device=nz.device)
    out[nz] = vals
    return out.view(e.dtype).reshape(e.shape)

