"""Triton kernels for the lane-parallel Huffman stream of kernels.entropy (codec c).

One program handles LANES lanes. A lane takes its symbols in groups of 4
consecutive elements: at group step q, lane c owns elements (q * lanes + c) * 4
.. + 3, so each thread reads (and the decoder writes) one 32-bit word and
neighbouring threads touch neighbouring words.

Encode: ``split_presence`` splits bf16/fp32 words into the symbol and raw
fields and records which symbols occur (``merge`` is its inverse, for decode);
the code lengths come from a sample's counts (kernels.codecs); ``_lane_bits`` sums code lengths per lane;
torch.cumsum turns them into lane start bits and the host reads the total once
(it sizes the stream); ``_lane_encode`` emits each lane's codes into a 64-bit
register and flushes whole 32-bit words with plain stores, except the lane's
first and last words, which it shares with its neighbours (``atomic_or``).

Decode: ``_lane_decode`` loads a 96-bit window once per group (enough for 4
codes of <= 12 bits), decodes 4 symbols from it through the 2**MAX_LEN-entry
table, and writes them as one word, or (bf16/fp32 with n % 4 == 0) joins them
with their raw bytes and writes the 4 finished elements; the final position of
every lane is checked against its stored length on the host (one wait).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LANES = 128
SPLIT_BLOCK = 1024
SPLIT_ITERS = 32


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _split_presence(x_ptr, sym_ptr, raw_ptr, present_ptr, n, W: tl.constexpr, BLOCK: tl.constexpr,
                    ITERS: tl.constexpr):
    # ITERS blocks per program; which of the 256 symbols occur is kept as 4 x 64 bits
    # (a histogram per block costs far more, and the code lengths come from a sample)
    acc = tl.zeros([4], dtype=tl.int64)
    for it in range(0, ITERS):
        i = (tl.program_id(0).to(tl.int64) * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        w = tl.load(x_ptr + i, mask=m, other=0).to(tl.int32)
        if W == 2:  # bf16 / int16: (high byte, low byte)
            s = (w >> 8) & 0xFF
            tl.store(raw_ptr + i, (w & 0xFF).to(tl.uint8), mask=m)
        else:  # fp32: (exponent, sign<<23 | mantissa) with the raw field as three byte planes
            s = (w >> 23) & 0xFF
            r = (w & 0x7FFFFF) | (((w >> 31) & 1) << 23)
            for k in tl.static_range(3):
                tl.store(raw_ptr + k * n + i, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=m)
        tl.store(sym_ptr + i, s.to(tl.uint8), mask=m)
        bit = tl.full([BLOCK], 1, tl.int64) << (s & 63).to(tl.int64)
        hit = ((s >> 6)[:, None] == tl.arange(0, 4)[None, :]) & m[:, None]
        acc |= tl.reduce(tl.where(hit, bit[:, None], 0), 0, _or)
    tl.atomic_or(present_ptr + tl.arange(0, 4), acc)


def split_presence(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(symbols uint8, raw field bytes, int64[4] bitmask of the symbols present) of a
    bf16/int16/fp32 tensor."""
    w = t.element_size()
    x = t.contiguous().reshape(-1).view(torch.int16 if w == 2 else torch.int32)
    n = x.numel()
    sym = torch.empty(n, dtype=torch.uint8, device=x.device)
    raw = torch.empty(n * (w - 1), dtype=torch.uint8, device=x.device)
    present = torch.zeros(4, dtype=torch.int64, device=x.device)
    if n:
        _split_presence[(triton.cdiv(n, SPLIT_BLOCK * SPLIT_ITERS),)](x, sym, raw, present, n, W=w,
                                                                       BLOCK=SPLIT_BLOCK, ITERS=SPLIT_ITERS)
    return sym, raw, present


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
    """Inverse of ``split_presence``: a flat tensor of ``dtype`` (bf16/int16/fp32)."""
    n = sym.numel()
    w = torch.empty((), dtype=dtype).element_size()
    out = torch.empty(n, dtype=torch.int16 if w == 2 else torch.int32, device=sym.device)
    if n:
        _merge[(triton.cdiv(n, 4096),)](sym, raw, out, n, W=w, BLOCK=4096)
    return out.view(dtype)


@triton.jit
def _sym_at(sym_ptr, base, k: tl.constexpr, word, full, live, n, pad):
    part = tl.load(sym_ptr + base + k, mask=live & ~full & (base + k < n), other=pad).to(tl.int32)
    return tl.where(full, (word >> (8 * k)) & 0xFF, part)


