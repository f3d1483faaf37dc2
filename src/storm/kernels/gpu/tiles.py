"""Groups of 4 words as a (G, 4) tile and their 4-bit codes, two a byte: the layout that codec
b's kernels (kernels.gpu.ancf_exp) and the frame kernels (kernels.gpu.frame) share. Each thread
holds 4 contiguous words, so its loads and stores are contiguous."""
from __future__ import annotations

import triton
import triton.language as tl

WARPS = 4  # warps a program of the (G, 4)-tile kernels


@triton.jit
def tile_groups(block, G: tl.constexpr):
    # block's G groups of 4 words: the words' indices as a (G, 4) tile (each thread's 4 contiguous)
    # and their 4-bit codes' byte indices as a (G, 2) tile
    g = tl.cast(block, tl.int64) * G + tl.arange(0, G)
    return g[:, None] * 4 + tl.arange(0, 4)[None, :], g[:, None] * 2 + tl.arange(0, 2)[None, :]


@triton.jit
def pack_codes(c, G: tl.constexpr):
    # (G, 4) codes of 4 bits -> (G, 2) bytes, the lower code in the low nibble
    lo, hi = tl.split(tl.reshape(c, (G, 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def unpack_codes(cb, G: tl.constexpr):
    # (G, 2) bytes (int32) -> (G, 4) codes
    return tl.reshape(tl.join(cb & 15, cb >> 4), (G, 4))
