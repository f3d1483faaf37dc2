"""Triton kernels for the lane-parallel Huffman stream of kernels.huffman (codec c).

One program handles LANES lanes. A lane takes its symbols in groups of 4
consecutive elements: at group step q, lane c owns elements (q * lanes + c) * 4
.. + 3, so neighbouring threads touch neighbouring elements.

Encode reads either a uint8 symbol stream (W=1) or the elements of a bf16/int16
(W=2) or fp32 (W=4) tensor, taking each element's symbol field in registers (no
symbol stream is written), with the code kernels.gpu.huffman_code built on the
device (or the host's). ``_lane_bits`` sums code lengths per lane, writes the raw field of the elements (byte planes, as
kernels.gpu.fields lays them out), adds up the total, flags a symbol that has no
code, finds each lane's end (the lengths of the lanes before it: its program's by a
scan in registers, the programs' before it by kernels.gpu.scan's decoupled
look-back) and clears the words two lanes share; ``_lane_encode`` adds two codes at
a time to a 64-bit register and stores each 32-bit word as it fills, except the
lane's first word (kept in a register) and last, which it ORs in at the end. A full
group of 4 elements is one 64-bit load (two for fp32) and its raw bytes one 32-bit
store per byte plane, so the input must be 16-byte aligned. Every step of a lane
but the last holds whole groups, so the lane kernels run the code for a partial
group only there. Both passes are queued at once, into a buffer as long as any
stream can be; the host waits once, while the encoder runs, for what the lane pass
has found: the total (the stream's length), the flag (a symbol without a code sends
the caller back for a code that covers every symbol) and the code's lengths (the
header).

Decode: ``_lane_decode`` finds its lanes' starts as ``_lane_bits`` finds their
ends, loads a 96-bit window once per group (enough for 4 codes of <= 12 bits),
decodes 4 symbols from it through the 2**MAX_LEN-entry table, and writes them as
one word, or (bf16/fp32 with n % 4 == 0) joins them with their raw bytes and writes
the 4 finished elements in one store; it checks where every lane ends against its
stored length and flags a mismatch, which the host reads with the total length (one
wait).

A launch or an allocation costs the host a sizeable part of the time the device takes to
decode even a large tensor: the host's calls, not the kernels, set the speed
of a call, so the lane lengths are summed inside the lane kernels rather than by
launches of their own.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from . import cdiv
from .fields import split_word
from .huffman_code import CODE_WORDS, LENGTHS_AT, SCRATCH_WORDS, CodeWork, table_entry
from .launch import Launcher
from .rest import AtRest
from .scan import LOOKBACK, look_back, publish

_LOOKBACK = tl.constexpr(LOOKBACK)  # a global a kernel reads must be a constexpr

LANES = 128


def _new_code_work(device: torch.device, flags: int) -> CodeWork:
    info_words = 2 * CODE_WORDS + 2  # int32 words of info, kept a multiple of 4 (16-byte aligned views)
    at = info_words + 256
    flags_at = at + 128 + SCRATCH_WORDS
    buf = torch.zeros(flags_at + 2 * max(flags, 1024), dtype=torch.int32, device=device)
    return CodeWork(buf[info_words:at], buf[:2 * CODE_WORDS].view(torch.int64), buf[at:at + 128].view(torch.int16),
                    buf[at + 128:flags_at], buf[flags_at:].view(torch.int64))


_CODE_WORK = AtRest(_new_code_work, lambda work: work.flags.numel())


def code_work(device: torch.device, lanes: int) -> contextlib.AbstractContextManager[CodeWork]:
    """The work of one encode of ``lanes`` lanes on the current stream (kernels.gpu.rest), at
    rest: the counts, the lane pass's info (words 0 and 1) and the look-back words zero. The
    kernels leave it so: _build_code clears the counts it read, _lane_encode the words the
    lane pass wrote."""
    return _CODE_WORK.take(device, 1 + programs(lanes))


@Launcher
@triton.jit
def _merge(sym_ptr, raw_ptr, out_ptr, n, W: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    s = tl.load(sym_ptr + i, mask=m, other=0).to(tl.int32)
    if W == 2:
        tl.store(out_ptr + i, ((s << 8) | tl.load(raw_ptr + i, mask=m, other=0).to(tl.int32)).to(tl.int16), mask=m)
    else:
        r = (tl.load(raw_ptr + i, mask=m, other=0).to(tl.int32)
             | (tl.load(raw_ptr + n + i, mask=m, other=0).to(tl.int32) << 8)
             | (tl.load(raw_ptr + 2 * n + i, mask=m, other=0).to(tl.int32) << 16))
        tl.store(out_ptr + i, (r & 0x7FFFFF) | (s << 23) | ((r >> 23) << 31), mask=m)


def merge(sym: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Symbols and raw field bytes (layout of kernels.gpu.fields) joined: a flat tensor of ``dtype``
    (bf16/int16/fp32)."""
    n = sym.numel()
    w = dtype.itemsize
    out = torch.empty(n, dtype=torch.int16 if w == 2 else torch.int32, device=sym.device)
    if n:
        _merge[(cdiv(n, 4096),)](sym, raw, out, n, W=w, BLOCK=4096)
    return out.view(dtype)


