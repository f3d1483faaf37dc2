"""Building a Huffman code on the device (kernels.huffman's code, for codec c): from the counts
of a sample, the code lengths, the encode table and the pad symbol that kernels.huffman's
``code_lengths`` / ``canonical_codes`` give on the host, so that a CUDA tensor's encode needs no
host round trip for its code. The lane kernels (kernels.gpu.huffman) read what this writes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import Launcher

# The code buffer (int64[CODE_WORDS]) the lane kernels read and _build_code writes: words 0
# and 1 the lane pass's info (total bits, a symbol without a code), bytes LENGTHS_AT.. the
# code lengths (uint8[256]), word PAD_AT the pad symbol. The kernels spell the offsets out.
CODE_WORDS = 35
LENGTHS_AT = 16
PAD_AT = 34
SCRATCH_WORDS = 5 * 256  # _build_code's working arrays (int32)


class CodeWork(NamedTuple):
    """What building a code on the device and the lane pass read and write, views of one
    allocation, taken from a pool at rest (kernels.gpu.huffman.code_work)."""
    hist: torch.Tensor     # int32[256]: the sample's counts, added by fields.sample_histogram
    info: torch.Tensor     # int64[CODE_WORDS]: the code buffer (see above)
    table: torch.Tensor    # int16[256]: the encode table
    scratch: torch.Tensor  # int32[SCRATCH_WORDS]: _build_code's working arrays
    flags: torch.Tensor    # int64[1 + programs, or more]: the lane pass's look-back (encode_lanes)


@triton.jit
def table_entry(table_ptr, i):
    # an int16 table entry (code or symbol << 4 | length) as a non-negative int32
    return tl.load(table_ptr + i).to(tl.int32) & 0xFFFF


@triton.jit
def _at(v, i, idx):
    # v[i] of a register vector, as a scalar
    return tl.sum(tl.where(idx == i, v, 0), axis=0)


@Launcher
@triton.jit
def _build_code(hist_ptr, force_ptr, out_ptr, table_ptr, scratch_ptr, MARGIN: tl.constexpr, MAX_LEN: tl.constexpr):
    # The code of kernels.huffman.code_lengths and canonical_codes, on the device, from the
    # sample's counts and the forced symbols (kernels.codecs.huff_exp._huff_counts): a two-queue
    # Huffman tree (leaves sorted by (count, symbol), internal nodes in the order they are
    # made: the order a heap of (count, id) pops them), JPEG's depth limit, canonical codes.
    # out_ptr is int64[CODE_WORDS]: [0] and [1] the lane pass's info (total bits, a symbol
    # without a code), bytes 16..271 the lengths (uint8[256]), [34] the pad symbol (the
    # first of the shortest codes); table_ptr gets the encode table (int16[256] =
    # reversed code << 4 | length). The merges, a chain of about a hundred, read single
    # entries from scratch_ptr (int32[SCRATCH_WORDS], in L1) rather than reducing a register
    # vector for each: a load is a fraction of a reduction's latency. JPEG's adjustment keeps
    # its counts in registers: each of its steps writes four, and through scratch each write
    # was a store, a barrier and a load before the next step could read.
    LEAF: tl.constexpr = 0     # counts of the sorted leaves
    NODE: tl.constexpr = 256   # counts of the internal nodes, in the order they are made
    PLEAF: tl.constexpr = 512  # parent (internal node) of each sorted leaf
    ANC: tl.constexpr = 768    # parent of each internal node; then ancestors while depths are found
    DIST: tl.constexpr = 1024  # distance to that ancestor; in the end each internal node's depth
    r = tl.arange(0, 256)
    h = tl.load(hist_ptr + r)  # int32: a sample has at most 2**21 elements, so every sum fits
    tl.store(hist_ptr + r, tl.zeros_like(h))  # left at rest for the next encode (code_work)
    half = r >> 7
    low = r & 127
    seen = h > 0
    lo0 = tl.min(tl.where(seen & (half == 0), low, 1000), axis=0)
    hi0 = tl.max(tl.where(seen & (half == 0), low, -1000), axis=0)
    lo1 = tl.min(tl.where(seen & (half == 1), low, 1000), axis=0)
    hi1 = tl.max(tl.where(seen & (half == 1), low, -1000), axis=0)
    near = tl.where(half == 0, (low >= lo0 - MARGIN) & (low <= hi0 + MARGIN),
                    (low >= lo1 - MARGIN) & (low <= hi1 + MARGIN))
    cnt = tl.where(seen, h, tl.where(near | (tl.load(force_ptr + r) != 0), 1, 0))
    used = cnt > 0
    m = tl.sum(used.to(tl.int32), axis=0)
    leaf = tl.sort(tl.where(used, (cnt << 8) | r, 1 << 30))  # sorted leaves: (count, symbol)
    tl.store(scratch_ptr + LEAF + r, leaf >> 8)
    tl.store(scratch_ptr + PLEAF + r, tl.full([256], -1, tl.int32))
    tl.store(scratch_ptr + ANC + r, tl.full([256], -1, tl.int32))
    tl.debug_barrier()
    # two queues: li the next leaf, ii the next internal node, k internal nodes made
    li = tl.zeros([], tl.int32)
    ii = tl.zeros([], tl.int32)
    for k in range(0, m - 1):
        f = tl.zeros([], tl.int32)
        for _pick in tl.static_range(2):
            lf = tl.load(scratch_ptr + LEAF + li, mask=li < m, other=0)
            nf = tl.load(scratch_ptr + NODE + ii, mask=ii < k, other=0)
            take_leaf = (li < m) & ((ii >= k) | (lf <= nf))
            tl.store(scratch_ptr + PLEAF + li, k, mask=take_leaf)
            tl.store(scratch_ptr + ANC + ii, k, mask=~take_leaf)
            f += tl.where(take_leaf, lf, nf)
            li += take_leaf.to(tl.int32)
            ii += 1 - take_leaf.to(tl.int32)
        tl.store(scratch_ptr + NODE + k, f)
        tl.debug_barrier()  # node k is read by the next merge
    # depths of the internal nodes by pointer jumping (each doubles how far up a node has
    # looked: 8 rounds reach the root, m - 2, of any tree of <= 256 leaves), then of the leaves
    node = r < m - 1
    anc = tl.load(scratch_ptr + ANC + r)
    dist = tl.where(node & (anc >= 0), 1, 0)
    anc = tl.where(node & (anc >= 0), anc, r)  # the root, and what is no node, is its own ancestor
    for _round in tl.static_range(8):
        tl.store(scratch_ptr + ANC + r, anc)
        tl.store(scratch_ptr + DIST + r, dist)
        tl.debug_barrier()
        up = tl.load(scratch_ptr + ANC + anc)
        dist += tl.load(scratch_ptr + DIST + anc)
        anc = up
        tl.debug_barrier()
    tl.store(scratch_ptr + DIST + r, dist)
    tl.debug_barrier()
    d_leaf = tl.load(scratch_ptr + DIST + tl.load(scratch_ptr + PLEAF + r), mask=r < m, other=0) + 1
    d_leaf = tl.where(m == 1, 1, d_leaf)
    sym = (leaf & 255).to(tl.int32)
    lens_ptr = out_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + 16
    tl.store(lens_ptr + r, tl.zeros([256], tl.uint8))
    tl.debug_barrier()
    deepest = tl.max(tl.where(r < m, d_leaf, 0), axis=0)
    if deepest <= MAX_LEN:
        tl.store(lens_ptr + sym, d_leaf.to(tl.uint8), mask=r < m)
    else:
        # JPEG (T.81 Annex K.3) on the count of leaves per depth, then lengths by frequency. The
        # counts stay in registers: each step changes four of them (vector selects, no chain of
        # stores, barriers and loads through scratch) and reads two (reductions)
        bits = tl.histogram(d_leaf, 256, mask=r < m)
        for ii2 in range(0, deepest - MAX_LEN):
            i = deepest - ii2
            left = _at(bits, i, r)
            while left > 0:  # two leaves of depth i at a time; nothing below touches bits[i]
                # the deepest level above i - 1 with leaves
                j = tl.max(tl.where((r <= i - 2) & (bits != 0), r, -1), axis=0)
                bits += tl.where(r == i, -2, 0) + tl.where(r == i - 1, 1, 0) + tl.where(r == j + 1, 2, 0) \
                    + tl.where(r == j, -1, 0)
                left -= 2
        by_freq = tl.sort(tl.where(used, ((((1 << 22) - cnt) << 8) | r), 1 << 30))  # count down, symbol up
        ln = tl.zeros([256], tl.int32)
        below = tl.zeros([], tl.int32)
        for b in range(1, MAX_LEN + 1):
            nb = _at(bits, b, r)
            ln = tl.where((r >= below) & (r < below + nb), b, ln)
            below += nb
        tl.store(lens_ptr + (by_freq & 255).to(tl.int32), ln.to(tl.uint8), mask=r < m)
    tl.debug_barrier()
    # canonical codes, as DEFLATE: by (length, symbol), consecutive within a length
    ln = tl.load(lens_ptr + r).to(tl.int32)
    order = tl.sort(tl.where(ln > 0, (ln << 8) | r, 1 << 30))
    L = order >> 8
    s = order & 255
    code = tl.zeros([256], tl.int32)
    first = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)
    prev = tl.zeros([], tl.int32)
    for b in range(1, MAX_LEN + 1):
        first = (first + prev) << 1
        nb = tl.sum((L == b).to(tl.int32), axis=0)
        code = tl.where(L == b, first + r - start, code)
        start += nb
        prev = nb
    rev = tl.zeros([256], tl.int32)
    for b in tl.static_range(MAX_LEN):
        rev |= tl.where(b < L, ((code >> b) & 1) << tl.maximum(L - 1 - b, 0), 0)
    tl.store(table_ptr + r, tl.zeros([256], tl.int16))
    tl.debug_barrier()
    tl.store(table_ptr + s, ((rev << 4) | L).to(tl.int16), mask=r < m)
    tl.store(out_ptr + 34, _at(s, 0, r).to(tl.int64))


def host_code(lengths: np.ndarray, pad: int, device: torch.device) -> torch.Tensor:
    """The code buffer ``build_code`` writes, for a code the host built."""
    code = np.zeros(CODE_WORDS, dtype=np.int64)
    code.view(np.uint8)[LENGTHS_AT:LENGTHS_AT + 256] = lengths
    code[PAD_AT] = pad
    return torch.from_numpy(code).to(device)


def build_code(work: CodeWork, force: torch.Tensor, margin: int, max_len: int) -> None:
    """The code, built on the device from the sample's counts (``work.hist``) and the symbols that
    must have one (uint8[256]), into ``work.table`` and ``work.info``."""
    # 4 warps: the sorts and reductions are spread wider, and the code is built sooner than with one
    # warp for bf16 and fp32 samples alike (2 and 8 warps were in between when measured on the lent GPU)
    _build_code[(1,)](work.hist, force, work.info, work.table, work.scratch, MARGIN=margin, MAX_LEN=max_len,
                      num_warps=4)
