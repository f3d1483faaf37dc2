"""``ancf_exp`` (codec b): a 15-entry dictionary of the symbol field (kernels.bits.split_fields:
bf16's sign and exponent byte, fp16/fp32's exponent) in 4-bit codes, code 15 = escape; the
raw field stored as is (kernels.codecs.fields). Fixed-length, so memory-bound. On CUDA the
dtypes in ``fields.FUSED`` go through the fused kernels of kernels.gpu.ancf_exp, whose
output is this torch path's, byte for byte.
"""
from __future__ import annotations

import numpy as np
import torch

from ..bitpack import pack_bits, unpack_bits
from ..bits import merge_fields, raw_bits, split_fields
from ..container import Encoded, require
from ..gpu import use_triton
from ..scan import compact
from .base import Buffers, CodecNotApplicable, Meta, as_bytes, check_positions, pos_dtype, read
from .fields import FUSED, raw_field_decode, raw_field_encode, sample_symbol_hist

EXP_ENTRIES = 15  # + escape code 15: 4-bit codes


def _exp_table(hist: np.ndarray) -> np.ndarray:
    """The EXP_ENTRIES most frequent symbols of a sample histogram (ties by symbol).

    A sample suffices: symbols it misses are escapes, never errors; and CPU and
    GPU pick the same table, so both produce the same bytes.
    """
    top = np.argsort(-hist, kind="stable")[:EXP_ENTRIES]
    return top[hist[top] > 0].astype(np.uint8)


def encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    if t.dtype == torch.float64:
        raise CodecNotApplicable("ancf_exp: float64 is not split; use zero, ancf or raw")
    n = t.numel()
    hist = sample_symbol_hist(t) if n else np.zeros(256, dtype=np.int64)
    top = _exp_table(hist)
    lut_np = np.full(256, EXP_ENTRIES, dtype=np.int32)
    lut_np[top] = np.arange(len(top), dtype=np.int32)
    lut = torch.from_numpy(lut_np).to(t.device)
    if use_triton(t) and t.dtype in FUSED and n:
        from ..gpu.ancf_exp import dict4_encode
        missed = 1.0 - hist[top.astype(np.int64)].sum() / max(1, hist.sum())
        codes_packed, raw_b, pos, esc_sym = dict4_encode(t, lut, pos_dtype(n), int(missed * n))
    else:
        sym, raw, rbits = split_fields(t)
        codes = lut[sym.to(torch.int64)]
        miss = codes == EXP_ENTRIES
        codes_packed = pack_bits(codes, 4)
        pos, esc_sym = compact(miss, torch.arange(n, device=t.device, dtype=pos_dtype(n)), sym)
        raw_b = raw_field_encode(raw, rbits, t.dtype)
    meta = {"table": top.tobytes(), "escapes": int(pos.numel())}
    return meta, {"codes": codes_packed, "esc_pos": as_bytes(pos), "esc_sym": esc_sym, "raw": raw_b}


def decode(e: Encoded) -> torch.Tensor:
    require(e.dtype != torch.float64, "ancf_exp: float64 is never encoded by this codec")
    n = e.numel
    table = e.meta_bytes("table")
    require(len(table) <= EXP_ENTRIES, "ancf_exp: dictionary longer than 15 entries")
    esc = e.meta_int("escapes", 0, n)
    codes_b = e.buffer("codes")
    require(codes_b.numel() == (n + 1) // 2, f"ancf_exp: {codes_b.numel()} code bytes for {n} values")
    dev = codes_b.device
    lut = torch.zeros(16, dtype=torch.uint8, device=dev)
    if table:
        lut[: len(table)] = torch.frombuffer(bytearray(table), dtype=torch.uint8).to(dev)
    pos = read(e.buffer("esc_pos"), pos_dtype(n), esc, "ancf_exp escape positions")
    esc_sym = e.buffer("esc_sym")
    require(esc_sym.numel() == esc, "ancf_exp: escape symbol count")
    rbits = raw_bits(e.dtype)
    raw_b = e.buffer("raw")
    if use_triton(codes_b) and e.dtype in FUSED and n:
        from ..gpu.ancf_exp import dict4_decode
        require(raw_b.numel() == n * (rbits // 8), f"ancf_exp: raw field has {raw_b.numel()} bytes for {n} values")
        words, (n_esc, bad, outside) = dict4_decode(codes_b, raw_b, lut, n, len(table), e.dtype, pos, esc_sym)
        require(not outside, "ancf_exp: escape position out of range, repeated or not on an escape code")
        require(not bad, "ancf_exp: code beyond the dictionary")
        require(n_esc == esc, "ancf_exp: escape codes and escape list disagree")
        return words.view(e.dtype).reshape(e.shape)
    pos = check_positions(pos, n, "ancf_exp")
    raw = raw_field_decode(raw_b, rbits, e.dtype, n)
    codes = unpack_bits(codes_b, 4, n)
    is_esc = codes == EXP_ENTRIES
    require(not bool(((codes >= len(table)) & ~is_esc).any()), "ancf_exp: code beyond the dictionary")
    require(int(is_esc.sum()) == esc, "ancf_exp: escape codes and escape list disagree")
    require(bool(is_esc[pos].all()) if esc else True, "ancf_exp: escape position on a non-escape code")
    sym = lut[codes.clamp(max=15)]
    sym[pos] = esc_sym
    return merge_fields(sym, raw, e.dtype, e.shape)

