"""Upcast frames: float32 words whose low 16 bits are all 0 (a bfloat16 value widened, as a norm's
or a loss's ``.float()`` makes them) at their high halves, for copy streams.

    header  16 B      int32 flag, int32 magic (frame_layout.UPCAST_MAGIC), int64 n (32-bit words)
    high    2n B      the high 16 bits of every word, in order

The flag is 1 where a low half is not 0: one high half cannot hold that word, and the frame is
incomplete (frame_layout.complete): whoever copied it stores the tensor another way (the session
stores it raw, and tensors of its kind in float32 frames from then on: storm/frames.py). The
halves are read as strided views of the words: the flag is two reductions and the high halves
one copy, with no temporary of the tensor's size. Words are little-endian, as on every machine
torch's CUDA runs on: a word's low half comes first.
"""
from __future__ import annotations

import torch

from .container import require
from .frame_layout import UPCAST_MAGIC, check_headed, header

HEADER = 16


def upcast_frame_nbytes(nbytes: int) -> int:
    """The size of an upcast frame of ``nbytes`` bytes (32-bit words), whatever they hold."""
    return HEADER + nbytes // 2


def _check(frame: torch.Tensor, nbytes: int) -> None:
    require(nbytes % 4 == 0, f"upcast frames hold 32-bit words; got {nbytes} bytes")
    check_headed(frame, upcast_frame_nbytes(nbytes), f"an upcast frame of {nbytes} bytes")


def encode_upcast_frame(t: torch.Tensor, out: torch.Tensor) -> None:
    """The high halves of the 32-bit words of ``t`` (contiguous bytes) into ``out`` (uint8,
    ``upcast_frame_nbytes(t.numel() * t.element_size())``, on t's device), flagged where a low half is not 0."""
    if not t.is_contiguous():
        raise ValueError("upcast frames hold contiguous bytes")
    if out.device != t.device:
        raise ValueError(f"the frame is on {out.device}, the tensor on {t.device}")
    raw = t.reshape(-1).view(torch.uint8)
    _check(out, raw.numel())
    words = raw.view(torch.int16)
    low, high = words[0::2], words[1::2]
    flag = out[:4].view(torch.int32)
    if low.numel():
        # written by kernels on the stream, not copied from the host: nothing waits for them
        flag.copy_(torch.logical_or(low.amax() != 0, low.amin() != 0).view(1))
    else:
        flag.zero_()
    out[4:8].view(torch.int32).fill_(UPCAST_MAGIC)
    out[8:16].view(torch.int64).fill_(low.numel())
    out[HEADER:].view(torch.int16).copy_(high)


def decode_upcast_frame(frame: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The words an upcast frame holds, into ``out`` (contiguous, the frame's bytes), where ``frame`` is.
    On the CPU the header is checked; on a device the frame is the mover's own, checked where it
    landed (complete)."""
    raw = out.reshape(-1).view(torch.uint8)
    _check(frame, raw.numel())
    require(out.is_contiguous(), "out must be contiguous")
    if frame.device.type == "cpu":
        flag, magic, held = header(frame)
        require(magic == UPCAST_MAGIC, "not an upcast frame (bad magic)")
        require(held == raw.numel() // 4, f"the upcast frame holds {held} words, not {raw.numel() // 4}")
        require(flag == 0, "a word whose low half is not 0 does not fit an upcast frame (an incomplete frame)")
    words = raw.view(torch.int16)
    words[1::2].copy_(frame[HEADER:].view(torch.int16))
    words[0::2].zero_()
    return out


__all__ = ["decode_upcast_frame", "encode_upcast_frame", "upcast_frame_nbytes"]
