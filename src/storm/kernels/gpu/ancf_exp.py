"""Triton kernels of codec b (kernels.codecs.ancf_exp, the exponent dictionary) for bf16/int16
and fp32; their output is the torch path's, byte for byte.

Encode: kernels.gpu.fields.sample_histogram counts the symbols of a strided sample (the
host picks the 15-entry table from it); ``_dict4_encode`` then reads each
element once as groups of 4 (a (G, 4) tile: contiguous loads and stores per
thread), writes the 4-bit codes (two per byte) and the raw field (byte planes),
and gives each escape a slot from one global atomic counter. The host reads
that count (the one wait of encode: it sizes the escape output; the slots were
sized from the sample, and the pass re-runs if they were too few) and sorts the
escapes by position.
Decode: ``_dict4_decode`` (one pass, counting escape codes and codes beyond the
table) and ``_dict4_patch`` (the escapes, with a range check of each position);
the host waits once, to check those counts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .fields import split_word, word_view
from .launch import Launcher
from .tiles import WARPS, pack_codes, tile_groups, unpack_codes

GROUPS = 512           # groups of 4 elements per program: 2048 elements (measured best of 256..2048)
BLOCK = 4 * GROUPS


@Launcher
@triton.jit
def _dict4_encode(x_ptr, lut_ptr, codes_ptr, raw_ptr, nesc_ptr, pos_ptr, sym_ptr, cap, n, first_prog,
                  W: tl.constexpr, G: tl.constexpr, MASKED: tl.constexpr):
    # each program: G groups of 4 consecutive elements, held as a (G, 4) tile so that
    # loads and stores are contiguous per thread; MASKED only for the last, partial program.
    # Escapes (rare) take a slot from one global counter; the host sorts them afterwards.
    idx, bidx = tile_groups(first_prog + tl.program_id(0), G)
    if MASKED:
        m = idx < n
        x = tl.load(x_ptr + idx, mask=m, other=0).to(tl.int32)
    else:
        x = tl.load(x_ptr + idx).to(tl.int32)
    s, r = split_word(x, W)
    c = tl.load(lut_ptr + s)
    if MASKED:
        c = tl.where(m, c, 0)
    cb = pack_codes(c, G)
    miss = c == 15
    if MASKED:
        tl.store(codes_ptr + bidx, cb, mask=bidx * 2 < n)
        miss = miss & m
    else:
        tl.store(codes_ptr + bidx, cb)
    if W == 2:
        if MASKED:
            tl.store(raw_ptr + idx, r.to(tl.uint8), mask=m)
        else:
            tl.store(raw_ptr + idx, r.to(tl.uint8))
    else:  # three byte planes (kernels.bitpack layout for the 24-bit raw field)
        for k in tl.static_range(3):
            if MASKED:
                tl.store(raw_ptr + k * n + idx, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=m)
            else:
                tl.store(raw_ptr + k * n + idx, ((r >> (8 * k)) & 0xFF).to(tl.uint8))
    slot = tl.atomic_add(nesc_ptr + tl.zeros_like(idx), 1, mask=miss, sem="relaxed")
    keep = miss & (slot < cap)
    tl.store(pos_ptr + slot, idx.to(pos_ptr.dtype.element_ty), mask=keep)
    tl.store(sym_ptr + slot, s.to(tl.uint8), mask=keep)


@Launcher
@triton.jit
def _dict4_patch(out_ptr, codes_ptr, pos_ptr, sym_ptr, stat_ptr, count, n, W: tl.constexpr, BLOCK: tl.constexpr):
    # put the escaped symbols back. A position must be in range, on an escape code and above
    # the one before (with the escape count checked, that makes the list exactly the escapes);
    # nothing else is ever written; violations are counted in stat_ptr[2].
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < count
    p = tl.load(pos_ptr + j, mask=ok, other=0).to(tl.int64)
    prev = tl.load(pos_ptr + j - 1, mask=ok & (j > 0), other=-1).to(tl.int64)
    inside = ok & (p >= 0) & (p < n) & (p > prev)
    code = (tl.load(codes_ptr + p // 2, mask=inside, other=0).to(tl.int32) >> ((p % 2) * 4).to(tl.int32)) & 15
    inside = inside & (code == 15)
    s = tl.load(sym_ptr + j, mask=ok, other=0).to(tl.int32)
    w = tl.load(out_ptr + p, mask=inside, other=0).to(tl.int32)
    if W == 2:
        tl.store(out_ptr + p, ((w & 0xFF) | (s << 8)).to(tl.int16), mask=inside)
    else:
        tl.store(out_ptr + p, (w & ~(0xFF << 23)) | (s << 23), mask=inside)
    tl.atomic_add(stat_ptr + 2, tl.sum((ok & ~inside).to(tl.int32), axis=0), sem="relaxed")


@Launcher
@triton.jit
def _dict4_decode(codes_ptr, raw_ptr, tab_ptr, out_ptr, stat_ptr, n, tlen, first_prog,
                  W: tl.constexpr, G: tl.constexpr, MASKED: tl.constexpr, CHECK: tl.constexpr):
    # CHECK: count escape codes and codes beyond the table (stat_ptr[0:2]) for the host to check
    idx, bidx = tile_groups(first_prog + tl.program_id(0), G)
    if MASKED:
        m = idx < n
        cb = tl.load(codes_ptr + bidx, mask=bidx * 2 < n, other=0).to(tl.int32)
    else:
        cb = tl.load(codes_ptr + bidx).to(tl.int32)
    c = unpack_codes(cb, G)
    s = tl.load(tab_ptr + c).to(tl.int32)
    if W == 2:
        if MASKED:
            r = tl.load(raw_ptr + idx, mask=m, other=0).to(tl.int32)
            tl.store(out_ptr + idx, ((s << 8) | r).to(tl.int16), mask=m)
        else:
            r = tl.load(raw_ptr + idx).to(tl.int32)
            tl.store(out_ptr + idx, ((s << 8) | r).to(tl.int16))
    else:
        if MASKED:
            r = (tl.load(raw_ptr + idx, mask=m, other=0).to(tl.int32)
                 | (tl.load(raw_ptr + n + idx, mask=m, other=0).to(tl.int32) << 8)
                 | (tl.load(raw_ptr + 2 * n + idx, mask=m, other=0).to(tl.int32) << 16))
        else:
            r = (tl.load(raw_ptr + idx).to(tl.int32)
                 | (tl.load(raw_ptr + n + idx).to(tl.int32) << 8)
                 | (tl.load(raw_ptr + 2 * n + idx).to(tl.int32) << 16))
        w = (r & 0x7FFFFF) | (s << 23) | ((r >> 23) << 31)
        if MASKED:
            tl.store(out_ptr + idx, w, mask=m)
        else:
            tl.store(out_ptr + idx, w)
    if CHECK:
        esc = c == 15
        bad = (c != 15) & (c >= tlen)
        if MASKED:
            esc = esc & m
            bad = bad & m
        tl.atomic_add(stat_ptr, tl.sum(tl.sum(esc.to(tl.int32), axis=1), axis=0), sem="relaxed")
        tl.atomic_add(stat_ptr + 1, tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0), sem="relaxed")


def _launch(kernel, n: int, *args, **kw) -> None:
    """Full programs unmasked, then the partial last one (if any) masked."""
    full = n // BLOCK
    if full:
        kernel[(full,)](*args, 0, G=GROUPS, MASKED=False, num_warps=WARPS, **kw)
    if n % BLOCK:
        kernel[(1,)](*args, full, G=GROUPS, MASKED=True, num_warps=WARPS, **kw)


def dict4_encode(t: torch.Tensor, lut: torch.Tensor, pos_dtype: torch.dtype, expect_escapes: int):
    """(codes, raw, esc_pos, esc_sym) of bf16/int16/fp32 tensor t; lut: int32[256] symbol -> code.

    Escape slots are sized from ``expect_escapes`` (the sample's estimate); the host
    reads the true count (its one wait) and re-runs the pass in the rare case it was
    more. Escapes come back sorted by position, as the CPU path writes them.
    """
    x, w = word_view(t)
    n = x.numel()
    dev = x.device
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=dev)
    raw = torch.empty(n * (w - 1), dtype=torch.uint8, device=dev)
    cap = min(n, 2 * expect_escapes + 4096)
    while True:
        nesc = torch.zeros(1, dtype=torch.int32, device=dev)
        pos = torch.empty(cap, dtype=pos_dtype, device=dev)
        sym = torch.empty(cap, dtype=torch.uint8, device=dev)
        _launch(_dict4_encode, n, x, lut, codes, raw, nesc, pos, sym, cap, n, W=w)
        count = int(nesc.item())  # host waits: the number of escapes sizes the output
        if count <= cap:
            break
        cap = count
    pos, order = torch.sort(pos[:count])
    return codes, raw, pos, sym[:count][order]


def dict4_decode(codes: torch.Tensor, raw: torch.Tensor, tab16: torch.Tensor, n: int, tlen: int,
                 dtype: torch.dtype, pos: torch.Tensor, esc_sym: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Decode, then patch the escapes; returns (words, [escape codes seen, codes beyond the table,
    bad escape positions]) read in one host wait."""
    w = dtype.itemsize
    out = torch.empty(n, dtype=torch.int16 if w == 2 else torch.int32, device=codes.device)
    stat = torch.zeros(3, dtype=torch.int32, device=codes.device)
    _launch(_dict4_decode, n, codes, raw, tab16, out, stat, n, tlen, W=w, CHECK=True)
    if pos.numel():
        _dict4_patch[(cdiv(pos.numel(), 1024),)](out, codes, pos, esc_sym, stat, pos.numel(), n, W=w, BLOCK=1024)
    return out, stat.tolist()  # host waits: the counts are checked before the tensor is returned
