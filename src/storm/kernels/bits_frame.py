"""Bit frames: a bool tensor (dropout's mask) at one bit an element, for copy streams.

A CUDA bool tensor on its way to the host is packed on the device and copied without the host
waiting, like a frame of kernels.frame: its size is fixed before packing.

    header  16 B           int32 largest byte, int32 magic (frame_layout.BITS_MAGIC), int64 n
    bits    ceil(n/8) B    element i at bit i % 8 of byte i // 8

A bool's byte is 0 or 1 as torch's ops write it, but a bool view of other bytes may hold any:
one bit cannot tell those apart, so the header holds the largest byte (a reduction, with no
temporary of the tensor's size), and a frame whose largest byte is over 1 is incomplete
(frame_layout.complete): whoever copied it stores the tensor another way (the session stores it
raw; it still holds it). The packing runs on the tensor's device with
no host wait: on CUDA with Triton one pass (kernels.gpu.bitpack), else torch's ops, whose
unpacking writes each byte once into the output with no temporary of the output's size.
"""
from __future__ import annotations

import torch

from .bitpack import pack_bits
from .container import require
from .frame_layout import BITS_MAGIC, check_headed, header

HEADER = 16


def bits_frame_nbytes(n: int) -> int:
    """The size of a bit frame of ``n`` bytes (elements), whatever they hold."""
    return HEADER + (n + 7) // 8


def _check(frame: torch.Tensor, n: int) -> None:
    check_headed(frame, bits_frame_nbytes(n), f"a bit frame of {n} elements")


def encode_bits_frame(t: torch.Tensor, out: torch.Tensor) -> None:
    """Pack the bytes of ``t`` (bool or uint8, contiguous) into ``out`` (uint8, ``bits_frame_nbytes(t.numel())``,
    on t's device), with the largest of them in its header."""
    if t.element_size() != 1 or not t.is_contiguous():
        raise ValueError(f"bit frames hold contiguous bytes; got {t.dtype}")
    if out.device != t.device:
        raise ValueError(f"the frame is on {out.device}, the tensor on {t.device}")
    v = t.reshape(-1).view(torch.uint8)
    n = v.numel()
    _check(out, n)
    # written by kernels on the stream, not copied from the host: nothing waits for them
    if n:
        out[:4].view(torch.int32).copy_(v.amax().view(1))
    else:
        out[:4].view(torch.int32).zero_()
    out[4:8].view(torch.int32).fill_(BITS_MAGIC)
    out[8:16].view(torch.int64).fill_(n)
    if n:
        out[HEADER:].copy_(pack_bits(v, 1))


def decode_bits_frame(frame: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The bytes a bit frame holds (0 or 1), into ``out`` (uint8 or bool, contiguous, its elements the
    frame's n), where ``frame`` is. On the CPU the header is checked; on a device the frame is the
    mover's own, checked where it landed (complete)."""
    view = out.reshape(-1).view(torch.uint8)
    n = view.numel()
    _check(frame, n)
    require(out.is_contiguous() and out.element_size() == 1, f"out must be {n} contiguous bytes")
    if frame.device.type == "cpu":
        largest, magic, held = header(frame)
        require(magic == BITS_MAGIC, "not a bit frame (bad magic)")
        require(held == n, f"the bit frame holds {held} elements, not {n}")
        require(largest <= 1, f"a byte of {largest} does not fit a bit frame (an incomplete frame)")
    bits = frame[HEADER:]
    whole = n // 8
    shifts = torch.arange(8, dtype=torch.uint8, device=frame.device)
    if whole:
        packed = view[:whole * 8].view(whole, 8)
        torch.bitwise_right_shift(bits[:whole, None].expand(whole, 8), shifts, out=packed)
        packed.bitwise_and_(1)
    if n % 8:
        rest = view[whole * 8:]
        torch.bitwise_right_shift(bits[whole].expand(n % 8), shifts[:n % 8], out=rest)
        rest.bitwise_and_(1)
    return out


__all__ = ["bits_frame_nbytes", "decode_bits_frame", "encode_bits_frame"]
