"""Triton kernels of frames (kernels.frame, whose layout is kernels.frame_layout): codec b at a
size fixed before encoding, neither direction with a host wait. The dictionary is chosen on
the device, and an escape's slot is its rank among the escapes, each tile finding the escapes
before it by the look-back of kernels.gpu.scan (encode) or in the frame's tile ends (decode).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..frame_layout import HEADER, PREFIX, TABLE
from ..frame_layout import TILE as FRAME_TILE
from . import cdiv
from .launch import Launcher
from .rest import AtRest
from .scan import LOOKBACK, look_back, publish
from .tiles import WARPS, pack_codes, tile_groups, unpack_codes

FRAME_G = FRAME_TILE // 4  # a frame's tile in groups of 4
_HEADER = tl.constexpr(HEADER)  # where a frame's tile ends start (bytes); a global a kernel reads must be a constexpr
_TABLE = tl.constexpr(TABLE)    # where its table of 15 symbols starts (bytes)
_PREFIX = tl.constexpr(PREFIX)  # a tile end's flag
FRAME_SUPER = 8        # tiles a program of _frame_encode takes, and looks back for as one
FRAME_ZERO = 8192      # look-back words a program of _frame_table clears
FRAME_SAMPLES = 1024   # sample elements a program of _frame_table counts
# a frame encode's scratch, int64 words: the symbols' codes (256 int32), the sample's histogram
# (256 int32) and the count of _frame_table's programs that added to it (both at rest: zero),
# the group counter, then the groups' look-back words
_SCRATCH_HIST = tl.constexpr(128)
_SCRATCH_DONE = tl.constexpr(256)
_SCRATCH_GROUP = tl.constexpr(257)
_SCRATCH_FLAGS = tl.constexpr(258)


@triton.jit
def _frame_ends(f_ptr):
    # the frame's tile ends: int64 words from byte HEADER on (kernels.frame's layout)
    return f_ptr.to(tl.pointer_type(tl.int64)) + _HEADER // 8


@triton.jit
def _frame_count(f_ptr, count):
    # the header's escape count (int32, saturated)
    tl.store(f_ptr.to(tl.pointer_type(tl.int32)), tl.minimum(count, 2**31 - 1).to(tl.int32))


@triton.jit
def _sample_symbols(x_ptr, stride, k, m):
    # the high bytes of sample elements k (elements k * stride, below m of them), and which are
    return tl.load(x_ptr.to(tl.pointer_type(tl.uint16)) + k.to(tl.int64) * stride, mask=k < m, other=0) >> 8, k < m


@triton.jit
def _frame_dictionary(hist, f_ptr, lut_ptr, magic, n_lo, n_hi, LUT: tl.constexpr):
    # A frame's dictionary, on the device so the host never waits for it: from the histogram
    # (256,) of the high bytes of a strided sample, the 15 most frequent (ties to the lower byte,
    # as the CPU reference breaks them), into the table; with LUT, into lut_ptr each symbol's
    # code, | 256 for the escape code (the encoder reads both from one load). Writes the header,
    # escape count 0.
    i = tl.arange(0, 256)
    key = tl.sort((hist << 8) | (255 - i), descending=True)
    sym = 255 - (key & 255)
    if LUT:
        tl.store(lut_ptr + sym, tl.minimum(i, 15) | tl.where(i >= 15, 256, 0))
    tl.store(f_ptr + _TABLE + i, tl.where(i < 15, sym, 0).to(tl.uint8), mask=i < 16)
    k = tl.arange(0, 4)
    word = tl.where(k == 1, magic, tl.where(k == 2, n_lo, tl.where(k == 3, n_hi, 0)))
    tl.store(f_ptr.to(tl.pointer_type(tl.int32)) + k, word)


@triton.jit
def _frame_words(x_ptr, tile, n, G: tl.constexpr, MASKED: tl.constexpr, rows=None):
    # a tile's words as a (G, 4) tile of int32 in 0..65535 (unsigned: the symbol is w >> 8 with
    # no mask), each thread's 4 elements contiguous; MASKED: only words below n, and (given
    # ``rows``, (G,) bool) only the rows where it holds
    idx, _ = tile_groups(tile, G)
    x_ptr = x_ptr.to(tl.pointer_type(tl.uint16))
    if MASKED:
        m = idx < n
        if rows is not None:
            m = m & rows[:, None]
        w = tl.load(x_ptr + idx, mask=m, other=0)
    else:
        w = tl.load(x_ptr + idx)
    return w.to(tl.int32)


@triton.jit
def _frame_pairs(x_ptr, tile, G: tl.constexpr):
    # a full tile's words two at a time, as a (G, 2) tile of uint32 (word j of a row holds the
    # row's words 2j and 2j + 1, low half first; x 4-byte aligned): a symbol is then one shift
    # and mask, where a 16-bit word took three (the compiler masks each half to 16 bits twice)
    _, pairs = tile_groups(tile, G)
    return tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + pairs)


@triton.jit
def _frame_code_pairs(v, f_ptr, lut_ptr, tile, codes_off, raw_off, G: tl.constexpr):
    # a full tile's codes and raw bytes from its pairs (_frame_pairs) into the frame; returns each
    # row's escape bits (bit i: the row's word i is an escape)
    idx, bidx = tile_groups(tile, G)
    lo = tl.load(lut_ptr + ((v >> 8) & 0xFF)).to(tl.uint32)  # code | escape << 8
    hi = tl.load(lut_ptr + (v >> 24)).to(tl.uint32)
    tl.store(f_ptr + codes_off + bidx, (lo | (hi << 4)).to(tl.uint8))
    tl.store(f_ptr + raw_off + idx, tl.reshape(tl.join(v & 0xFF, (v >> 16) & 0xFF), (G, 4)).to(tl.uint8))
    esc = (lo >> 8) | (hi >> 7)  # bit 0: the low word is an escape, bit 1: the high one
    return tl.sum(esc << (2 * tl.arange(0, 2))[None, :], axis=1).to(tl.int32)


@triton.jit
def _frame_symbols(w, f_ptr, lut_ptr, tile, n, G: tl.constexpr, MASKED: tl.constexpr, LUT: tl.constexpr):
    # a tile's symbols, codes and escapes from its words (_frame_words). Without LUT a symbol's
    # code is found among the table's 15 bytes (one program's frames: no scratch to hold a
    # lookup table)
    s = w >> 8
    if LUT:
        c = tl.load(lut_ptr + s) & 15
    else:
        c = tl.full(s.shape, 15, tl.int32)
        for k in tl.static_range(15):
            c = tl.where(s == tl.load(f_ptr + _TABLE + k).to(tl.int32), k, c)
    if MASKED:  # past n: code 0, no escape
        idx, _ = tile_groups(tile, G)
        c = tl.where(idx < n, c, 0)
    return s, c, c == 15


@triton.jit
def _frame_store(f_ptr, tile, n, w, c, codes_off, raw_off, G: tl.constexpr, MASKED: tl.constexpr):
    # a tile's codes (two a byte) and raw bytes into the frame
    idx, bidx = tile_groups(tile, G)
    if MASKED:
        tl.store(f_ptr + codes_off + bidx, pack_codes(c, G), mask=bidx * 2 < n)
        tl.store(f_ptr + raw_off + idx, (w & 0xFF).to(tl.uint8), mask=idx < n)
    else:
        tl.store(f_ptr + codes_off + bidx, pack_codes(c, G))
        tl.store(f_ptr + raw_off + idx, (w & 0xFF).to(tl.uint8))


@triton.jit
def _escape_ranks(esc):
    # each escape's rank among the escapes of the (G, 4) tile, in element order (int32: the
    # slot is the tile's first plus this, added to the pointer, so no int64 tile is held)
    e = esc.to(tl.int32)
    row = tl.sum(e, axis=1)
    return (tl.cumsum(row, axis=0) - row)[:, None] + (tl.cumsum(e, axis=1) - e)


@triton.jit
def _slots_left(cap, first):
    # escape slots from ``first`` on, as an int32 bound for the ranks
    return tl.minimum(tl.maximum(cap - first, 0), 2**31 - 1).to(tl.int32)


@triton.jit
def _frame_escapes(f_ptr, s, esc, first, sym_off, cap):
    # a tile's escaped symbols into their slots, the first at ``first``
    rank = _escape_ranks(esc)
    tl.store(f_ptr + sym_off + first + rank, s.to(tl.uint8), mask=esc & (rank < _slots_left(cap, first)))


@triton.jit
def _count(esc):
    return tl.sum(tl.sum(esc.to(tl.int64), axis=1), axis=0)


@triton.jit
def _tile_counts(rows, SUPER: tl.constexpr):
    # each tile's escapes, (SUPER,), from the rows' escape bits (bit 4 * k + i: tile k's word i):
    # one reduction for the group, where a count a tile was a reduction (and a barrier) each
    pairs = rows - ((rows >> 1) & 0x55555555)  # bits counted in pairs, then in nibbles (at most 4)
    nibbles = (pairs & 0x33333333) + ((pairs >> 2) & 0x33333333)
    return tl.sum((nibbles[:, None] >> (4 * tl.arange(0, SUPER))[None, :]) & 15, axis=0)


@Launcher
@triton.jit
def _frame_table(x_ptr, f_ptr, scratch_ptr, groups, stride, m, magic, n_lo, n_hi, SAMPLES: tl.constexpr,
                 ZERO: tl.constexpr):
    # before a frame's encode, in its scratch (int64 words, _SCRATCH_*): every program clears ZERO
    # of the group counter and look-back words; the first cdiv(m, SAMPLES) each add the
    # histogram of SAMPLES of the sample's symbols to the scratch's, and the last of them to
    # finish finds the dictionary from it and puts the histogram and the count of those done
    # back at rest (zero). One program taking the whole sample was a long serial stretch of the
    # encode's critical path
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * ZERO + tl.arange(0, ZERO)
    tl.store(scratch_ptr + _SCRATCH_GROUP + j, tl.zeros((ZERO,), tl.int64), mask=j < groups + 1)
    parts = tl.cdiv(m, SAMPLES)
    if pid < parts:
        hist_ptr = (scratch_ptr + _SCRATCH_HIST).to(tl.pointer_type(tl.int32)) + tl.arange(0, 256)
        s, ok = _sample_symbols(x_ptr, stride, pid * SAMPLES + tl.arange(0, SAMPLES), m)
        # acq_rel: a thread waits for its adds to be made, so all are made (the barrier) before the
        # count, whose last reader then finds them (one program's fence orders only its own thread's)
        tl.atomic_add(hist_ptr, tl.histogram(s.to(tl.int32), 256, mask=ok), sem="acq_rel")
        tl.debug_barrier()
        if tl.atomic_add(scratch_ptr + _SCRATCH_DONE, 1, sem="acq_rel") == parts - 1:
            hist = tl.atomic_xchg(hist_ptr, tl.zeros((256,), tl.int32), sem="relaxed")  # read at L2 and put at rest
            tl.store(scratch_ptr + _SCRATCH_DONE, 0)
            _frame_dictionary(hist, f_ptr, scratch_ptr.to(tl.pointer_type(tl.int32)), magic, n_lo, n_hi, LUT=True)


@Launcher
@triton.jit
def _frame_encode(x_ptr, f_ptr, scratch_ptr, n, tiles, groups, codes_off, raw_off, sym_off, cap, first_group,
                  G: tl.constexpr, SUPER: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr):
    # a group of SUPER tiles a program, in one pass over the input: each tile's codes are stored
    # and its escapes marked, and the tiles' counts found from the marks in one reduction (a
    # count a tile was a barrier a tile); the group's count is published, the escapes before the group
    # found by looking back (kernels.gpu.scan: a group, not a tile, so that there are few to
    # wait on), and its end published; then each tile's escapes are stored in their slots, and
    # every tile's end goes into the frame. Where a tile's escapes are is kept from the first
    # pass, 4 bits a row of 4 words (SUPER * 4 <= 32 bits a row), so the second reads only the
    # rows that hold one (from L2) and looks nothing up again: nearly every tile of a bf16
    # activation has an escape or two, and reading and coding each tile twice made the encoder
    # issue-bound. The partial last group (MASKED) is its own launch, after every other group
    # has published its end.
    lut_ptr = scratch_ptr.to(tl.pointer_type(tl.int32))
    if MASKED:
        grp = tl.full([], first_group, tl.int32)
    else:
        # groups in the order programs started
        grp = tl.atomic_add(scratch_ptr + _SCRATCH_GROUP, 1, sem="relaxed").to(tl.int32)
    flags = scratch_ptr + _SCRATCH_FLAGS
    j = tl.arange(0, SUPER)
    rows = tl.zeros((G,), tl.int32)  # bit 4 * k + i: tile k's word i of the row is an escape
    if MASKED:
        w = _frame_words(x_ptr, grp * SUPER, n, G, True)
    else:
        w = _frame_pairs(x_ptr, grp * SUPER, G)
    for k in range(SUPER):  # each tile's words loaded while the tile before is coded: two loads in flight
        tile = grp * SUPER + k
        after = tile + 1 - (k + 1) // SUPER  # (the last tile's again, from L1)
        if MASKED:
            ahead = _frame_words(x_ptr, after, n, G, True)
            s, c, esc = _frame_symbols(w, f_ptr, lut_ptr, tile, n, G, True, LUT=True)
            _frame_store(f_ptr, tile, n, w, c, codes_off, raw_off, G, True)
            bits = tl.sum(esc.to(tl.int32) << tl.arange(0, 4)[None, :], axis=1)
        else:
            ahead = _frame_pairs(x_ptr, after, G)
            bits = _frame_code_pairs(w, f_ptr, lut_ptr, tile, codes_off, raw_off, G)
        rows |= bits << (4 * k)
        w = ahead
    counts = _tile_counts(rows, SUPER)
    total = tl.sum(counts, axis=0)
    first = tl.zeros([], tl.int64)
    if grp == 0:
        publish(flags, total, 2, False)
    else:
        publish(flags + grp, total, 1, False)
        first = look_back(flags, grp, tl.int64, False, WINDOW)
        publish(flags + grp, first + total, 2, False)
    ends = _frame_ends(f_ptr)
    for k in range(SUPER):
        tile = grp * SUPER + k
        count = tl.sum(tl.where(j == k, counts, 0), axis=0)
        if count > 0:
            bits = (rows >> (4 * k)) & 15
            esc = ((bits[:, None] >> tl.arange(0, 4)[None, :]) & 1) != 0
            words = _frame_words(x_ptr, tile, n, G, True, bits != 0)
            _frame_escapes(f_ptr, words >> 8, esc, first, sym_off, cap)
        first += count
        tl.store(ends + tile, first << 2 | _PREFIX, mask=tile < tiles)
    if grp == groups - 1:
        _frame_count(f_ptr, first)


@Launcher
@triton.jit
def _frame_encode_small(x_ptr, f_ptr, n, tiles, stride, m, magic, n_lo, n_hi, codes_off, raw_off, sym_off, cap,
                        CHUNK: tl.constexpr, G: tl.constexpr):
    # a frame of a few tiles by one program, in one launch: the dictionary, then the tiles in order
    hist = tl.zeros((256,), dtype=tl.int32)
    for start in range(0, m, CHUNK):
        s, ok = _sample_symbols(x_ptr, stride, start + tl.arange(0, CHUNK), m)
        hist += tl.histogram(s.to(tl.int32), 256, mask=ok)
    _frame_dictionary(hist, f_ptr, f_ptr, magic, n_lo, n_hi, LUT=False)
    tl.debug_barrier()  # every thread reads the table back
    ends = _frame_ends(f_ptr)
    first = tl.zeros([], tl.int64)
    for tile in range(0, tiles):
        w = _frame_words(x_ptr, tile, n, G, MASKED=True)
        s, c, esc = _frame_symbols(w, f_ptr, f_ptr, tile, n, G, MASKED=True, LUT=False)
        _frame_store(f_ptr, tile, n, w, c, codes_off, raw_off, G, MASKED=True)
        _frame_escapes(f_ptr, s, esc, first, sym_off, cap)
        first += _count(esc)
        tl.store(ends + tile, first << 2 | _PREFIX)
    tl.debug_barrier()  # the header's count after the dictionary's 0
    _frame_count(f_ptr, first)


@Launcher
@triton.jit
def _frame_decode(f_ptr, out_ptr, n, codes_off, raw_off, sym_off, cap, first_tile, G: tl.constexpr,
                  MASKED: tl.constexpr):
    # one tile a program: codes through the table, escapes from their slots (the end of the
    # tile before is the first), the raw bytes below
    tile = first_tile + tl.program_id(0)
    idx, bidx = tile_groups(tile, G)
    m = idx < n
    if MASKED:
        cb = tl.load(f_ptr + codes_off + bidx, mask=bidx * 2 < n, other=0).to(tl.int32)
        r = tl.load(f_ptr + raw_off + idx, mask=m, other=0).to(tl.int32)
    else:
        cb = tl.load(f_ptr + codes_off + bidx).to(tl.int32)
        r = tl.load(f_ptr + raw_off + idx).to(tl.int32)
    c = unpack_codes(cb, G)
    esc = (c == 15) & m
    ends = _frame_ends(f_ptr)
    # clamped to the slots: unchecked as the frame is, a damaged one must not send a read outside it
    first = tl.minimum(tl.maximum(tl.where(tile > 0, tl.load(ends + tl.maximum(tile - 1, 0)) >> 2, 0), 0), cap)
    s = tl.load(f_ptr + _TABLE + c).to(tl.int32)
    if (tl.load(ends + tile) >> 2) > first:  # most tiles of a bf16 activation have an escape or two
        rank = _escape_ranks(esc)
        escaped = tl.load(f_ptr + sym_off + first + rank, mask=esc & (rank < _slots_left(cap, first)), other=0)
        s = tl.where(esc, escaped.to(tl.int32), s)
    if MASKED:
        tl.store(out_ptr + idx, ((s << 8) | r).to(tl.int16), mask=m)
    else:
        tl.store(out_ptr + idx, ((s << 8) | r).to(tl.int16))


# a frame encode's scratch (_SCRATCH_*), from a pool per stream (kernels.gpu.rest): its histogram
# and count at rest, _frame_table writes the rest of what the encoder reads
_FRAME_SCRATCH = AtRest(lambda device, size: torch.zeros(max(size, 4096), dtype=torch.int64, device=device),
                        lambda scratch: scratch.numel())


def frame_encode(x: torch.Tensor, frame: torch.Tensor, lay, sample: int, small_tiles: int, magic: int) -> None:
    """Encode the contiguous 16-bit tensor ``x`` into ``frame`` (kernels.frame, layout ``lay``) on the
    current stream, no host wait: one launch for up to ``small_tiles`` tiles; else the dictionary,
    the full groups of FRAME_SUPER tiles, and the partial last one if any (from a copy of ``x``
    if it is not 4-byte aligned: the full tiles are read in pairs of words)."""
    n = lay.n
    stride = max(1, n // sample)
    m = -(-n // stride)
    lo = n & 0xFFFFFFFF  # n as two int32 words (a small int argument is an int32 in the kernel)
    lo -= lo >> 31 << 32
    if lay.tiles <= small_tiles:
        _frame_encode_small[(1,)](x, frame, n, lay.tiles, stride, m, magic, lo, n >> 32, lay.codes, lay.raw, lay.sym,
                                  lay.cap, CHUNK=4096, G=FRAME_G, num_warps=WARPS)
        return
    if x.data_ptr() % 4:
        x = x.clone()  # _frame_pairs
    groups = -(-lay.tiles // FRAME_SUPER)
    with _FRAME_SCRATCH.take(x.device, _SCRATCH_FLAGS.value + groups) as scratch:  # see _frame_table
        grid = max(cdiv(groups + 1, FRAME_ZERO), cdiv(m, FRAME_SAMPLES))
        _frame_table[(grid,)](x, frame, scratch, groups, stride, m, magic, lo, n >> 32, SAMPLES=FRAME_SAMPLES,
                              ZERO=FRAME_ZERO, num_warps=8)
        full = n // (FRAME_TILE * FRAME_SUPER)
        args = (x, frame, scratch, n, lay.tiles, groups, lay.codes, lay.raw, lay.sym, lay.cap)
        kw = dict(G=FRAME_G, SUPER=FRAME_SUPER, WINDOW=LOOKBACK, num_warps=WARPS)
        if full:
            _frame_encode[(full,)](*args, 0, MASKED=False, **kw)
        if full < groups:
            _frame_encode[(1,)](*args, full, MASKED=True, **kw)


def frame_decode(frame: torch.Tensor, out: torch.Tensor, lay, small_tiles: int) -> None:
    """Decode ``frame`` (layout ``lay``) into 16-bit words ``out`` on the current stream, without a host
    wait, so nothing is checked (the frame is the mover's own): one launch for up to ``small_tiles``
    tiles or a whole number of them."""
    n = lay.n
    full = n // FRAME_TILE
    args = (frame, out, n, lay.codes, lay.raw, lay.sym, lay.cap)
    if lay.tiles <= small_tiles or full == 0:
        if lay.tiles:
            _frame_decode[(lay.tiles,)](*args, 0, G=FRAME_G, MASKED=True, num_warps=WARPS)
        return
    _frame_decode[(full,)](*args, 0, G=FRAME_G, MASKED=False, num_warps=WARPS)
    if n % FRAME_TILE:
        _frame_decode[(1,)](*args, full, G=FRAME_G, MASKED=True, num_warps=WARPS)
