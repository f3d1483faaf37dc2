"""Float32 frames: codec b (an ancf_exp frame, kernels.frame) on the high halves of float32 words,
the low halves as they are, for copy streams.

A float32 word's high half is a bf16 value: its sign and exponent, which activations, softmax
probabilities and log-probabilities keep in a few values, and the mantissa's top 7 bits. An
ancf_exp frame holds those halves at its fixed size (about three quarters of theirs); the low
halves, mantissa bits of no pattern, follow raw:

    frame   frame_nbytes(n) B     the ancf_exp frame of the n high halves (its header first)
    pad     to 8 bytes
    low     2n B                  the low halves, in order

The frame's header is the ancf_exp frame's, so ``frame_layout.complete`` reads it as one: where
the high halves' escapes did not fit, whoever copied it stores the tensor another way. The low
halves' place holds the high halves, gathered for the encoder and decoded for the words, before
(encoding) or after (decoding) it holds the low halves: no buffer of the tensor's size is made.
Both run in order on one stream, the copy's they serve.
"""
from __future__ import annotations

import torch

from .container import require
from .frame import decode_frame, encode_frame, frame_nbytes


def _low_at(n: int) -> int:
    return -(-frame_nbytes(n) // 8) * 8


def float32_frame_nbytes(nbytes: int) -> int:
    """The size of a float32 frame of ``nbytes`` bytes (32-bit words), whatever they hold."""
    return _low_at(nbytes // 4) + nbytes // 2


def encode_float32_frame(t: torch.Tensor, out: torch.Tensor) -> None:
    """The 32-bit words of ``t`` (contiguous bytes) into ``out`` (uint8, ``float32_frame_nbytes`` of
    t's bytes, on t's device)."""
    raw = t.reshape(-1).view(torch.uint8)
    require(raw.numel() % 4 == 0, f"float32 frames hold 32-bit words; got {raw.numel()} bytes")
    require(out.numel() == float32_frame_nbytes(raw.numel()) and out.dtype == torch.uint8,
            f"a float32 frame of {raw.numel()} bytes is {float32_frame_nbytes(raw.numel())} bytes, got {out.numel()}")
    words = raw.view(torch.int16)
    n, at = words.numel() // 2, _low_at(words.numel() // 2)
    staged = out[at:].view(torch.int16)
    staged.copy_(words[1::2])
    encode_frame(staged, out[:frame_nbytes(n)])
    out[frame_nbytes(n):at].zero_()
    staged.copy_(words[0::2])


def decode_float32_frame(frame: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The words a float32 frame holds, into ``out`` (contiguous, the frame's bytes), where ``frame``
    is (the ancf_exp frame's checks: kernels.frame.decode_frame). The frame's low halves' place
    is written: a fetched frame is read once."""
    raw = out.reshape(-1).view(torch.uint8)
    require(out.is_contiguous() and raw.numel() % 4 == 0, "out must be contiguous 32-bit words")
    require(frame.numel() == float32_frame_nbytes(raw.numel()),
            f"a float32 frame of {raw.numel()} bytes is {float32_frame_nbytes(raw.numel())} bytes, got {frame.numel()}")
    words = raw.view(torch.int16)
    n, at = words.numel() // 2, _low_at(words.numel() // 2)
    staged = frame[at:].view(torch.int16)
    words[0::2].copy_(staged)
    words[1::2].copy_(decode_frame(frame[:frame_nbytes(n)], n, out=staged))
    return out


__all__ = ["decode_float32_frame", "encode_float32_frame", "float32_frame_nbytes"]
