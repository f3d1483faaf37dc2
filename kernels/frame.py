"""Frames: codec b (``ancf_exp``) at a size known before encoding, for copy streams.

A CUDA tensor on its way to the host is encoded and copied without the host
waiting for the device: the device-to-host copy is queued before the encoder
has run, so its size cannot depend on the data. A frame of n 16-bit words
therefore has a fixed size, ``frame_nbytes(n)``:

    header  16 B        int32 escape count, int32 magic, int64 n
    table   16 B        the 15 dictionary symbols (high bytes), then 0
    codes   ceil(n/2) B one 4-bit code per element, 15 = escape
    raw     n B         the low byte of every element
    pos     4 * cap B   int32 positions of the escapes, in any order
    sym     cap B       their high bytes

with ``cap = n // 128 + 64`` escape slots: bf16 activations of the real sample
(tests/fixtures) have at most 0.4 % escapes. About 1.3x on bf16 activations.
Frames are for bf16, whose high byte is sign and exponent; any 16-bit words
round-trip, but fp16's high byte holds mantissa bits too and overflows.
The count in the header is every escape, also those past ``cap``: a frame with
more is incomplete (``complete()``), and whoever copied it must store the
tensor another way (the mover still holds the GPU tensor when it checks).

On CUDA with Triton, ``encode_frame`` and ``decode_frame`` are launches on the
current stream with no host wait (kernels.gpu.pack), and decode checks nothing:
a frame read back on the device is the mover's own. The torch path here is the
reference (the same bytes, except the order of escape slots) and decodes frames
on the CPU with every check, raising CorruptEncodedError.
"""
from __future__ import annotations

import torch

from .bitpack import pack_bits, unpack_bits
from .format import require
from .gpu import use_triton

MAGIC = 0x31465453  # "STF1"
HEADER = 32         # header and table
SAMPLE = 16384      # elements the dictionary is chosen from (strided over the tensor)


def escape_slots(n: int) -> int:
    return n // 128 + 64


def _offsets(n: int) -> tuple[int, int, int, int, int]:
    """(codes, raw, pos, sym, end) byte offsets of a frame of n words."""
    codes = HEADER
    raw = codes + (n + 1) // 2
    pos = (raw + n + 3) & ~3  # int32-aligned
    sym = pos + 4 * escape_slots(n)
    return codes, raw, pos, sym, sym + escape_slots(n)


def frame_nbytes(n: int) -> int:
    """The size of a frame of ``n`` 16-bit words, whatever they hold."""
    return _offsets(n)[4]


def _parts(frame: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    codes, raw, pos, sym, end = _offsets(n)
    require(frame.dtype == torch.uint8 and frame.dim() == 1 and frame.numel() == end,
            f"a frame of {n} words is {end} bytes, got {frame.numel()}")
    return {"header": frame[:16].view(torch.int32), "table": frame[16:HEADER], "codes": frame[codes:raw],
            "raw": frame[raw:raw + n], "pos": frame[pos:sym].view(torch.int32), "sym": frame[sym:end]}


def _words(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 2:
        raise ValueError(f"frames hold 16-bit words; got {t.dtype}")
    return t.contiguous().reshape(-1).view(torch.int16)


def encode_frame(t: torch.Tensor, out: torch.Tensor) -> None:
    """Encode the 16-bit tensor ``t`` into ``out`` (uint8, ``frame_nbytes(t.numel())``, on t's device)."""
    x = _words(t)
    n = x.numel()
    parts = _parts(out, n)
    if use_triton(x):
        from .gpu.pack import frame_encode
        frame_encode(x, parts, torch.empty(256, dtype=torch.int32, device=x.device), SAMPLE, MAGIC)
        return
    s = (x.to(torch.int32) >> 8) & 0xFF
    hist = torch.bincount(s[::max(1, n // SAMPLE)], minlength=256)
    rank = torch.arange(256, device=x.device)
    symbols = 255 - (torch.sort((hist << 8) | (255 - rank), descending=True).values & 255)  # ties: lower byte
    lut = torch.full((256,), 15, dtype=torch.int64, device=x.device)
    lut[symbols[:15]] = rank[:15]
    parts["table"].zero_()
    parts["table"][:15] = symbols[:15].to(torch.uint8)
    c = lut[s]
    parts["codes"].copy_(pack_bits(c, 4))
    parts["raw"].copy_((x & 0xFF).to(torch.uint8))
    esc = torch.nonzero(c == 15).reshape(-1)
    k = min(esc.numel(), parts["pos"].numel())
    parts["pos"][:k] = esc[:k].to(torch.int32)
    parts["sym"][:k] = s[esc[:k]].to(torch.uint8)
    parts["header"].copy_(torch.tensor([esc.numel(), MAGIC, n & 0xFFFFFFFF, n >> 32], dtype=torch.int64)
                          .to(torch.int32))


def _header(frame: torch.Tensor) -> tuple[int, int, int]:
    """(escape count, magic, n) from a frame's first 16 bytes (uint8, on the CPU)."""
    count, magic, lo, hi = (int(v) for v in frame[:16].view(torch.int32))
    return count, magic, (lo & 0xFFFFFFFF) | (hi << 32)


def complete(frame_header: torch.Tensor) -> bool:
    """Whether a frame holds all its escapes, from its first 16 bytes (uint8, on the CPU: where the
    frame landed)."""
    count, _, n = _header(frame_header)
    return count <= escape_slots(n)


def decode_frame(frame: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` 16-bit words (int16) a frame holds, decoded where ``frame`` is; into ``out`` if given."""
    parts = _parts(frame, n)
    if out is None:
        out = torch.empty(n, dtype=torch.int16, device=frame.device)
    require(out.dtype == torch.int16 and out.numel() == n and out.is_contiguous(),
            f"out must be {n} contiguous int16 words")
    if use_triton(frame):
        from .gpu.pack import frame_decode
        frame_decode(parts, out)
        return out
    count, magic, held = _header(frame)
    require(magic == MAGIC, "not a frame (bad magic)")
    require(held == n, f"the frame holds {held} words, not {n}")
    require(0 <= count <= parts["pos"].numel(), f"{count} escapes do not fit the frame's "
                                                  f"{parts['pos'].numel()} slots (an incomplete frame)")
    c = unpack_bits(parts["codes"], 4, n)
    pos = parts["pos"][:count].to(torch.int64)
    require(torch.equal(torch.sort(pos).values, torch.nonzero(c == 15).reshape(-1)),
            "escape positions do not match the escape codes")
    s = parts["table"].to(torch.int32)[c.clamp(max=14)]
    s[pos] = parts["sym"][:count].to(torch.int32)
    w = (s << 8) | parts["raw"].to(torch.int32)
    out.copy_(w - ((w & 0x8000) << 1))  # 0..65535 -> the int16 with those bits
    return out


__all__ = ["complete", "decode_frame", "encode_frame", "escape_slots", "frame_nbytes"]
