"""Frames: codec b (``ancf_exp``) at a size known before encoding, for copy streams.

A CUDA tensor on its way to the host is encoded and copied without the host
waiting for the device: the device-to-host copy is queued before the encoder
has run, so its size cannot depend on the data. A frame of n 16-bit words in
T = ceil(n / TILE) tiles therefore has a fixed size, ``frame_nbytes(n)``: a header,
the dictionary, each tile's end, the 4-bit codes, the low bytes and the escapes' high
bytes, laid out as kernels.frame_layout draws it, with ``cap = n // 128 + 16`` escape
slots: more than the bf16 activations of the real sample (tests/fixtures) need. An escape's slot is the number of
escapes before it, so it needs no position (a slot is one byte; a position
and a symbol took five): a tile's first slot is the end of the tile before,
the codes give the rest. Its ratio on bf16 activations is in docs/results.md ("Codecs and kernels").
Frames are for bf16, whose high byte is sign and exponent; any 16-bit words
round-trip, but fp16's high byte holds mantissa bits too and overflows.
The count in the header is every escape, also those past ``cap``: a frame with
more is incomplete (``complete()``), and whoever copied it must store the
tensor another way (the mover still holds the GPU tensor when it checks).
Slots past the count are not written.

The ends are the look-back words of kernels.gpu.scan (flag 2: an inclusive
prefix): on the device each tile publishes its count, finds its first slot from
the tiles before it, and publishes its end, all in one pass. On CUDA with
Triton, ``encode_frame`` and ``decode_frame`` are launches on the current stream
with no host wait (kernels.gpu.frame): one each for frames of up to
``SMALL_TILES`` tiles, where a launch is most of the cost; and decode checks
nothing: a frame read back on the device is the mover's own. The torch path
here is the reference (the same bytes) and decodes frames on the CPU with every
check, raising CorruptEncodedError.
"""
from __future__ import annotations

import torch

from .bitpack import pack_bits, unpack_bits
from .container import require

# the layout's names are part of this module's API (storm.kernels.frame.frame_nbytes, ...)
from .frame_layout import (
    HEADER,
    MAGIC,
    PREFIX,
    SAMPLE,
    SMALL_TILES,
    TABLE,
    TILE,
    Layout,
    complete,
    escape_slots,
    frame_nbytes,
    header,
    layout,
)
from .gpu import use_triton


def _check_frame(frame: torch.Tensor, lay: Layout) -> None:
    require(frame.dtype == torch.uint8 and frame.dim() == 1 and frame.numel() == lay.end
            and frame.is_contiguous(), f"a frame of {lay.n} words is {lay.end} contiguous bytes, "
                                      f"got {frame.numel()} ({frame.dtype})")
    require(frame.data_ptr() % 8 == 0, "a frame must start 8-byte aligned (its tile ends are int64 words)")


def _tile_ends(esc: torch.Tensor, lay: Layout) -> torch.Tensor:
    """int64 per tile: the escapes up to its end."""
    per_element = torch.zeros(lay.tiles * TILE, dtype=torch.int64, device=esc.device)
    per_element[:lay.n] = esc
    return torch.cumsum(per_element.view(lay.tiles, TILE).sum(1), 0)


def encode_frame(t: torch.Tensor, out: torch.Tensor) -> None:
    """Encode the 16-bit tensor ``t`` into ``out`` (uint8, ``frame_nbytes(t.numel())``, on t's device)."""
    if t.element_size() != 2:
        raise ValueError(f"frames hold 16-bit words; got {t.dtype}")
    lay = layout(t.numel())
    if out.device != t.device:
        raise ValueError(f"the frame is on {out.device}, the tensor on {t.device}")
    _check_frame(out, lay)
    if use_triton(t):
        from .gpu.frame import frame_encode
        frame_encode(t.contiguous(), out, lay, SAMPLE, SMALL_TILES, MAGIC)
        return
    n = lay.n
    w = t.contiguous().reshape(-1).view(torch.int16).to(torch.int32)
    s = (w >> 8) & 0xFF
    hist = torch.bincount(s[::max(1, n // SAMPLE)], minlength=256)
    rank = torch.arange(256, device=w.device)
    symbols = 255 - (torch.sort((hist << 8) | (255 - rank), descending=True).values & 255)  # ties: lower byte
    lut = torch.full((256,), 15, dtype=torch.int64, device=w.device)
    lut[symbols[:15]] = rank[:15]
    c = lut[s]
    esc = c == 15
    count = int(esc.sum())
    k = min(count, lay.cap)
    out[:16].view(torch.int32).copy_(torch.tensor([min(count, 2**31 - 1), MAGIC, n & 0xFFFFFFFF, n >> 32],
                                                  dtype=torch.int64).to(torch.int32))
    out[TABLE:HEADER].zero_()
    out[TABLE:TABLE + 15].copy_(symbols[:15].to(torch.uint8))
    out[HEADER:lay.codes].view(torch.int64).copy_(_tile_ends(esc, lay) << 2 | PREFIX)
    out[lay.codes:lay.raw].copy_(pack_bits(c, 4))
    out[lay.raw:lay.sym].copy_((w & 0xFF).to(torch.uint8))
    out[lay.sym:lay.sym + k].copy_(s[esc][:k].to(torch.uint8))


def decode_frame(frame: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` 16-bit words (int16) a frame holds, decoded where ``frame`` is; into ``out`` if given."""
    lay = layout(n)
    _check_frame(frame, lay)
    if out is None:
        out = torch.empty(n, dtype=torch.int16, device=frame.device)
    require(out.dtype == torch.int16 and out.numel() == n and out.is_contiguous(),
            f"out must be {n} contiguous int16 words")
    if use_triton(frame):
        from .gpu.frame import frame_decode
        frame_decode(frame, out, lay, SMALL_TILES)
        return out
    count, magic, held = header(frame)
    require(magic == MAGIC, "not a frame (bad magic)")
    require(held == n, f"the frame holds {held} words, not {n}")
    require(0 <= count <= lay.cap, f"{count} escapes do not fit the frame's {lay.cap} slots (an incomplete frame)")
    c = unpack_bits(frame[lay.codes:lay.raw], 4, n)
    esc = c == 15
    ends = frame[HEADER:lay.codes].view(torch.int64)
    require(bool((ends & 3 == PREFIX).all()), "a tile's word is not a tile end (its flag)")
    require(torch.equal(ends >> 2, _tile_ends(esc, lay)),
            "the tiles' escape ends do not match the escape codes")
    require(int(esc.sum()) == count, "the escape count does not match the escape codes")
    s = frame[TABLE:HEADER].to(torch.int32)[c]
    s[esc] = frame[lay.sym:lay.sym + count].to(torch.int32)
    w = (s << 8) | frame[lay.raw:lay.sym].to(torch.int32)
    out.copy_(w - ((w & 0x8000) << 1))  # 0..65535 -> the int16 with those bits
    return out


__all__ = ["complete", "decode_frame", "encode_frame", "escape_slots", "frame_nbytes", "layout"]
