"""The byte layout of a frame (kernels.frame): where each part of a frame of n 16-bit words
lies, and its header. Read by the torch reference (kernels.frame) and by the Triton kernels
(kernels.gpu.frame) alike, so neither imports the other.

    header  16 B          int32 escape count, int32 magic, int64 n
    table   16 B          the 15 dictionary symbols (high bytes), then 0
    ends    8 B a tile    int64: the escapes up to the end of the tile, << 2 | 2
    codes   ceil(n/2) B   one 4-bit code per element, 15 = escape
    raw     n B           the low byte of every element
    sym     cap B         the escapes' high bytes, in element order
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .container import require

MAGIC = 0x32465453  # "STF2"
BITS_MAGIC = 0x31425453  # "STB1": a bit frame (kernels.bits_frame), whose header is this one's
UPCAST_MAGIC = 0x31555453  # "STU1": an upcast frame (kernels.upcast_frame), whose header is this one's
TABLE = 16          # where the table starts, after the 16-byte header
HEADER = 32         # header and table
SAMPLE = 16384      # elements the dictionary is chosen from (strided over the tensor)
TILE = 2048         # words a tile: one program of the encoder and of the decoder
SMALL_TILES = 16    # frames of at most this many tiles are encoded by one program (one launch)
PREFIX = 2          # the ends' flag: an inclusive prefix (kernels.gpu.scan.publish)


def escape_slots(n: int) -> int:
    return n // 128 + 16


class Layout(NamedTuple):
    """Where a frame of n words keeps each part (byte offsets), its tiles and escape slots."""
    n: int
    tiles: int
    codes: int
    raw: int
    sym: int
    end: int
    cap: int


def layout(n: int) -> Layout:
    """The layout of a frame of ``n`` words (the module docstring draws it)."""
    tiles = -(-n // TILE)
    codes = HEADER + 8 * tiles
    raw = codes + (n + 1) // 2
    sym = raw + n
    cap = escape_slots(n)
    return Layout(n, tiles, codes, raw, sym, sym + cap, cap)


def frame_nbytes(n: int) -> int:
    """The size of a frame of ``n`` 16-bit words, whatever they hold."""
    return layout(n).end


def header(frame: torch.Tensor) -> tuple[int, int, int]:
    """(escape count, magic, n) from a frame's first 16 bytes (uint8, on the CPU)."""
    count, magic, lo, hi = (int(v) for v in frame[:16].view(torch.int32))
    return count, magic, (lo & 0xFFFFFFFF) | (hi << 32)


def complete(frame_header: torch.Tensor) -> bool:
    """Whether a frame holds all its escapes, from its first 16 bytes (uint8, on the CPU: where the
    frame landed); a bit frame holds its tensor where its largest byte (the count's place) is 0 or 1,
    an upcast frame where its flag (there too) is 0."""
    count, magic, n = header(frame_header)
    if magic == BITS_MAGIC:
        return count <= 1
    if magic == UPCAST_MAGIC:
        return count == 0
    return count <= escape_slots(n)


def check_headed(frame: torch.Tensor, size: int, what: str) -> None:
    """``frame`` (``what``, for the error) is a frame of ``size`` bytes headed as this one is: uint8,
    one contiguous dimension, starting 8-byte aligned (its header's n is an int64)."""
    require(frame.dtype == torch.uint8 and frame.dim() == 1 and frame.numel() == size and frame.is_contiguous(),
            f"{what} is {size} contiguous bytes, got {frame.numel()} ({frame.dtype})")
    require(frame.data_ptr() % 8 == 0, f"{what} must start 8-byte aligned (its header's n is an int64)")