@triton.jit
def _group_syms(sym_ptr, q, lanes, c, live, n, pad):
    # the 4 symbols (int32 each) of lane c at group step q: one 32-bit load, except
    # for the last, partial group (byte loads, padded past n)
    base = (q * lanes + c.to(tl.int64)) * 4
    full = live & (base + 3 < n)
    word = tl.load((sym_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=full, other=0)
    return (_sym_at(sym_ptr, base, 0, word, full, live, n, pad), _sym_at(sym_ptr, base, 1, word, full, live, n, pad),
            _sym_at(sym_ptr, base, 2, word, full, live, n, pad), _sym_at(sym_ptr, base, 3, word, full, live, n, pad))


@triton.jit
def _lane_bits(sym_ptr, len_ptr, bits_ptr, n, lanes, groups, pad, LANES: tl.constexpr):
    c = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = c < lanes
    acc = tl.zeros([LANES], dtype=tl.int32)
    for q in range(0, groups):
        s0, s1, s2, s3 = _group_syms(sym_ptr, q, lanes, c, live, n, pad)
        acc += tl.load(len_ptr + s0) + tl.load(len_ptr + s1) + tl.load(len_ptr + s2) + tl.load(len_ptr + s3)
    tl.store(bits_ptr + c, acc, mask=live)


@triton.jit
def _emit(words_ptr, buf, nb, wp, first, s, len_ptr, code_ptr, live):
    buf |= tl.load(code_ptr + s).to(tl.int64) << nb.to(tl.int64)
    nb += tl.load(len_ptr + s)
    flush = live & (nb >= 32)
    word = (buf & 0xFFFFFFFF).to(tl.int32)
    tl.atomic_or(words_ptr + wp, word, mask=flush & (wp == first))  # shared with the previous lane
    tl.store(words_ptr + wp, word, mask=flush & (wp != first))      # this lane's alone
    buf = tl.where(flush, buf >> 32, buf)
    wp = tl.where(flush, wp + 1, wp)
    nb = tl.where(flush, nb - 32, nb)
    return buf, nb, wp


@triton.jit
def _lane_encode(sym_ptr, len_ptr, code_ptr, start_ptr, words_ptr, n, lanes, groups, pad, LANES: tl.constexpr):
    c = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = c < lanes
    pos = tl.load(start_ptr + c, mask=live, other=0)
    first = pos >> 5
    wp = first
    nb = (pos & 31).to(tl.int32)
    buf = tl.zeros([LANES], dtype=tl.int64)
    for q in range(0, groups):
        s0, s1, s2, s3 = _group_syms(sym_ptr, q, lanes, c, live, n, pad)
        buf, nb, wp = _emit(words_ptr, buf, nb, wp, first, s0, len_ptr, code_ptr, live)
        buf, nb, wp = _emit(words_ptr, buf, nb, wp, first, s1, len_ptr, code_ptr, live)
        buf, nb, wp = _emit(words_ptr, buf, nb, wp, first, s2, len_ptr, code_ptr, live)
        buf, nb, wp = _emit(words_ptr, buf, nb, wp, first, s3, len_ptr, code_ptr, live)
    # the last, partial word is shared with the next lane
    tl.atomic_or(words_ptr + wp, (buf & 0xFFFFFFFF).to(tl.int32), mask=live & (nb > 0))


@triton.jit
def _lane_decode(words_ptr, table_ptr, start_ptr, out_ptr, end_ptr, raw_ptr, nwords, lanes, groups, n,
                 MAX_LEN: tl.constexpr, LANES: tl.constexpr, MERGE: tl.constexpr):
    # MERGE 0: write the symbols; 2: bf16/int16 elements (symbol = high byte, raw = low
    # byte); 4: fp32 elements (symbol = exponent, raw = 3 byte planes). Merging needs n % 4 == 0.
    c = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = c < lanes
    pos = tl.load(start_ptr + c, mask=live, other=0)
    bad = tl.zeros([LANES], dtype=tl.int32)
    for q in range(0, groups):
        w = tl.minimum(pos >> 5, nwords - 3)  # clamped: a corrupt length cannot read past the end
        w0 = tl.load(words_ptr + w, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        w1 = tl.load(words_ptr + w + 1, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        w2 = tl.load(words_ptr + w + 2, mask=live, other=0).to(tl.uint32).to(tl.uint64)
        b = (pos & 31).to(tl.uint64)
        win = ((w0 | (w1 << 32)) >> b) | tl.where(b > 0, w2 << ((64 - b) & 63), 0)
        base = (q * lanes + c.to(tl.int64)) * 4
        e0 = tl.load(table_ptr + (win & ((1 << MAX_LEN) - 1)).to(tl.int32), mask=live, other=0)
        win = win >> (e0 & 15).to(tl.uint64)
        e1 = tl.load(table_ptr + (win & ((1 << MAX_LEN) - 1)).to(tl.int32), mask=live, other=0)
        win = win >> (e1 & 15).to(tl.uint64)
        e2 = tl.load(table_ptr + (win & ((1 << MAX_LEN) - 1)).to(tl.int32), mask=live, other=0)
        win = win >> (e2 & 15).to(tl.uint64)
        e3 = tl.load(table_ptr + (win & ((1 << MAX_LEN) - 1)).to(tl.int32), mask=live, other=0)
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
            out = (out_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True)
            tl.store(out, lo, mask=keep)
            tl.store(out + 1, hi, mask=keep)
        else:
            keep = live & (base < n)
            p0 = tl.load((raw_ptr + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            p1 = tl.load((raw_ptr + n + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            p2 = tl.load((raw_ptr + 2 * n + base).to(tl.pointer_type(tl.int32), bitcast=True), mask=keep, other=0)
            tl.store(out_ptr + base, _fp32_word(s0, p0, p1, p2, 0), mask=keep)
            tl.store(out_ptr + base + 1, _fp32_word(s1, p0, p1, p2, 8), mask=keep)
            tl.store(out_ptr + base + 2, _fp32_word(s2, p0, p1, p2, 16), mask=keep)
            tl.store(out_ptr + base + 3, _fp32_word(s3, p0, p1, p2, 24), mask=keep)
    tl.store(end_ptr + c, tl.where(bad != 0, -1, pos), mask=live)


@triton.jit
def _fp32_word(s, p0, p1, p2, sh: tl.constexpr):
    r = ((p0 >> sh) & 0xFF) | (((p1 >> sh) & 0xFF) << 8) | (((p2 >> sh) & 0xFF) << 16)
    return (r & 0x7FFFFF) | (s << 23) | ((r >> 23) << 31)


def encode_lanes(sym: torch.Tensor, lens: torch.Tensor, codes: torch.Tensor, lanes: int, steps: int,
                 pad: int, pad_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream as int32 words, lane bit lengths int64) in kernels.entropy's layout."""
    n = sym.numel()
    groups = steps // 4
    grid = (triton.cdiv(lanes, LANES),)
    bits = torch.empty(lanes, dtype=torch.int32, device=sym.device)
    _lane_bits[grid](sym, lens, bits, n, lanes, groups, pad, LANES=LANES)
    bits = bits.to(torch.int64)
    start = torch.cumsum(bits, 0) - bits
    total = int((start[-1] + bits[-1]).item())  # host waits: sizes the stream
    words = torch.zeros(-(-total // 32) + pad_words, dtype=torch.int32, device=sym.device)
    _lane_encode[grid](sym, lens, codes, start, words, n, lanes, groups, pad, LANES=LANES)
    return words, bits


def decode_lanes(stream: torch.Tensor, lane_start: torch.Tensor, table: torch.Tensor, lanes: int, steps: int,
                 max_len: int, n: int, raw: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbols in element order, padded to steps * lanes; or, with raw/dtype and n % 4 == 0,
    the merged flat tensor of dtype) and each lane's end bit (-1 where a code was invalid).
    Nothing is read back here: the caller checks the ends with its other checks."""
    words = stream.view(torch.int32)
    end = torch.empty(lanes, dtype=torch.int64, device=stream.device)
    if raw is None:
        merge, out = 0, torch.empty(steps * lanes, dtype=torch.uint8, device=stream.device)
        raw = out
    else:
        merge = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(n, dtype=torch.int16 if merge == 2 else torch.int32, device=stream.device)
    _lane_decode[(triton.cdiv(lanes, LANES),)](words, table, lane_start.contiguous(), out, end, raw, words.numel(),
                                               lanes, steps // 4, n, MAX_LEN=max_len, LANES=LANES, MERGE=merge)
    return (out if merge == 0 else out.view(dtype)), end
