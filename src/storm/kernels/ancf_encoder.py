"""The source document's ANCF surface: ``ANCFEncoder`` with policies 0/1/2.

The dictionary is of *exact* bit patterns (the most frequent ones), never
k-means centroids: a centroid almost never equals a value bit for bit, so a
centroid dictionary cannot be lossless. On dense activations most values are
escapes and the encoding is larger than its input; ``compression_stats``
reports that true ratio. Pass ``codec="auto"`` (or another codec) to keep this
surface but use an encoding that actually saves bytes.
"""
from __future__ import annotations

import time

import torch

from .bits import bit_keys, verify_lossless
from .container import Encoded
from .registry import decode, encode
from .stats import CodecStats

POLICY_CONSERVATIVE, POLICY_ADAPTIVE, POLICY_AGGRESSIVE = 0, 1, 2


def sparsity(t: torch.Tensor, sample: int = 1 << 16) -> float:
    """Fraction of elements whose bit pattern is zero, from an evenly strided sample."""
    keys = bit_keys(t)
    if keys.numel() == 0:
        return 0.0
    step = max(1, keys.numel() // sample)
    return float((keys[::step] == 0).float().mean())


def dictionary_size(policy: int, sparse: float) -> int:
    """0: always 256; 1: 128 / 256 / 512 for sparsity > 0.7 / > 0.4 / else; 2: 128 if sparsity > 0.4 else 512."""
    if policy == POLICY_CONSERVATIVE:
        return 256
    if policy == POLICY_ADAPTIVE:
        return 128 if sparse > 0.7 else 256 if sparse > 0.4 else 512
    if policy == POLICY_AGGRESSIVE:
        return 128 if sparse > 0.4 else 512
    raise ValueError(f"policy must be 0, 1 or 2, got {policy}")


class ANCFEncoder:
    def __init__(self, policy: int = POLICY_ADAPTIVE, codec: str = "ancf") -> None:
        dictionary_size(policy, 0.0)  # validates the policy
        self.policy = policy
        self.codec = codec
        self.stats = CodecStats()

    def encode_activation(self, activation: torch.Tensor, layer_id: int = 0) -> Encoded:
        entries = dictionary_size(self.policy, sparsity(activation)) if self.codec == "ancf" else 256
        enc = encode(activation, codec=self.codec, entries=entries)
        self.stats.record(layer_id, enc)
        return enc

    def decode_activation(self, encoded: Encoded, device: torch.device | str | None = None,
                          layer_id: int | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        out = decode(encoded if device is None else encoded.to(device))
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        if layer_id is not None:
            self.stats.record_decode(layer_id, time.perf_counter() - t0)
        return out

    @staticmethod
    def verify_lossless(original: torch.Tensor, decoded: torch.Tensor) -> bool:
        return verify_lossless(original, decoded)

    def compression_stats(self) -> dict:
        return self.stats.summary()

    def average_compression_ratio(self) -> float:
        """Byte-weighted: total input bytes over total encoded bytes (headers included)."""
        return self.stats.total().ratio

    def get_compression_stats(self) -> str:
        lines = [f"{'layer':>8} {'tensors':>7} {'raw MiB':>9} {'enc MiB':>9} {'ratio':>7} {'escapes':>8} {'enc ms':>8}"]
        rows = list(self.stats.layers.items()) + [("total", self.stats.total())]
        for k, s in rows:
            lines.append(f"{str(k):>8} {s.tensors:7d} {s.raw_bytes / 2**20:9.2f} {s.encoded_bytes / 2**20:9.2f} "
                         f"{s.ratio:7.3f} {s.escape_rate:8.2%} {s.encode_s * 1e3:8.1f}")
        return "\n".join(lines)
