"""Triton prefix sum along the last dim of a contiguous tensor.

One pass with decoupled look-back (Merrill and Garland, "Single-pass parallel prefix
scan with decoupled look-back", 2016) for 8/16/32-bit inputs: each program takes the
next block in launch order from a counter (so every block it waits on is running),
publishes the block's total as soon as it has it (before its own in-block scan: the
blocks after it look back at that word, so every cycle before it is published is a
cycle they may spin), scans its BLOCK in registers (``tl.cumsum``, a tree), then walks
back over the blocks before it, 32 at a time, adding published totals until it meets
a published inclusive prefix, and publishes its own. The input is read once, and the
output written once, as streams (evict-first loads, streaming stores: neither is read
again, so neither should take L2 from the flag words). A published word is the value and a
2-bit flag (1: total, 2: inclusive prefix) in one int64, so one load reads both: an
int64 sum sits above the flag (|prefix| < 2**61: inputs of 32 bits or less, fewer
than 2**29 elements a row), a float32 or int32 sum as its 32 bits. The input is read
once and the output written once.

Three launches for 64-bit inputs, and for rows the flag word cannot hold: (1) each
program sums one BLOCK of a row; (2) the block totals of each row are scanned
(torch.cumsum: rows x blocks is small); (3) each program scans its BLOCK and adds its
block's offset. The input is read twice.

Integer and bool inputs accumulate and return int64, as torch.cumsum does, unless an
``out_dtype`` of int32 is asked for (torch.cumsum's ``dtype=torch.int32``): then the
sums wrap at 32 bits, as torch's do, and the output is half as wide. float16/bfloat16
accumulate in float32 and round each output once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .launch import Launcher

BLOCK = 4096
ONE_PASS_BLOCK = 16384  # elements a program scans with 32-bit sums; half as many with 64-bit ones (same registers)
ONE_PASS_WARPS = 4
LOOKBACK = 32  # blocks read at once when looking back
ONE_PASS_MAX_ROW = 1 << 29  # |prefix| of 32-bit inputs stays below 2**61 (the flag takes 2 bits)


@triton.jit
def publish(flags_ptr, value, flag: tl.constexpr, WORD32: tl.constexpr):
    if WORD32:  # a float32 or int32 sum: its 32 bits
        word = (value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF) << 2
    else:
        word = value.to(tl.int64) << 2
    # relaxed, no fence: the word is all a reader needs, and a 64-bit store is seen whole or not at all
    tl.atomic_xchg(flags_ptr, word | flag, sem="relaxed")


@triton.jit
def look_back(flags, blk, ACC: tl.constexpr, WORD32: tl.constexpr, WINDOW: tl.constexpr):
    # the sum of the totals of blocks 0 .. blk-1 (blk > 0; each block publishes its total, then
    # its inclusive prefix, into flags[blk]): walks back from the nearest block until one whose
    # inclusive prefix is published, WINDOW blocks at once (one load each, in parallel): a block
    # walking back one word at a time waits a round trip per block in flight before it
    prefix = tl.zeros([], ACC)
    lane = tl.arange(0, WINDOW)
    t = blk - 1  # the nearest block not yet added
    while t >= 0:
        idx = t - lane
        inside = idx >= 0
        # volatile loads, past the SM's cache, so a spinning block sees the others' words; no
        # acquire: nothing but the word itself is read on its strength
        words = tl.load(flags + idx, mask=inside, other=0, volatile=True)
        state = tl.where(inside, words & 3, 2)  # before block 0: an inclusive prefix of 0
        stop = tl.min(tl.where(state == 2, lane, WINDOW), axis=0)  # the nearest inclusive prefix
        needed = lane <= stop
        if tl.sum((needed & (state == 0)).to(tl.int32), axis=0) == 0:  # all published: add them
            if WORD32:
                v = ((words >> 2) & 0xFFFFFFFF).to(tl.int32).to(ACC, bitcast=True)
            else:
                v = (words >> 2).to(ACC)
            prefix = prefix + tl.sum(tl.where(needed & inside, v, 0), axis=0)
            if stop < WINDOW:
                t = tl.full([], -1, t.dtype)
            else:
                t = t - WINDOW
    return prefix


@Launcher
@triton.jit
def _scan_one_pass(x_ptr, y_ptr, flags_ptr, counter_ptr, L, nb, BLOCK: tl.constexpr, ACC: tl.constexpr,
                   WORD32: tl.constexpr, WINDOW: tl.constexpr):
    vid = tl.atomic_add(counter_ptr, 1, sem="relaxed")  # blocks in the order programs started: predecessors are running
    row = (vid // nb).to(tl.int32)
    blk = (vid % nb).to(tl.int32)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    base = row.to(tl.int64) * L
    x = tl.load(x_ptr + base + offs, mask=offs < L, other=0, eviction_policy="evict_first").to(ACC)
    total = tl.sum(x, axis=0)
    flags = flags_ptr + row.to(tl.int64) * nb
    if blk == 0:
        publish(flags, total, 2, WORD32)
    else:
        publish(flags + blk, total, 1, WORD32)
    y = tl.cumsum(x, axis=0)
    prefix = tl.zeros([], ACC)
    if blk != 0:
        prefix = look_back(flags, blk, ACC, WORD32, WINDOW)
        publish(flags + blk, prefix + total, 2, WORD32)
    tl.store(y_ptr + base + offs, (y + prefix).to(y_ptr.dtype.element_ty), mask=offs < L, cache_modifier=".cs")


@Launcher
@triton.jit
def _block_sums(x_ptr, sums_ptr, L, nb, BLOCK: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * L + offs, mask=offs < L, other=0).to(ACC)
    tl.store(sums_ptr + row * nb + blk, tl.sum(x, axis=0))


@Launcher
@triton.jit
def _block_scan(x_ptr, y_ptr, offs_ptr, L, nb, BLOCK: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    base = row.to(tl.int64) * L
    x = tl.load(x_ptr + base + offs, mask=offs < L, other=0).to(ACC)
    y = tl.cumsum(x, axis=0) + tl.load(offs_ptr + row * nb + blk)
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=offs < L)


def scan_lastdim(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inclusive cumsum along the last dim of contiguous ``x``; the output dtype is torch.cumsum's,
    or ``out_dtype`` (int32 or int64 for integer and bool inputs)."""
    if out_dtype is None:
        out_dtype = torch.int64 if (x.dtype == torch.bool or not x.dtype.is_floating_point) else x.dtype
    acc_t = {torch.int64: torch.int64, torch.float64: torch.float64,
             torch.int32: torch.int32}.get(out_dtype, torch.float32)
    acc = {torch.int64: tl.int64, torch.float64: tl.float64, torch.float32: tl.float32, torch.int32: tl.int32}[acc_t]
    word32 = acc_t in (torch.float32, torch.int32)
    src = x.view(torch.uint8) if x.dtype == torch.bool else x
    L = x.shape[-1]
    rows = x.numel() // L if L else 0
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return y
    if x.element_size() <= 4 and (word32 or L < ONE_PASS_MAX_ROW):
        block = ONE_PASS_BLOCK if word32 else ONE_PASS_BLOCK // 2
        nb = cdiv(L, block)
        flags = torch.zeros(rows * nb + 1, dtype=torch.int64, device=x.device)  # and the counter, last: one memset
        _scan_one_pass[(rows * nb,)](src, y, flags, flags[rows * nb:], L, nb, BLOCK=block, ACC=acc,
                                     WORD32=word32, WINDOW=LOOKBACK, num_warps=ONE_PASS_WARPS)
        return y
    nb = cdiv(L, BLOCK)
    if nb > 65535:  # grid dim 1 limit: rows longer than 268 M elements stay on torch
        return torch.cumsum(x, dim=-1, dtype=out_dtype)
    sums = torch.empty((rows, nb), dtype=acc_t, device=x.device)
    grid = (rows, nb)
    _block_sums[grid](src, sums, L, nb, BLOCK=BLOCK, ACC=acc)
    offsets = (torch.cumsum(sums, dim=1) - sums).contiguous()
    _block_scan[grid](src, y, offsets, L, nb, BLOCK=BLOCK, ACC=acc)
    return y