@triton.jit
def _sym_at(sym_ptr, base, k: tl.constexpr, word, full, live, n, pad):
    part = tl.load(sym_ptr + base + k, mask=live & ~full & (base + k < n), other=pad).to(tl.int32)
    return tl.where(full, (word >> (8 * k)) & 0xFF, part)


@triton.jit
def _elem_at(x_ptr, base, k: tl.constexpr, word, full, live, n):
    # element k of a group as an int32 bit pattern: from the group's wide load, or on its
    # own in the last, partial group
    part = tl.load(x_ptr + base + k, mask=live & ~full & (base + k < n), other=0).to(tl.int32)
    return tl.where(full, word, part)


@triton.jit
def _store_raw(raw_ptr, base, full, live, n, r0, r1, r2, r3, W: tl.constexpr, PLANES4: tl.constexpr,
               FULL: tl.constexpr):
    # the raw fields of a group's 4 elements: one 32-bit store per byte plane (planes start
    # 4-aligned when n % 4 == 0: PLANES4), byte by byte in the last, partial group
    for p in tl.static_range(W - 1):
        sh = 8 * p
        v0 = (r0 >> sh) & 0xFF
        v1 = (r1 >> sh) & 0xFF
        v2 = (r2 >> sh) & 0xFF
        v3 = (r3 >> sh) & 0xFF
        at = raw_ptr + p * n + base
        if PLANES4:
            tl.store(at.to(tl.pointer_type(tl.int32), bitcast=True), v0 | (v1 << 8) | (v2 << 16) | (v3 << 24),
                     mask=full)
            one = live & ~full
        else:
            one = live
        if not (FULL and PLANES4):
            tl.store(at, v0.to(tl.uint8), mask=one & (base < n))
            tl.store(at + 1, v1.to(tl.uint8), mask=one & (base + 1 < n))
            tl.store(at + 2, v2.to(tl.uint8), mask=one & (base + 2 < n))
            tl.store(at + 3, v3.to(tl.uint8), mask=one & (base + 3 < n))


