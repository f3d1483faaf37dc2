"""What every codec shares: the error for a tensor a codec cannot encode, the types of
its output, and reading and checking the buffers of an ``Encoded``."""
from __future__ import annotations

import torch

from ..bits import INT_VIEW, flat_bytes
from ..container import require

Meta = dict
Buffers = dict[str, torch.Tensor]


class CodecNotApplicable(ValueError):
    """This codec cannot encode this tensor (e.g. ``pack`` on more than 4 distinct values)."""


def pos_dtype(n: int) -> torch.dtype:
    """The dtype of escape positions in a tensor of ``n`` elements."""
    return torch.int32 if n < 2**31 else torch.int64


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 buffer."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def native(t: torch.Tensor) -> torch.Tensor:
    """The flat elements as signed integers of their own width (bool as uint8): the bit
    patterns, without widening to int64."""
    return flat_bytes(t).view(INT_VIEW[t.element_size()])


def read(buf: torch.Tensor, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    """``count`` elements of ``dtype`` from ``buf``, which must hold exactly that many."""
    size = dtype.itemsize
    require(buf.numel() == count * size, f"{what}: {buf.numel()} bytes, expected {count * size}")
    return buf.contiguous().view(dtype) if count else torch.empty(0, dtype=dtype, device=buf.device)


def check_positions(pos: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """Escape positions must be in range and strictly increasing (so none is patched twice
    while another escape is left unpatched)."""
    pos = pos.to(torch.int64)
    if pos.numel():
        require(bool(((pos >= 0) & (pos < n)).all()), f"{what}: escape position out of range")
        require(bool((pos[1:] > pos[:-1]).all()), f"{what}: escape positions not strictly increasing")
    return pos
