"""Inclusive associative scan (prefix sum) and stream compaction built on it.

``associative_scan`` returns what ``torch.cumsum`` returns (same dtype
promotion: integer and bool inputs give int64, or the ``dtype`` asked for, as
torch.cumsum's ``dtype``; integers bit-identical), forward or reversed along a dim. On CUDA with
Triton it runs ``kernels.gpu.scan`` (one pass with decoupled look-back; three for 64-bit inputs); elsewhere it is
``torch.cumsum``.

Float summation order and the error bound we test: on the CPU, left to right
(torch.cumsum). On the GPU each block (16384 float32 elements in one pass, 4096 in
three) is summed as a tree (Triton's in-block scan); the blocks before it add up, in
one pass, from the nearest block back until one whose inclusive prefix is
published, in three, left to right; the block's offset is added last. Either
way each output is a sum of the same terms in some order, so it obeys the
order-independent bound ``|scan[i] - exact[i]| <= (i) * u * sum_{j<=i} |x[j]|``
with ``u`` the unit roundoff of the dtype; tests/kernels/test_kernels_scan.py
(CPU) and tests/kernels/test_kernels_gpu.py check exactly this bound against a
float64 reference.
"""
from __future__ import annotations

import torch

from .gpu import use_triton


def associative_scan(x: torch.Tensor, dim: int = -1, reverse: bool = False,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive prefix sum of ``x`` along ``dim`` (suffix sum when ``reverse``).

    ``dtype`` as in torch.cumsum: the input is taken as that dtype and summed in it
    (``torch.int32`` halves the output of an integer scan; its sums wrap at 32 bits).
    """
    if x.numel() == 0 or not use_triton(x) or (dtype is not None and dtype not in (torch.int32, torch.int64)):
        if reverse:
            return torch.cumsum(x.flip(dim), dim=dim, dtype=dtype).flip(dim)
        return torch.cumsum(x, dim=dim, dtype=dtype)
    from .gpu.scan import scan_lastdim

    d = dim % x.dim() if x.dim() else 0
    moved = x.movedim(d, -1) if x.dim() else x.reshape(1)
    if reverse:
        moved = moved.flip(-1)
    if dtype is not None and moved.dtype.is_floating_point:
        moved = moved.to(dtype)  # torch.cumsum truncates floats to the integer dtype first
    out = scan_lastdim(moved.contiguous(), dtype)
    if reverse:
        out = out.flip(-1)
    return out.movedim(-1, d).contiguous() if x.dim() else out.reshape(())


def compact(mask: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    """``[v[mask] for v in values]`` for 1-D tensors, computed as one scan + scatters.

    The destination of each kept element is its exclusive prefix count; the
    number kept is the last prefix, read on the host: this ``.item()`` is where
    the host waits for the device during encoding (the output size must be known
    before the buffer that receives it can be allocated).
    """
    mask = mask.reshape(-1)
    if mask.numel() == 0 or not bool(mask.any()):
        return [v.reshape(-1)[:0] for v in values]
    pos = associative_scan(mask.to(torch.int32))
    count = int(pos[-1].item())
    dest = torch.where(mask, pos - 1, torch.full_like(pos, count))
    outs = []
    for v in values:
        out = torch.empty(count + 1, dtype=v.dtype, device=v.device)
        out.scatter_(0, dest, v.reshape(-1))
        outs.append(out[:count])
    return outs
