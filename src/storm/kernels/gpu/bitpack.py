"""Triton kernels of kernels.bitpack: 1- and 2-bit packing of CUDA tensors in one pass."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .launch import Launcher


@Launcher
@triton.jit
def _pack_small(v_ptr, out_ptr, n, nbytes, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    per: tl.constexpr = 8 // WIDTH
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, per)
    i = j[:, None] * per + k[None, :]
    v = tl.load(v_ptr + i, mask=i < n, other=0).to(tl.int32) & ((1 << WIDTH) - 1)
    byte = tl.sum(v << (k[None, :] * WIDTH), axis=1)
    tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < nbytes)


@Launcher
@triton.jit
def _unpack_small(buf_ptr, out_ptr, n, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    per: tl.constexpr = 8 // WIDTH
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(buf_ptr + i // per, mask=i < n, other=0).to(tl.int32)
    v = (byte >> ((i % per) * WIDTH).to(tl.int32)) & ((1 << WIDTH) - 1)
    tl.store(out_ptr + i, v.to(tl.int64), mask=i < n)


def pack_small_triton(v: torch.Tensor, width: int) -> torch.Tensor:
    v = v.reshape(-1)
    if v.dtype == torch.bool:
        v = v.view(torch.uint8)
    n = v.numel()
    nbytes = (n * width + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
    if n:
        _pack_small[(cdiv(nbytes, 1024),)](v, out, n, nbytes, WIDTH=width, BLOCK=1024)
    return out


def unpack_small_triton(buf: torch.Tensor, width: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.int64, device=buf.device)
    if n:
        _unpack_small[(cdiv(n, 4096),)](buf, out, n, WIDTH=width, BLOCK=4096)
    return out
