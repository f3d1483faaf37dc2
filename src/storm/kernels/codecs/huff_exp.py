"""``huff_exp`` (codec c): the symbol field Huffman-coded (kernels.huffman: one code per
tensor, built from the counts of a strided sample, see ``_huff_counts``), the raw field as
is (kernels.codecs.fields). On CUDA, for the dtypes in ``fields.FUSED``, the code is built
on the device and the encoder reads the elements themselves (kernels.huffman.encode_fields).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .. import huffman
from ..bits import merge_fields, raw_bits, split_fields, symbol_field
from ..container import Encoded, require
from ..gpu import use_triton
from .base import Buffers, CodecNotApplicable, Meta
from .fields import FUSED, raw_field_decode, raw_field_encode, sample_stride, sample_symbol_hist

HUFF_MARGIN = 8  # symbols past the sample's range, each side of each sign half, that get a code too


@functools.lru_cache(maxsize=None)
def _special_symbols(dtype: torch.dtype) -> np.ndarray:
    """The symbols of zero and of the extremes (floats: +-0, +-inf; integers: 0, -1)."""
    special = [0.0, -0.0, float("inf"), float("-inf")] if dtype.is_floating_point else [0, -1]
    return symbol_field(torch.tensor(special).to(dtype)).to(torch.int64).numpy()


@functools.lru_cache(maxsize=None)
def _forced_on_device(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``_special_symbols`` as a uint8[256] mask on ``device``, for the device's code builder."""
    mask = np.zeros(256, dtype=np.uint8)
    mask[_special_symbols(dtype)] = 1
    return torch.from_numpy(mask).to(device)


def _huff_counts(hist: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Counts to build the code from: the sample's, and 1 for symbols it missed that the
    tensor may well hold: within HUFF_MARGIN of the range the sample covers in each half
    (sign bit clear / set: the rarer, smaller exponents of a distribution's tail) and the
    symbols of zero and of the extremes. A symbol outside all of these, if the tensor has
    one, is found while encoding (``encode``). The same counts on every device
    (kernels.gpu.huffman.build_code makes them on the GPU)."""
    counts = hist.astype(np.int64).copy()
    floor = np.zeros(256, dtype=bool)
    for half in (0, 128):
        seen = np.flatnonzero(hist[half:half + 128])
        if len(seen):
            floor[half + max(0, int(seen[0]) - HUFF_MARGIN): half + min(127, int(seen[-1]) + HUFF_MARGIN) + 1] = True
    floor[_special_symbols(dtype)] = True
    counts[floor & (counts == 0)] = 1
    return counts


def _present(t: torch.Tensor) -> torch.Tensor:
    """Which of the 256 symbols ``t`` holds (bool[256], on t's device): a full pass, only
    when a code built from the sample missed one."""
    return torch.bincount(symbol_field(t.contiguous().reshape(-1)).to(torch.int32), minlength=256) > 0


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    if t.dtype == torch.float64:
        raise CodecNotApplicable("huff_exp: float64 is not split; use zero, ancf or raw")
    n = t.numel()
    if use_triton(t) and t.dtype in FUSED and n:
        # the code is built on the device and the encoder splits the fields itself: the
        # host waits once, for the stream's length
        stride = sample_stride(t)  # its size is all that counts: no flattened copy of a strided t
        force = _forced_on_device(t.dtype, t.device)
        out = huffman.encode_fields(t, stride, force, HUFF_MARGIN)
        if out is None:  # the tensor holds a symbol the code left out: give every symbol present one
            out = huffman.encode_fields(t, stride, force | _present(t).to(torch.uint8), HUFF_MARGIN)
            assert out is not None, "huff_exp: every symbol present has a code"
        stream, lane_bits, raw_b, lengths = out
    else:
        sym, raw, rbits = split_fields(t)
        raw_b = raw_field_encode(raw, rbits, t.dtype)
        if n == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=t.device)
            return {"lengths": bytes(256)}, {"stream": empty, "lane_bits": empty, "raw": raw_b}
        counts = _huff_counts(sample_symbol_hist(t), t.dtype)
        lengths = huffman.code_lengths(counts)
        out = huffman.encode(sym, lengths)
        if out is None:
            counts[_present(t).cpu().numpy() & (counts == 0)] = 1
            lengths = huffman.code_lengths(counts)
            out = huffman.encode(sym, lengths)
            assert out is not None, "huff_exp: every symbol present has a code"
        stream, lane_bits = out
    return {"lengths": lengths.tobytes()}, {"stream": stream, "lane_bits": lane_bits, "raw": raw_b}


def decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    require(e.dtype != torch.float64, "huff_exp: float64 is never encoded by this codec")
    lengths = np.frombuffer(e.meta_bytes("lengths", 256), dtype=np.uint8)
    rbits = raw_bits(e.dtype)
    raw_b = e.buffer("raw")
    if n == 0:
        require(raw_b.numel() == 0, "huff_exp: raw bytes for an empty tensor")
        return torch.empty(e.shape, dtype=e.dtype, device=raw_b.device)
    stream = e.buffer("stream")
    if use_triton(stream) and e.dtype in FUSED:
        require(raw_b.numel() == n * (rbits // 8), f"huff_exp: raw field has {raw_b.numel()} bytes for {n} values")
        if huffman.can_merge(n):  # symbols and raw bytes joined inside the decoder
            return huffman.decode(stream, e.buffer("lane_bits"), lengths, n, raw_b, e.dtype).reshape(e.shape)
        from ..gpu.huffman import merge
        return merge(huffman.decode(stream, e.buffer("lane_bits"), lengths, n), raw_b, e.dtype).reshape(e.shape)
    sym = huffman.decode(stream, e.buffer("lane_bits"), lengths, n)
    return merge_fields(sym, raw_field_decode(raw_b, rbits, e.dtype, n), e.dtype, e.shape)

