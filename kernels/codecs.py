"""The codec formats. Each is a pair: encode(tensor) -> (meta, buffers), decode(Encoded) -> tensor.

All of them are written in device-agnostic torch ops, so the same code encodes
on the CPU and on CUDA (where the hot loops dispatch to kernels.gpu) and data
encoded on one device decodes on the other. Every decoder checks the sizes it
reads (``require``) before indexing with them.

* ``raw``      the bytes as they are.
* ``ancf``     (a) ANCF as the source document describes it: a dictionary of the
               K-1 most frequent exact bit patterns, ceil(log2 K)-bit codes, code
               K-1 = escape; escaped values and their int32/int64 positions are
               compacted with the scan. Often larger than the input on dense
               activations: its true ratio is reported, never assumed.
* ``ancf_exp`` (b) the same idea on the symbol field of ``bits.split_fields``
               (bf16 sign+exponent byte, fp16/fp32 exponent): 15 entries + escape
               in 4-bit codes, raw field stored as is. Fixed-length: memory-bound.
* ``huff_exp`` (c) the symbol field Huffman-coded (kernels.entropy, one code per
               tensor, built from a strided sample: see ``_huff_counts``), raw
               field as is.
* ``zero``     (d) a 1-bit bitmap of "bit pattern is not all-zero" plus the
               non-zero elements compacted with the scan (-0.0 is non-zero).
* ``pack``     (e) tensors with at most 4 distinct bit patterns (bool masks,
               ternary {-1, 0, 1} tensors, 0/1 floats): a table of the patterns
               and 1- or 2-bit codes through kernels.bitpack.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from . import entropy
from .bitpack import pack_bits, unpack_bits
from .bits import bit_keys, flat_bytes, keys_to_tensor, merge_fields, raw_bits, raw_is_bytes, split_fields, symbol_field
from .format import Encoded, require
from .gpu import use_triton
from .scan import compact

Meta = dict
Buffers = dict[str, torch.Tensor]


class CodecNotApplicable(ValueError):
    """This codec cannot encode this tensor (e.g. ``pack`` on more than 4 distinct values)."""


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pos_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _read(buf: torch.Tensor, dtype: torch.dtype, count: int, what: str) -> torch.Tensor:
    size = dtype.itemsize
    require(buf.numel() == count * size, f"{what}: {buf.numel()} bytes, expected {count * size}")
    return buf.contiguous().view(dtype) if count else torch.empty(0, dtype=dtype, device=buf.device)


def _check_positions(pos: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """Escape positions must be in range and strictly increasing (so none is patched twice
    while another escape is left unpatched)."""
    pos = pos.to(torch.int64)
    if pos.numel():
        require(bool(((pos >= 0) & (pos < n)).all()), f"{what}: escape position out of range")
        require(bool((pos[1:] > pos[:-1]).all()), f"{what}: escape positions not strictly increasing")
    return pos


# ---------------------------------------------------------------- raw

def raw_encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    return {}, {"data": flat_bytes(t).clone()}


def raw_decode(e: Encoded) -> torch.Tensor:
    data = e.buffer("data")
    require(data.numel() == e.raw_nbytes, f"raw: {data.numel()} bytes for {e.raw_nbytes}")
    return data.view(e.dtype).reshape(e.shape) if e.numel else torch.empty(e.shape, dtype=e.dtype, device=data.device)


# ---------------------------------------------------------------- (a) ancf

def ancf_encode(t: torch.Tensor, entries: int = 256) -> tuple[Meta, Buffers]:
    if entries not in (128, 256, 512):
        raise ValueError(f"ANCF dictionary size must be 128, 256 or 512, got {entries}")
    width = entries.bit_length() - 1
    keys = bit_keys(t)
    n = keys.numel()
    uniq, counts = torch.unique(keys, return_counts=True)
    # most frequent first, ties by value (stable sort over the value-sorted uniques):
    # the same dictionary on every device
    order = torch.sort(counts, descending=True, stable=True).indices
    top = uniq[order[: entries - 1]]
    table = torch.sort(top).values
    idx = torch.searchsorted(table, keys).clamp_(max=max(table.numel() - 1, 0))
    hit = (table[idx] == keys) if table.numel() else torch.zeros_like(keys, dtype=torch.bool)
    codes = torch.where(hit, idx, torch.full_like(idx, entries - 1))
    miss = ~hit
    pos, vals = compact(miss, torch.arange(n, device=keys.device, dtype=_pos_dtype(n)), keys)
    meta = {"entries": entries, "dict_len": int(table.numel()), "escapes": int(pos.numel())}
    return meta, {
        "dict": _as_bytes(keys_to_tensor(table, t.dtype, (table.numel(),))),
        "codes": pack_bits(codes, width),
        "esc_pos": _as_bytes(pos),
        "esc_val": _as_bytes(keys_to_tensor(vals, t.dtype, (vals.numel(),))),
    }


def ancf_decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    entries = e.meta_int("entries", 128, 512)
    require(entries in (128, 256, 512), f"ancf: dictionary size {entries}")
    dict_len = e.meta_int("dict_len", 0, entries - 1)
    esc = e.meta_int("escapes", 0, n)
    table = bit_keys(_read(e.buffer("dict"), e.dtype, dict_len, "ancf dictionary"))
    codes = unpack_bits(e.buffer("codes"), entries.bit_length() - 1, n)
    pos = _check_positions(_read(e.buffer("esc_pos"), _pos_dtype(n), esc, "ancf escape positions"), n, "ancf")
    vals = bit_keys(_read(e.buffer("esc_val"), e.dtype, esc, "ancf escape values"))
    is_esc = codes == entries - 1
    require(bool((codes[~is_esc] < dict_len).all()) if n else True, "ancf: code beyond the dictionary")
    require(int(is_esc.sum()) == esc, "ancf: escape codes and escape list disagree")
    out = table[codes.clamp(max=max(dict_len - 1, 0))] if dict_len else torch.zeros(n, dtype=torch.int64, device=codes.device)
    out[pos] = vals
    require(bool(is_esc[pos].all()) if esc else True, "ancf: escape position on a non-escape code")
    return keys_to_tensor(out, e.dtype, e.shape)


# ---------------------------------------------------------------- (b) ancf_exp

EXP_ENTRIES = 15  # + escape code 15: 4-bit codes


def _raw_field_encode(raw: torch.Tensor, rbits: int, dtype: torch.dtype) -> torch.Tensor:
    if raw_is_bytes(dtype):
        return raw.reshape(-1)
    return pack_bits(raw, rbits)


def _raw_field_decode(buf: torch.Tensor, rbits: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    if raw_is_bytes(dtype):
        require(buf.numel() == n * (rbits // 8), f"raw field: {buf.numel()} bytes for {n} values")
        return buf
    return unpack_bits(buf, rbits, n)


# dtypes whose split the fused Triton kernels do in registers (kernels.gpu.pack)
_FUSED_EXP = (torch.bfloat16, torch.int16, torch.float32)
_TABLE_SAMPLE = 1 << 20


def _sample_symbol_hist(t: torch.Tensor) -> np.ndarray:
    """Histogram (int64[256]) of the symbol field over every ``stride``-th element, the same
    elements on every device (stride = numel // 2**20, at least 1)."""
    flat = t.contiguous().reshape(-1)
    if use_triton(flat) and t.dtype in _FUSED_EXP:
        return _device_symbol_hist(flat).cpu().numpy().astype(np.int64)
    sym = symbol_field(flat[::_sample_stride(flat)].contiguous())
    return torch.bincount(sym.to(torch.int32), minlength=256).cpu().numpy().astype(np.int64)


def _sample_stride(t: torch.Tensor) -> int:
    return max(1, t.numel() // _TABLE_SAMPLE)


def _device_symbol_hist(flat: torch.Tensor) -> torch.Tensor:
    """``_sample_symbol_hist`` of a flat CUDA bf16/int16/fp32 tensor, left on the device (int32)."""
    from .gpu.pack import sample_histogram
    return sample_histogram(flat, _sample_stride(flat))


def _exp_table(hist: np.ndarray) -> np.ndarray:
    """The EXP_ENTRIES most frequent symbols of a sample histogram (ties by symbol).

    A sample suffices: symbols it misses are escapes, never errors; and CPU and
    GPU pick the same table, so both produce the same bytes.
    """
    top = np.argsort(-hist, kind="stable")[:EXP_ENTRIES]
    return top[hist[top] > 0].astype(np.uint8)


def ancf_exp_encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    if t.dtype == torch.float64:
        raise CodecNotApplicable("ancf_exp: float64 is not split; use zero, ancf or raw")
    n = t.numel()
    hist = _sample_symbol_hist(t) if n else np.zeros(256, dtype=np.int64)
    top = _exp_table(hist)
    lut_np = np.full(256, EXP_ENTRIES, dtype=np.int32)
    lut_np[top] = np.arange(len(top), dtype=np.int32)
    lut = torch.from_numpy(lut_np).to(t.device)
    if use_triton(t) and t.dtype in _FUSED_EXP and n:
        from .gpu.pack import dict4_encode
        missed = 1.0 - hist[top.astype(np.int64)].sum() / max(1, hist.sum())
        codes_packed, raw_b, pos, esc_sym = dict4_encode(t, lut, _pos_dtype(n), int(missed * n))
    else:
        sym, raw, rbits = split_fields(t)
        codes = lut[sym.to(torch.int64)]
        miss = codes == EXP_ENTRIES
        codes_packed = pack_bits(codes, 4)
        pos, esc_sym = compact(miss, torch.arange(n, device=t.device, dtype=_pos_dtype(n)), sym)
        raw_b = _raw_field_encode(raw, rbits, t.dtype)
    meta = {"table": top.tobytes(), "escapes": int(pos.numel())}
    return meta, {"codes": codes_packed, "esc_pos": _as_bytes(pos), "esc_sym": esc_sym, "raw": raw_b}


def ancf_exp_decode(e: Encoded) -> torch.Tensor:
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
    pos = _read(e.buffer("esc_pos"), _pos_dtype(n), esc, "ancf_exp escape positions")
    esc_sym = e.buffer("esc_sym")
    require(esc_sym.numel() == esc, "ancf_exp: escape symbol count")
    rbits = raw_bits(e.dtype)
    raw_b = e.buffer("raw")
    if use_triton(codes_b) and e.dtype in _FUSED_EXP and n:
        from .gpu.pack import dict4_decode
        require(raw_b.numel() == n * (rbits // 8), f"ancf_exp: raw field has {raw_b.numel()} bytes for {n} values")
        words, (n_esc, bad, outside) = dict4_decode(codes_b, raw_b, lut, n, len(table), e.dtype, pos, esc_sym)
        require(not outside, "ancf_exp: escape position out of range, repeated or not on an escape code")
        require(not bad, "ancf_exp: code beyond the dictionary")
        require(n_esc == esc, "ancf_exp: escape codes and escape list disagree")
        return words.view(e.dtype).reshape(e.shape)
    pos = _check_positions(pos, n, "ancf_exp")
    raw = _raw_field_decode(raw_b, rbits, e.dtype, n)
    codes = unpack_bits(codes_b, 4, n)
    is_esc = codes == EXP_ENTRIES
    require(not bool(((codes >= len(table)) & ~is_esc).any()), "ancf_exp: code beyond the dictionary")
    require(int(is_esc.sum()) == esc, "ancf_exp: escape codes and escape list disagree")
    require(bool(is_esc[pos].all()) if esc else True, "ancf_exp: escape position on a non-escape code")
    sym = lut[codes.clamp(max=15)]
    sym[pos] = esc_sym
    return merge_fields(sym, raw, e.dtype, e.shape)


# ---------------------------------------------------------------- (c) huff_exp

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
    one, is found while encoding (``huff_exp_encode``). The same counts on every device
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


def huff_exp_encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    if t.dtype == torch.float64:
        raise CodecNotApplicable("huff_exp: float64 is not split; use zero, ancf or raw")
    n = t.numel()
    if use_triton(t) and t.dtype in _FUSED_EXP and n:
        # the code is built on the device and the encoder splits the fields itself: the
        # host waits once, for the stream's length
        stride = _sample_stride(t)  # its size is all that counts: no flattened copy of a strided t
        force = _forced_on_device(t.dtype, t.device)
        out = entropy.encode_fields(t, stride, force, HUFF_MARGIN)
        if out is None:  # the tensor holds a symbol the code left out: give every symbol present one
            out = entropy.encode_fields(t, stride, force | _present(t).to(torch.uint8), HUFF_MARGIN)
            assert out is not None, "huff_exp: every symbol present has a code"
        stream, lane_bits, raw_b, lengths = out
    else:
        sym, raw, rbits = split_fields(t)
        raw_b = _raw_field_encode(raw, rbits, t.dtype)
        if n == 0:
            empty = torch.empty(0, dtype=torch.uint8, device=t.device)
            return {"lengths": bytes(256)}, {"stream": empty, "lane_bits": empty, "raw": raw_b}
        counts = _huff_counts(_sample_symbol_hist(t), t.dtype)
        lengths = entropy.code_lengths(counts)
        out = entropy.encode(sym, lengths)
        if out is None:
            counts[_present(t).cpu().numpy() & (counts == 0)] = 1
            lengths = entropy.code_lengths(counts)
            out = entropy.encode(sym, lengths)
            assert out is not None, "huff_exp: every symbol present has a code"
        stream, lane_bits = out
    return {"lengths": lengths.tobytes()}, {"stream": stream, "lane_bits": lane_bits, "raw": raw_b}


def huff_exp_decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    require(e.dtype != torch.float64, "huff_exp: float64 is never encoded by this codec")
    lengths = np.frombuffer(e.meta_bytes("lengths", 256), dtype=np.uint8)
    rbits = raw_bits(e.dtype)
    raw_b = e.buffer("raw")
    if n == 0:
        require(raw_b.numel() == 0, "huff_exp: raw bytes for an empty tensor")
        return torch.empty(e.shape, dtype=e.dtype, device=raw_b.device)
    stream = e.buffer("stream")
    if use_triton(stream) and e.dtype in _FUSED_EXP:
        require(raw_b.numel() == n * (rbits // 8), f"huff_exp: raw field has {raw_b.numel()} bytes for {n} values")
        if entropy.can_merge(n):  # symbols and raw bytes joined inside the decoder
            return entropy.decode(stream, e.buffer("lane_bits"), lengths, n, raw_b, e.dtype).reshape(e.shape)
        from .gpu.huffman import merge
        return merge(entropy.decode(stream, e.buffer("lane_bits"), lengths, n), raw_b, e.dtype).reshape(e.shape)
    sym = entropy.decode(stream, e.buffer("lane_bits"), lengths, n)
    return merge_fields(sym, _raw_field_decode(raw_b, rbits, e.dtype, n), e.dtype, e.shape)


# ---------------------------------------------------------------- (d) zero

def _native(t: torch.Tensor) -> torch.Tensor:
    """The flat elements as signed integers of their own width (bool as uint8): the bit
    patterns, without widening to int64."""
    return flat_bytes(t).view(_INT_VIEW[t.element_size()])


def zero_encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    v = _native(t)
    nz = v != 0
    (vals,) = compact(nz, v)
    return {"nonzeros": int(vals.numel())}, {"bitmap": pack_bits(nz, 1), "values": _as_bytes(vals)}


def zero_decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    nnz = e.meta_int("nonzeros", 0, n)
    itype = _INT_VIEW[e.dtype.itemsize]
    nz = unpack_bits(e.buffer("bitmap"), 1, n).to(torch.bool)
    vals = _read(e.buffer("values"), itype, nnz, "zero: values")
    require(int(nz.sum()) == nnz, "zero: bitmap population does not match the value count")
    out = torch.zeros(n, dtype=itype, device=nz.device)
    out[nz] = vals
    return out.view(e.dtype).reshape(e.shape)


# ---------------------------------------------------------------- (e) pack

def _distinct_upto4(v: torch.Tensor) -> torch.Tensor | None:
    """The sorted distinct values of v if there are at most 4, else None.

    One-byte tensors: a 256-bin histogram. Wider ones: the distinct values of a
    strided sample, confirmed on the whole tensor; a full sort only when the
    sample missed a value.
    """
    if v.element_size() == 1:
        hist = torch.bincount(v.view(torch.uint8).to(torch.int32), minlength=256)
        present = torch.nonzero(hist).reshape(-1)
        if present.numel() > 4:
            return None
        return present.to(torch.uint8).view(v.dtype).sort().values
    cand = torch.unique(v[:: max(1, v.numel() // 65536)])
    if cand.numel() <= 4:
        idx = torch.searchsorted(cand, v).clamp_(max=cand.numel() - 1)
        if bool((cand[idx] == v).all()):
            return cand
    table = torch.unique(v)
    return table if table.numel() <= 4 else None


def pack_encode(t: torch.Tensor) -> tuple[Meta, Buffers]:
    v = _native(t)
    table = _distinct_upto4(v) if v.numel() else v[:0]
    if table is None:
        raise CodecNotApplicable("pack: more than 4 distinct values")
    width = 1 if table.numel() <= 2 else 2
    codes = torch.searchsorted(table, v) if table.numel() > 1 else torch.zeros_like(v, dtype=torch.int64)
    return {"width": width, "table_len": int(table.numel())}, {"table": _as_bytes(table), "codes": pack_bits(codes, width)}


def pack_decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    width = e.meta_int("width", 1, 2)
    tlen = e.meta_int("table_len", 0, 1 << width)
    require(n == 0 or tlen > 0, "pack: empty table for a non-empty tensor")
    table = _read(e.buffer("table"), _INT_VIEW[e.dtype.itemsize], tlen, "pack: table")
    codes = unpack_bits(e.buffer("codes"), width, n)
    require(n == 0 or int(codes.max()) < tlen, "pack: code beyond the table")
    out = table[codes] if n else table[:0]
    return out.view(e.dtype).reshape(e.shape)


CODECS: dict[str, tuple[Callable[[torch.Tensor], tuple[Meta, Buffers]], Callable[[Encoded], torch.Tensor]]] = {
    "raw": (raw_encode, raw_decode),
    "ancf": (ancf_encode, ancf_decode),
    "ancf_exp": (ancf_exp_encode, ancf_exp_decode),
    "huff_exp": (huff_exp_encode, huff_exp_decode),
    "zero": (zero_encode, zero_decode),
    "pack": (pack_encode, pack_decode),
}
