"""Fixed-width bit packing, LSB first: value i occupies bits [i*w, (i+1)*w) of the stream.

Widths of 1 to 8 bits pack 8 values into one 64-bit word and keep its first w
bytes (8 values x w bits = w bytes exactly). Wider fields (the 11-bit fp16 and
24-bit fp32 raw fields) are stored as byte planes of their whole low bytes
(plane k = byte k of every value) followed by the packed remaining bits, so
every width is a byte shuffle plus at most one small pack.

Backends, chosen by ``backend_for`` unless named:
* ``numpy``: 1-bit packing on the CPU through ``np.packbits`` (one C pass);
* ``torch``: the vectorised group-of-8 form above, on any device;
* ``triton``: a fused kernel for 1- and 2-bit packing of CUDA tensors
  (kernels.gpu.bitpack), one pass over the input.
"""
from __future__ import annotations

import numpy as np
import torch

from .container import require
from .gpu import use_triton


def backend_for(t: torch.Tensor, width: int) -> str:
    if t.is_cuda:
        return "triton" if width in (1, 2) and use_triton(t) else "torch"
    return "numpy" if width == 1 else "torch"


def packed_nbytes(n: int, width: int) -> int:
    return (n * width + 7) // 8


def _pack_small(v: torch.Tensor, w: int) -> torch.Tensor:
    n = v.numel()
    g = (n + 7) // 8
    vals = torch.zeros(g * 8, dtype=torch.int64, device=v.device)
    vals[:n] = v.reshape(-1).to(torch.int64) & ((1 << w) - 1)
    shifts = torch.arange(8, device=v.device, dtype=torch.int64) * w
    words = (vals.view(g, 8) << shifts).sum(dim=1)
    return words.view(torch.uint8).view(g, 8)[:, :w].reshape(-1)[: packed_nbytes(n, w)]


def _unpack_small(buf: torch.Tensor, w: int, n: int) -> torch.Tensor:
    g = (n + 7) // 8
    full = torch.zeros(g * 8, dtype=torch.uint8, device=buf.device)
    padded = torch.zeros(g * w, dtype=torch.uint8, device=buf.device)
    padded[: buf.numel()] = buf
    full.view(g, 8)[:, :w] = padded.view(g, w)
    shifts = torch.arange(8, device=buf.device, dtype=torch.int64) * w
    vals = (full.view(torch.int64).view(g, 1) >> shifts) & ((1 << w) - 1)
    return vals.reshape(-1)[:n]


def pack_bits(v: torch.Tensor, width: int, backend: str | None = None) -> torch.Tensor:
    """Pack the low ``width`` bits (1..32) of each element of integer tensor ``v``."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be 1..32, got {width}")
    v = v.reshape(-1)
    backend = backend or backend_for(v, width)
    if backend == "numpy" and width == 1:
        return torch.from_numpy(np.packbits(v.numpy().astype(np.uint8) & 1, bitorder="little"))
    if backend == "triton" and width in (1, 2):
        from .gpu.bitpack import pack_small_triton
        return pack_small_triton(v, width)
    q, r = divmod(width, 8)
    parts = []
    if q:  # byte planes: plane k holds byte k of every value (contiguous stores on a GPU)
        parts.append(v.to(torch.int64).view(torch.uint8).view(-1, 8)[:, :q].t().reshape(-1))
    if r:
        parts.append(_pack_small(v.to(torch.int64) >> (8 * q), r))
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def unpack_bits(buf: torch.Tensor, width: int, n: int, backend: str | None = None) -> torch.Tensor:
    """Inverse of ``pack_bits``: int64 tensor of ``n`` values."""
    require(buf.numel() == (n * (width // 8)) + packed_nbytes(n, width % 8),
            f"packed {width}-bit stream of {n} values has {buf.numel()} bytes")
    backend = backend or backend_for(buf, width)
    if backend == "numpy" and width == 1:
        bits = np.unpackbits(buf.numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits.astype(np.int64))
    if backend == "triton" and width in (1, 2):
        from .gpu.bitpack import unpack_small_triton
        return unpack_small_triton(buf, width, n)
    q, r = divmod(width, 8)
    out = torch.zeros(n, dtype=torch.int64, device=buf.device)
    if q:
        low = torch.zeros(n, 8, dtype=torch.uint8, device=buf.device)
        low[:, :q] = buf[: n * q].view(q, n).t()
        out |= low.view(torch.int64).view(n)
    if r:
        out |= _unpack_small(buf[n * q:], r, n) << (8 * q)
    return out
