"""``ancf`` (codec a): ANCF as the source document describes it, on exact bit patterns.

A dictionary of the K-1 most frequent bit patterns (K = 128, 256 or 512),
ceil(log2 K)-bit codes, code K-1 = escape; the escaped values and their
positions are compacted with the scan (kernels.scan). Often larger than its
input on dense activations: its true ratio is reported, never assumed.
"""
from __future__ import annotations

import torch

from ..bitpack import pack_bits, unpack_bits
from ..bits import bit_keys, keys_to_tensor
from ..container import Encoded, require
from ..scan import compact
from .base import Buffers, Meta, as_bytes, check_positions, pos_dtype, read


def encode(t: torch.Tensor, entries: int = 256) -> tuple[Meta, Buffers]:
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
    pos, vals = compact(miss, torch.arange(n, device=keys.device, dtype=pos_dtype(n)), keys)
    meta = {"entries": entries, "dict_len": int(table.numel()), "escapes": int(pos.numel())}
    return meta, {
        "dict": as_bytes(keys_to_tensor(table, t.dtype, (table.numel(),))),
        "codes": pack_bits(codes, width),
        "esc_pos": as_bytes(pos),
        "esc_val": as_bytes(keys_to_tensor(vals, t.dtype, (vals.numel(),))),
    }


def decode(e: Encoded) -> torch.Tensor:
    n = e.numel
    entries = e.meta_int("entries", 128, 512)
    require(entries in (128, 256, 512), f"ancf: dictionary size {entries}")
    dict_len = e.meta_int("dict_len", 0, entries - 1)
    esc = e.meta_int("escapes", 0, n)
    table = bit_keys(read(e.buffer("dict"), e.dtype, dict_len, "ancf dictionary"))
    codes = unpack_bits(e.buffer("codes"), entries.bit_length() - 1, n)
    pos = check_positions(read(e.buffer("esc_pos"), pos_dtype(n), esc, "ancf escape positions"), n, "ancf")
    vals = bit_keys(read(e.buffer("esc_val"), e.dtype, esc, "ancf escape values"))
    is_esc = codes == entries - 1
    require(bool((codes[~is_esc] < dict_len).all()) if n else True, "ancf: code beyond the dictionary")
    require(int(is_esc.sum()) == esc, "ancf: escape codes and escape list disagree")
    out = (table[codes.clamp(max=max(dict_len - 1, 0))] if dict_len
           else torch.zeros(n, dtype=torch.int64, device=codes.device))
    out[pos] = vals
    require(bool(is_esc[pos].all()) if esc else True, "ancf: escape position on a non-escape code")
    return keys_to_tensor(out, e.dtype, e.shape)

