"""``raw``: the bytes as they are."""
from __future__ import annotations

import torch

from ..bits import flat_bytes
from ..container import Encoded, require
from .base import Buffers, Meta


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    return {}, {"data": flat_bytes(t).clone()}


def decode(e: Encoded) -> torch.Tensor:
    data = e.buffer("data")
    require(data.numel() == e.raw_nbytes, f"raw: {data.numel()} bytes for {e.raw_nbytes}")
    return data.view(e.dtype).reshape(e.shape) if e.numel else torch.empty(e.shape, dtype=e.dtype, device=data.device)

