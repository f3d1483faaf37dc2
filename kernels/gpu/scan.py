"""Triton prefix sum along the last dim of a contiguous tensor.

Three launches with a fixed summation order: (1) each program sums one BLOCK of
a row; (2) the block totals of each row are scanned (torch.cumsum: rows x
blocks is small); (3) each program scans its BLOCK in registers (``tl.cumsum``,
a tree) and adds its block's offset. The input is read twice and the output
written once, so the ceiling is below a device copy's rate (bench/codec.py
measures the fraction; a single-pass decoupled look-back variant measured
slower on the H100 in this Triton version and was dropped). Integer and bool
inputs accumulate and return int64, as torch.cumsum does; float16/bfloat16
accumulate in float32 and round each output once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _block_sums(x_ptr, sums_ptr, L, nb, BLOCK: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * L + offs, mask=offs < L, other=0).to(ACC)
    tl.store(sums_ptr + row * nb + blk, tl.sum(x, axis=0))


@triton.jit
def _block_scan(x_ptr, y_ptr, offs_ptr, L, nb, BLOCK: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    base = row.to(tl.int64) * L
    x = tl.load(x_ptr + base + offs, mask=offs < L, other=0).to(ACC)
    y = tl.cumsum(x, axis=0) + tl.load(offs_ptr + row * nb + blk)
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=offs < L)


def scan_lastdim(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum along the last dim of contiguous ``x`` (dtype as torch.cumsum)."""
    out_dtype = torch.int64 if (x.dtype == torch.bool or not x.dtype.is_floating_point) else x.dtype
    acc_t = {torch.int64: torch.int64, torch.float64: torch.float64}.get(out_dtype, torch.float32)
    acc = {torch.int64: tl.int64, torch.float64: tl.float64, torch.float32: tl.float32}[acc_t]
    src = x.view(torch.uint8) if x.dtype == torch.bool else x
    L = x.shape[-1]
    rows = x.numel() // L if L else 0
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return y
    nb = triton.cdiv(L, BLOCK)
    if nb > 65535:  # grid dim 1 limit: rows longer than 268 M elements stay on torch
        return torch.cumsum(x, dim=-1)
    sums = torch.empty((rows, nb), dtype=acc_t, device=x.device)
    grid = (rows, nb)
    _block_sums[grid](src, sums, L, nb, BLOCK=BLOCK, ACC=acc)
    offsets = (torch.cumsum(sums, dim=1) - sums).contiguous()
    _block_scan[grid](src, y, offsets, L, nb, BLOCK=BLOCK, ACC=acc)
    return y