@triton.jit
def _group_syms(x_ptr, raw_ptr, q, lanes, c, live, n, pad, W: tl.constexpr, WRITE_RAW: tl.constexpr,
                PLANES4: tl.constexpr, FULL: tl.constexpr):
    # the 4 symbols (int32 each) of lane c at group step q, pad past n; with WRITE_RAW the
    # elements' raw fields are stored too. A full group is one 32-bit load (W=1: symbols),
    # one 64-bit load (W=2) or two (W=4): the caller keeps x 16-byte aligned. FULL: the caller
    # knows every live lane's group is whole (every step but the last), so the code for a
    # partial group, several times the instructions of a whole one, is left out.
    base = (q * lanes + c.to(tl.int64)) * 4
    if FULL:
        full = live
    else:
        full = live & (base + 3 < n)
    if W == 1:
        word = tl.load((x_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=full, other=0)
        if FULL:
            return word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF, (word >> 24) & 0xFF
        return (_sym_at(x_ptr, base, 0, word, full, live, n, pad), _sym_at(x_ptr, base, 1, word, full, live, n, pad),
                _sym_at(x_ptr, base, 2, word, full, live, n, pad), _sym_at(x_ptr, base, 3, word, full, live, n, pad))
    if W == 2:
        v = tl.load((x_ptr + base).to(tl.pointer_type(tl.int64), bitcast=True), mask=full, other=0)
        w0 = (v & 0xFFFF).to(tl.int32)
        w1 = ((v >> 16) & 0xFFFF).to(tl.int32)
        w2 = ((v >> 32) & 0xFFFF).to(tl.int32)
        w3 = ((v >> 48) & 0xFFFF).to(tl.int32)
    else:
        v = tl.load((x_ptr + base).to(tl.pointer_type(tl.int64), bitcast=True), mask=full, other=0)
        u = tl.load((x_ptr + base + 2).to(tl.pointer_type(tl.int64), bitcast=True), mask=full, other=0)
        w0 = v.to(tl.int32)
        w1 = (v >> 32).to(tl.int32)
        w2 = u.to(tl.int32)
        w3 = (u >> 32).to(tl.int32)
    if not FULL:
        w0 = _elem_at(x_ptr, base, 0, w0, full, live, n)
        w1 = _elem_at(x_ptr, base, 1, w1, full, live, n)
        w2 = _elem_at(x_ptr, base, 2, w2, full, live, n)
        w3 = _elem_at(x_ptr, base, 3, w3, full, live, n)
    s0, r0 = split_word(w0, W)
    s1, r1 = split_word(w1, W)
    s2, r2 = split_word(w2, W)
    s3, r3 = split_word(w3, W)
    if WRITE_RAW:
        _store_raw(raw_ptr, base, full, live, n, r0, r1, r2, r3, W, PLANES4, FULL)
    if FULL:
        return s0, s1, s2, s3
    return (tl.where(live & (base < n), s0, pad), tl.where(live & (base + 1 < n), s1, pad),
            tl.where(live & (base + 2 < n), s2, pad), tl.where(live & (base + 3 < n), s3, pad))


@triton.jit
def _count_group(x_ptr, raw_ptr, table_ptr, q, lanes, c, live, n, pad, acc, miss, W: tl.constexpr,
                 PLANES4: tl.constexpr, FULL: tl.constexpr):
    s0, s1, s2, s3 = _group_syms(x_ptr, raw_ptr, q, lanes, c, live, n, pad, W, W > 1, PLANES4, FULL)
    l0 = table_entry(table_ptr, s0) & 15
    l1 = table_entry(table_ptr, s1) & 15
    l2 = table_entry(table_ptr, s2) & 15
    l3 = table_entry(table_ptr, s3) & 15
    acc += l0 + l1 + l2 + l3
    miss |= ((l0 == 0) | (l1 == 0) | (l2 == 0) | (l3 == 0)).to(tl.int32)
    return acc, miss


@triton.jit
def _lane_ends(lbits, vid, flags_ptr):
    # each lane's end: the inclusive sum of the lane lengths (int64) up to it, the block's in
    # registers, the blocks' before it by decoupled look-back (kernels.gpu.scan), so no scan
    # of the lengths is launched between the lane kernels
    total = tl.sum(lbits, axis=0)
    if vid == 0:
        publish(flags_ptr, total, 2, False)
        prefix = tl.zeros([], tl.int64)
    else:
        publish(flags_ptr + vid, total, 1, False)
        prefix = look_back(flags_ptr, vid, tl.int64, False, _LOOKBACK)
        publish(flags_ptr + vid, prefix + total, 2, False)
    return prefix + tl.cumsum(lbits, axis=0)


@Launcher
@triton.jit
def _lane_bits(x_ptr, raw_ptr, table_ptr, bits_ptr, ends_ptr, words_ptr, info_ptr, flags_ptr, n, lanes, groups,
               W: tl.constexpr, LANES: tl.constexpr, PLANES4: tl.constexpr, PAD_WORDS: tl.constexpr):
    # each lane's code length in bits (int16) and end (int64), the raw field of its elements,
    # zeros where the encoder ORs, and into info: the total bits (one atomic per program) and
    # whether a symbol had no code. flags_ptr: the look-back's counter, then a word per program
    # (zeroed). Every step but the last holds whole groups (lane_shape: (steps - 4) * lanes < n)
    vid = tl.atomic_add(flags_ptr, 1, sem="relaxed")  # blocks in the order programs started: predecessors are running
    c = vid * LANES + tl.arange(0, LANES)
    live = c < lanes
    pad = tl.load(info_ptr + 34).to(tl.int32)
    acc = tl.zeros([LANES], dtype=tl.int32)
    miss = tl.zeros([LANES], dtype=tl.int32)
    for q in range(0, groups - 1):
        acc, miss = _count_group(x_ptr, raw_ptr, table_ptr, q, lanes, c, live, n, pad, acc, miss, W, PLANES4, True)
    acc, miss = _count_group(x_ptr, raw_ptr, table_ptr, groups - 1, lanes, c, live, n, pad, acc, miss, W, PLANES4,
                             False)
    acc = tl.where(live, acc, 0)
    tl.store(bits_ptr + c, acc.to(tl.int16), mask=live)
    end = _lane_ends(acc.to(tl.int64), vid, flags_ptr + 1)
    tl.store(ends_ptr + c, end, mask=live)
    # the encoder ORs into the word each lane ends in (where the next lane starts; the first
    # lane starts in word 0) and the words after the stream, so the stream can be written
    # into memory nothing cleared
    zero = tl.zeros([LANES], tl.int32)
    tl.store(words_ptr + (end >> 5), zero, mask=live)
    tl.store(words_ptr + c, zero, mask=c == 0)
    for k in tl.static_range(1, PAD_WORDS + 1):
        tl.store(words_ptr + (end >> 5) + k, zero, mask=live & (c == lanes - 1))
    tl.atomic_add(info_ptr, tl.sum(acc.to(tl.int64), axis=0), sem="relaxed")
    tl.atomic_max(info_ptr + 1, tl.max(tl.where(live, miss, 0), axis=0).to(tl.int64), sem="relaxed")


@triton.jit
def _emit2(words_ptr, buf, nb, wp, first, head, e0, e1, live):
    # two codes (<= 24 bits) into the buffer (< 32 bits pending), then at most one word out:
    # the lane's first word (shared with the lane before) is kept for the end, the others
    # are the lane's alone and stored as they fill
    l0 = e0 & 15
    buf |= (((e0 >> 4) | ((e1 >> 4) << l0)).to(tl.int64)) << nb.to(tl.int64)
    nb += l0 + (e1 & 15)
    flush = live & (nb >= 32)
    word = (buf & 0xFFFFFFFF).to(tl.int32)
    head = tl.where(flush & (wp == first), word, head)
    tl.store(words_ptr + wp, word, mask=flush & (wp != first))
    buf = tl.where(flush, buf >> 32, buf)
    wp = tl.where(flush, wp + 1, wp)
    nb = tl.where(flush, nb - 32, nb)
    return buf, nb, wp, head


@triton.jit
def _encode_group(x_ptr, table_ptr, words_ptr, q, lanes, c, live, n, pad, buf, nb, wp, first, head, W: tl.constexpr,
                  FULL: tl.constexpr):
    s0, s1, s2, s3 = _group_syms(x_ptr, x_ptr, q, lanes, c, live, n, pad, W, False, False, FULL)
    buf, nb, wp, head = _emit2(words_ptr, buf, nb, wp, first, head, table_entry(table_ptr, s0),
                               table_entry(table_ptr, s1), live)
    return _emit2(words_ptr, buf, nb, wp, first, head, table_entry(table_ptr, s2), table_entry(table_ptr, s3), live)


@Launcher
@triton.jit
def _lane_encode(x_ptr, table_ptr, ends_ptr, bits_ptr, words_ptr, info_ptr, flags_ptr, n, lanes, groups,
                 W: tl.constexpr, LANES: tl.constexpr):
    # the lane pass is done, and the host's copy of info queued: its info words and look-back
    # words go back to rest (code_work)
    pid = tl.program_id(0)
    k = tl.arange(0, 2)
    first = (pid + tl.zeros_like(k)) == 0  # a block, not a scalar: the interpreter takes no scalar mask here
    tl.store(flags_ptr + pid + k, tl.zeros((2,), tl.int64), mask=(k == 1) | first)
    tl.store(info_ptr + k, tl.zeros((2,), tl.int64), mask=first)
    c = pid * LANES + tl.arange(0, LANES)
    live = c < lanes
    pad = tl.load(info_ptr + 34).to(tl.int32)
    pos = tl.load(ends_ptr + c, mask=live, other=0) - tl.load(bits_ptr + c, mask=live, other=0).to(tl.int64)
    first = pos >> 5
    wp = first
    nb = (pos & 31).to(tl.int32)
    buf = tl.zeros([LANES], dtype=tl.int64)
    head = tl.zeros([LANES], dtype=tl.int32)
    for q in range(0, groups - 1):  # whole groups (see _lane_bits)
        buf, nb, wp, head = _encode_group(x_ptr, table_ptr, words_ptr, q, lanes, c, live, n, pad, buf, nb, wp, first,
                                          head, W, True)
    buf, nb, wp, head = _encode_group(x_ptr, table_ptr, words_ptr, groups - 1, lanes, c, live, n, pad, buf, nb, wp,
                                      first, head, W, False)
    # the first word, if it filled, and the last, partial one are shared with the neighbours
    tl.atomic_or(words_ptr + first, head, mask=live & (wp != first), sem="relaxed")
    tl.atomic_or(words_ptr + wp, (buf & 0xFFFFFFFF).to(tl.int32), mask=live & (nb > 0), sem="relaxed")


@Launcher
@triton.jit
def _lane_decode(words_ptr, table_ptr, bits_ptr, out_ptr, info_ptr, raw_ptr, nwords, lanes, groups, n,
                 MAX_LEN: tl.constexpr, LANES: tl.constexpr, MERGE: tl.constexpr):
    # MERGE 0: write the symbols; 2: bf16/int16 elements (symbol = high byte, raw = low
    # byte); 4: fp32 elements (symbol = exponent, raw = 3 byte planes). Merging needs n % 4 == 0.
    # info (int64, zeroed): [0] a lane whose codes are invalid, or do not end where its length
    # says, or whose length is impossible; [1] the total bits (the last lane's end); [2] the
    # look-back's counter, then a word per program: each lane's start is the sum of the
    # lengths before it, found here (kernels.gpu.scan's look-back), not by a launch before
    vid = tl.atomic_add(info_ptr + 2, 1, sem="relaxed")
    c = vid * LANES + tl.arange(0, LANES)
    live = c < lanes
    lbits = tl.load(bits_ptr + c, mask=live, other=0).to(tl.int64)
    end = _lane_ends(lbits, vid, info_ptr + 3)
    pos = end - lbits
    bad = ((lbits < 0) | (lbits > 4 * groups * MAX_LEN)).to(tl.int32)
    for q in range(0, groups):
        w = tl.maximum(tl.minimum(pos >> 5, nwords - 3), 0)  # clamped: corrupt lengths cannot read outside
        w0 = tl.load(words_ptr + w, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        w1 = tl.load(words_ptr + w + 1, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        w2 = tl.load(words_ptr + w + 2, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        b = (pos & 31).to(tl.uint64)
        win = ((w0 | (w1 << 32)) >> b) | tl.where(b > 0, w2 << ((64 - b) & 63), 0)
        base = (q * lanes + c.to(tl.int64)) * 4
        e0 = table_entry(table_ptr, (win & ((1 << MAX_LEN) - 1)).to(tl.int32))
        win = win >> (e0 & 15).to(tl.uint64)
        e1 = table_entry(table_ptr, (win & ((1 << MAX_LEN) - 1)).to(tl.int32))
        win = win >> (e1 & 15).to(tl.uint64)
        e2 = table_entry(table_ptr, (win & ((1 << MAX_LEN) - 1)).to(tl.int32))
        win = win >> (e2 & 15).to(tl.uint64)
        e3 = table_entry(table_ptr, (win & ((1 << MAX_LEN) - 1)).to(tl.int32))
        bad |= ((e0 & 15) == 0).to(tl.int32) | ((e1 & 15) == 0).to(tl.int32) \
            | ((e2 & 15) == 0).to(tl.int32) | ((e3 & 15) == 0).to(tl.int32)
        pos += ((e0 & 15) + (e1 & 15) + (e2 & 15) + (e3 & 15)).to(tl.int64)
        s0 = (e0 >> 4) & 0xFF
        s1 = (e1 >> 4) & 0xFF
        s2 = (e2 >> 4) & 0xFF
        s3 = (e3 >> 4) & 0xFF
        if MERGE == 0:
            out = (out_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True)
            tl.store(out, s0 | (s1 << 8) | (s2 << 16) | (s3 << 24), mask=live)
        elif MERGE == 2:
            keep = live & (base < n)
            r = tl.load((raw_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            lo = ((s0 << 8) | (r & 0xFF)) | (((s1 << 8) | ((r >> 8) & 0xFF)) << 16)
            hi = ((s2 << 8) | ((r >> 16) & 0xFF)) | (((s3 << 8) | ((r >> 24) & 0xFF)) << 16)
            out = (out_ptr + base).to(tl.pointer_type(tl.int64), bitcast=True)
            tl.store(out, (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32), mask=keep)
        else:
            keep = live & (base < n)
            p0 = tl.load((raw_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            p1 = tl.load((raw_ptr + n + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            p2 = tl.load((raw_ptr + 2 * n + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            # the group's 4 words as one [LANES, 4] block, so each thread stores 16 bytes at once
            e = tl.join(tl.join(_fp32_word(s0, p0, p1, p2, 0), _fp32_word(s2, p0, p1, p2, 16)),
                        tl.join(_fp32_word(s1, p0, p1, p2, 8), _fp32_word(s3, p0, p1, p2, 24))).reshape(LANES, 4)
            k4 = tl.arange(0, 4)
            tl.store(out_ptr + base[:, None] + k4[None, :], e, mask=keep[:, None])
    broken = tl.max(tl.where(live & ((bad != 0) | (pos != end)), 1, 0), axis=0).to(tl.int64)
    tl.atomic_max(info_ptr, broken, sem="relaxed")
    tl.store(info_ptr + 1 + tl.zeros_like(c), end, mask=c == lanes - 1)


@triton.jit
def _fp32_word(s, p0, p1, p2, sh: tl.constexpr):
    r = ((p0 >> sh) & 0xFF) | (((p1 >> sh) & 0xFF) << 8) | (((p2 >> sh) & 0xFF) << 16)
    return (r & 0x7FFFFF) | (s << 23) | ((r >> 23) << 31)


def programs(lanes: int) -> int:
    """Programs of the lane kernels for ``lanes`` lanes (each takes LANES)."""
    return cdiv(lanes, LANES)


def encode_lanes(x: torch.Tensor, w: int, table: torch.Tensor, info: torch.Tensor, flags: torch.Tensor, lanes: int,
                 steps: int, pad_words: int,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, np.ndarray] | None:
    """(stream bytes, lane bit lengths as uint16 bytes, raw field bytes or None, code lengths)
    in kernels.huffman's layout, for ``x`` a flat uint8 symbol stream (w=1) or the int16
    (w=2) / int32 (w=4) view of bf16/int16/fp32 elements (whose raw field it writes).
    ``table`` and ``info`` hold the code (``build_code``, or the host's with the pad symbol
    at info[34]); ``flags``: int64[1 + programs(lanes)], zeroed, for the lane pass's look-back
    (the encoder clears it again, and info's first two words: code_work).
    None when a symbol has no code. ``x`` must be 16-byte aligned. Both passes are queued at
    once, into a stream buffer as long as any stream can be. The lane pass has found the
    stream's length (and the code its lengths) long before the encoder is done: the host reads
    them then, in one wait, and queues the copy of the stream out of the worst-case buffer right
    behind the encoder, so that the device does not wait for the host between the two. Each
    host call here is one the device may wait for (a launch or an allocation costs host time
    the device may spend idle): hence two launches, and two allocations carved into views."""
    n = x.numel()
    dev = x.device
    groups = steps // 4
    grid = (programs(lanes),)
    bits_at = -(-2 * lanes // 16) * 16  # the raw field starts 16-byte aligned (4-byte stores)
    out = torch.empty(bits_at + n * (w - 1), dtype=torch.uint8, device=dev)  # lane lengths, raw field
    bits = out[:2 * lanes].view(torch.int16)
    raw = out[bits_at:] if w > 1 else None
    nwords = -(-steps * lanes * max_len // 32) + pad_words + 1
    tmp = torch.empty(2 * lanes + nwords, dtype=torch.int32, device=dev)  # lane ends (int64), the worst-case stream
    ends, words = tmp[:2 * lanes].view(torch.int64), tmp[2 * lanes:]
    _lane_bits[grid](x, raw if raw is not None else x, table, bits, ends, words, info, flags, n, lanes, groups, W=w,
                     LANES=LANES, PLANES4=w == 2 or n % 4 == 0, PAD_WORDS=pad_words)
    # pinned: the stream's length, a symbol without a code, the code (a copy even of a CPU tensor:
    # the encoder clears the first two words)
    host = info.to("cpu", non_blocking=True, copy=True)
    known = torch.cuda.Event() if x.is_cuda else None  # (TRITON_INTERPRET runs these kernels on the CPU)
    if known is not None:
        known.record()
    _lane_encode[grid](x, table, ends, bits, words, info, flags, n, lanes, groups, W=w, LANES=LANES)
    if known is not None:
        known.synchronize()  # the one wait, while the encoder runs
    code = host.numpy()
    if code[1]:
        return None
    stream = words[:-(-int(code[0]) // 32) + pad_words].clone()  # let the worst-case buffer go
    lengths = code.view(np.uint8)[LENGTHS_AT:LENGTHS_AT + 256].copy()
    return stream.view(torch.uint8), bits.view(torch.uint8), raw, lengths


def decode_lanes(stream: torch.Tensor, bits: torch.Tensor, table: torch.Tensor, lanes: int, steps: int,
                 max_len: int, n: int, raw: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbols in element order, padded to steps * lanes; or, with raw/dtype and n % 4 == 0,
    the merged flat tensor of dtype) and int64 info: [0] nonzero if a lane is corrupt, [1] the
    total bits. ``bits``: the lane lengths (int16); the decoder sums them into lane starts
    itself. Nothing is read back here: the caller checks info with its other checks."""
    words = stream.view(torch.int32)
    info = torch.zeros(3 + programs(lanes), dtype=torch.int64, device=stream.device)
    if raw is None:
        merge, out = 0, torch.empty(steps * lanes, dtype=torch.uint8, device=stream.device)
        raw = out
    else:
        merge = dtype.itemsize
        out = torch.empty(n, dtype=torch.int16 if merge == 2 else torch.int32, device=stream.device)
    _lane_decode[(programs(lanes),)](words, table, bits, out, info, raw, words.numel(), lanes, steps // 4, n,
                                     MAX_LEN=max_len, LANES=LANES, MERGE=merge)
    return (out if merge == 0 else out.view(dtype)), info[:2]
