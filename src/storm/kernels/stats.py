"""Byte-weighted statistics of encoded tensors, per layer and in total (kept by ANCFEncoder)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .container import Encoded


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
