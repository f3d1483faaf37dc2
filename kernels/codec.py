"""Public codec API: ``encode``, ``decode``, the ``auto`` choice, and statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import entropy
from .bits import bit_keys, keys_to_tensor, split_fields
from .codecs import CODECS, EXP_ENTRIES, CodecNotApplicable
from .format import DTYPE_NAMES, CorruptEncodedError, Encoded, require

AUTO_MIN_SAVING = 0.05     # auto stores raw unless a codec saves at least 5 % of the bytes
AUTO_MIN_BYTES = 4096      # below this the fixed header outweighs any saving
SAMPLE = 1 << 16           # elements sampled by auto to estimate each codec's size

# Encode throughput of each codec measured on the H100 (GB/s of input, 256 MiB
# tensors, rounded down; bench/results/codec_h100_256mib_2026-11-22.json, and for
# huff_exp the lowest of bench/results/codec-h100-2026-11-23.json and
# codec-nvcomp-h100-2026-11-23.json).
# ``encode(..., min_gbps=x)`` lets ``auto`` pick only codecs at or above x.
# These are GPU figures: on the CPU every codec is far slower and only the
# order is indicative.
ENCODE_GBPS = {"raw": 1000.0, "ancf_exp": 250.0, "huff_exp": 180.0, "zero": 35.0, "pack": 9.0, "ancf": 9.0}


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
        lengths = entropy.code_lengths(hist)
        est["huff_exp"] = float((hist * lengths).sum()) / m / 8 + rbits / 8 + 2 / entropy.LANE_STEPS
        esc = 1.0 - float(np.sort(hist)[::-1][:EXP_ENTRIES].sum()) / m
        pos_bytes = 4 if t.numel() < 2**31 else 8
        est["ancf_exp"] = 0.5 + rbits / 8 + esc * (1 + pos_bytes)
    return est


def choose_codec(t: torch.Tensor, min_gbps: float = 0.0) -> str:
    """The codec ``auto`` would use for ``t``: smallest estimate among codecs whose measured
    encode rate (ENCODE_GBPS) is at least ``min_gbps``, or ``raw`` when none saves
    AUTO_MIN_SAVING."""
    raw = t.numel() * t.element_size()
    if raw < AUTO_MIN_BYTES:
        return "raw"
    est = {k: v for k, v in estimate_sizes(t).items() if k == "raw" or ENCODE_GBPS[k] >= min_gbps}
    best = min(est, key=est.get)
    return best if est[best] <= (1 - AUTO_MIN_SAVING) * t.element_size() else "raw"


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
    chosen = choose_codec(src, min_gbps) if codec == "auto" else codec
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
    if codec == "auto" and chosen != "raw" and enc.payload_nbytes > (1 - AUTO_MIN_SAVING) * enc.raw_nbytes:
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


@dataclass
class LayerStats:
    tensors: int = 0
    raw_bytes: int = 0
    encoded_bytes: int = 0
    elements: int = 0
    escapes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    codecs: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    @property
    def escape_rate(self) -> float:
        return self.escapes / self.elements if self.elements else 0.0

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "raw_bytes": self.raw_bytes, "encoded_bytes": self.encoded_bytes,
                "ratio": self.ratio, "escape_rate": self.escape_rate, "encode_s": self.encode_s,
                "decode_s": self.decode_s, "codecs": dict(self.codecs)}


class CodecStats:
    """Byte-weighted statistics per layer (any hashable key) and in total."""

    def __init__(self) -> None:
        self.layers: dict[object, LayerStats] = {}

    def record(self, layer: object, enc: Encoded, decode_s: float = 0.0) -> None:
        s = self.layers.setdefault(layer, LayerStats())
        s.tensors += 1
        s.raw_bytes += enc.raw_nbytes
        s.encoded_bytes += enc.nbytes
        s.elements += enc.numel
        s.escapes += enc.escapes
        s.encode_s += enc.encode_s
        s.decode_s += decode_s
        s.codecs[enc.codec] = s.codecs.get(enc.codec, 0) + 1

    def record_decode(self, layer: object, seconds: float) -> None:
        self.layers.setdefault(layer, LayerStats()).decode_s += seconds

    def total(self) -> LayerStats:
        t = LayerStats()
        for s in self.layers.values():
            t.tensors += s.tensors
            t.raw_bytes += s.raw_bytes
            t.encoded_bytes += s.encoded_bytes
            t.elements += s.elements
            t.escapes += s.escapes
            t.encode_s += s.encode_s
            t.decode_s += s.decode_s
            for k, v in s.codecs.items():
                t.codecs[k] = t.codecs.get(k, 0) + v
        return t

    def summary(self) -> dict:
        return {"layers": {str(k): v.as_dict() for k, v in self.layers.items()}, "total": self.total().as_dict()}
