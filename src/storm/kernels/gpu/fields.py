"""The (symbol, raw) field split of kernels.bits in registers, for bf16/int16 and fp32, and the
histogram of the symbol field over a strided sample (kernels.codecs.fields' on the host): what
the exponent codecs' kernels (kernels.gpu.ancf_exp, kernels.gpu.huffman) read elements through."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv
from .launch import Launcher

SAMPLE_BLOCK = 4096    # sampled elements a program of _sample_hist takes
SAMPLE_WARPS = 8       # more warps than the other kernels: fewer were slower when measured


@triton.jit
def split_word(w, W: tl.constexpr):
    # (symbol, raw) of each element: bf16/int16 = (high byte, low byte);
    # fp32 = (exponent, sign<<23 | mantissa)
    if W == 2:
        return (w >> 8) & 0xFF, w & 0xFF
    else:
        return (w >> 23) & 0xFF, (w & 0x7FFFFF) | (((w >> 31) & 1) << 23)


@Launcher
@triton.jit
def _sample_hist(x_ptr, hist_ptr, stride, m, W: tl.constexpr, BLOCK: tl.constexpr):
    # histogram of the symbols of elements 0, stride, 2*stride, ... (m of them)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < m
    s, _ = split_word(tl.load(x_ptr + j * stride, mask=ok, other=0).to(tl.int32), W)
    tl.atomic_add(hist_ptr + tl.arange(0, 256), tl.histogram(s, 256, mask=ok), sem="relaxed")


def word_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t``'s elements as flat 16- or 32-bit words, and their width in bytes."""
    w = t.element_size()
    return t.contiguous().reshape(-1).view(torch.int16 if w == 2 else torch.int32), w


def sample_histogram(t: torch.Tensor, stride: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32[256] histogram of the symbols of every ``stride``-th element (bf16/int16/fp32), added
    into ``out`` (zeroed by the caller) when given."""
    x, w = word_view(t)
    m = -(-x.numel() // stride)
    hist = torch.zeros(256, dtype=torch.int32, device=x.device) if out is None else out
    _sample_hist[(cdiv(m, SAMPLE_BLOCK),)](x, hist, stride, m, W=w, BLOCK=SAMPLE_BLOCK, num_warps=SAMPLE_WARPS)
    return hist
