"""The codecs by name (``CODECS``, the names on the wire), and the public calls that pick one:
``encode``, ``decode`` and the ``auto`` choice."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from . import huffman
from .bits import bit_keys, keys_to_tensor, split_fields
from .codecs import ancf, ancf_exp, huff_exp, pack, raw, zero, zstd
from .codecs.base import Buffers, CodecNotApplicable, Meta
from .container import DTYPE_NAMES, CorruptEncodedError, Encoded, require

# Each codec's (encode, decode), by the name its data carries (stormd.protocol.CODECS lists
# the same names: a test keeps the two equal).
CODECS: dict[str, tuple[Callable[..., tuple[Meta, Buffers]], Callable[[Encoded], torch.Tensor]]] = {
    "raw": (raw.encode, raw.decode),
    "ancf": (ancf.encode, ancf.decode),
    "ancf_exp": (ancf_exp.encode, ancf_exp.decode),
    "huff_exp": (huff_exp.encode, huff_exp.decode),
    "zero": (zero.encode, zero.decode),
    "pack": (pack.encode, pack.decode),
    "zstd": (zstd.encode, zstd.decode),
}

AUTO_MIN_SAVING = 0.05     # auto stores raw unless a codec saves at least 5 % of the bytes
AUTO_MIN_BYTES = 4096      # below this the fixed header outweighs any saving
SAMPLE = 1 << 16           # elements sampled by auto to estimate each codec's size

# Encode throughput of each codec on a GPU, in GB/s of input, rounded down: data
# that drives ``auto``'s choice, from bench/codec.py's runs on large tensors (for
# huff_exp the lowest of its runs and of the nvCOMP comparison); docs/results.md
# ("Codecs and kernels") has the latest run, its device and how to repeat it.
# Only the order matters to a choice, so the table is updated when that changes.
# ``encode(..., min_gbps=x)`` lets ``auto`` pick only codecs at or above x.
# These are GPU figures: on the CPU every codec is far slower and only the
# order is indicative.
ENCODE_GBPS = {"raw": 1000.0, "ancf_exp": 250.0, "huff_exp": 180.0, "zero": 35.0, "pack": 9.0, "ancf": 9.0,
               "zstd": 0.0}  # host only (zstandard on the CPU): never picked where a rate is asked for


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _sample(flat: torch.Tensor) -> torch.Tensor:
    n = flat.numel()
    if n <= SAMPLE:
        return flat
    # blocks of 256 consecutive elements spread over the tensor: catches both
    # the value distribution and runs of zeros
    blocks = SAMPLE // 256
    starts = torch.linspace(0, n - 256, blocks, device=flat.device).to(torch.int64)
    return flat[(starts[:, None] + torch.arange(256, device=flat.device)).reshape(-1)]


def estimate_sizes(t: torch.Tensor) -> dict[str, float]:
    """Estimated bytes per element of each applicable codec, from a sample of ``t``."""
    w = t.element_size()
    keys = bit_keys(_sample(t.contiguous().reshape(-1)))  # sample first: never widen the whole tensor
    m = keys.numel()
    est = {"raw": float(w)}
    distinct = torch.unique(keys)
    if distinct.numel() <= 4:
        est["pack"] = (1 if distinct.numel() <= 2 else 2) / 8
    est["zero"] = 1 / 8 + w * float((keys != 0).sum()) / m
    if t.dtype != torch.float64:
        sym, _, rbits = split_fields(keys_to_tensor(keys, t.dtype, (m,)))
        hist = torch.bincount(sym.to(torch.int64), minlength=256).cpu().numpy()
        lengths = huffman.code_lengths(hist)
        est["huff_exp"] = float((hist * lengths).sum()) / m / 8 + rbits / 8 + 2 / huffman.LANE_STEPS
        esc = 1.0 - float(np.sort(hist)[::-1][:ancf_exp.EXP_ENTRIES].sum()) / m
        pos_bytes = 4 if t.numel() < 2**31 else 8
        est["ancf_exp"] = 0.5 + rbits / 8 + esc * (1 + pos_bytes)
    if t.device.type == "cpu":  # zstd on byte planes, compressed for real on the same sample
        est["zstd"] = zstd.compressed_nbytes(_sample(t.contiguous().reshape(-1))) / m
    return est


def choose_codec(t: torch.Tensor, min_gbps: float = 0.0) -> str:
    """The codec ``auto`` would use for ``t``: smallest estimate among codecs whose measured
    encode rate (ENCODE_GBPS) is at least ``min_gbps``, or ``raw`` when none saves
    AUTO_MIN_SAVING."""
    return _pick(_fast_enough(estimate_sizes(t), min_gbps), t.element_size()) if _worth_coding(t) else "raw"


def _worth_coding(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() >= AUTO_MIN_BYTES


def _fast_enough(est: dict[str, float], min_gbps: float) -> dict[str, float]:
    return {k: v for k, v in est.items() if k == "raw" or ENCODE_GBPS[k] >= min_gbps}


def _pick(est: dict[str, float], width: int) -> str:
    """The smallest estimate (bytes per element), or raw unless it saves AUTO_MIN_SAVING."""
    best = min(est, key=est.get)
    return best if est[best] <= (1 - AUTO_MIN_SAVING) * width else "raw"


def encode(t: torch.Tensor, codec: str = "auto", *, min_gbps: float = 0.0, entries: int = 256) -> Encoded:
    """Encode ``t`` (any device, any strides) losslessly.

    ``codec``: one of CODECS or ``"auto"``. ``entries`` is the ANCF dictionary
    size (codec ``ancf`` only). Raises ``CodecNotApplicable`` (a ValueError)
    when a named codec cannot encode this tensor. ``auto`` never returns an
    encoding whose payload is larger than the raw bytes.
    """
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {t.dtype}")
    t0 = time.perf_counter()
    src = t.detach()
    est = _fast_enough(estimate_sizes(src), min_gbps) if codec == "auto" and _worth_coding(src) else {}
    chosen = codec if codec != "auto" else _pick(est, src.element_size()) if est else "raw"
    if chosen not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: auto, {', '.join(CODECS)}")
    try:
        meta, bufs = CODECS[chosen][0](src, entries) if chosen == "ancf" else CODECS[chosen][0](src)
    except CodecNotApplicable:
        if codec != "auto":
            raise
        chosen = "raw"
        meta, bufs = CODECS["raw"][0](src)
    enc = Encoded(chosen, t.dtype, tuple(t.shape), meta, bufs)
    if "zstd" in est and chosen != "zstd":
        # on the host, zstd is the yardstick: the estimates come from a sample and leave out the
        # codecs' headers, so where another codec was picked, zstd is encoded too and the smaller
        # kept; auto is then never larger than zstd on a tensor it codes
        other = Encoded("zstd", t.dtype, tuple(t.shape), *CODECS["zstd"][0](src))
        enc = other if other.nbytes < enc.nbytes else enc
    if codec == "auto" and enc.codec != "raw" and enc.payload_nbytes > (1 - AUTO_MIN_SAVING) * enc.raw_nbytes:
        meta, bufs = CODECS["raw"][0](src)
        enc = Encoded("raw", t.dtype, tuple(t.shape), meta, bufs)
    _sync(src)
    enc.encode_s = time.perf_counter() - t0
    return enc


def decode(enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode on the device that holds ``enc``'s buffers (``enc.to(device)`` moves them).

    With ``out`` (same dtype and shape, any device), the result is copied into
    it and ``out`` is returned. Raises ``CorruptEncodedError`` on bad data.
    """
    require(enc.codec in CODECS, f"unknown codec {enc.codec!r} in encoded data")
    try:
        t = CODECS[enc.codec][1](enc)
    except CorruptEncodedError:
        raise
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        # a size check missed by a decoder must still surface as bad data, not a crash
        raise CorruptEncodedError(f"codec {enc.codec!r}: inconsistent encoded data ({e})") from None
    require(t.dtype == enc.dtype and tuple(t.shape) == enc.shape, f"codec {enc.codec!r}: decoded to the wrong shape")
    if out is None:
        return t
    if out.dtype != enc.dtype or tuple(out.shape) != enc.shape:
        raise ValueError(f"out is {out.dtype}{tuple(out.shape)}, encoded tensor is {enc.dtype}{enc.shape}")
    out.copy_(t)
    return out


def encoded_nbytes(enc: Encoded) -> int:
    """Length of ``enc.to_bytes()`` without building it."""
    return enc.nbytes
