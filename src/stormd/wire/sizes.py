"""Sizes as people write them ('8GiB', '512MB', 4096) and back, the same way in every place that reads one.

stormd's settings, the client's ``pool_size`` option and ``STORM_POOL_SIZE``, stormctl's tables and
the benchmarks all read and print sizes here, so a size one of them accepts the others accept too.
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: object) -> int:
    """'8GiB', '512MiB', '1.5GB', '4096', 4096 -> bytes. A size is a whole number of bytes >= 0:
    anything else (-1, '1.5', 1.5, True) is a ValueError rather than a size rounded into range.
    ``text`` is typed ``object`` since that check is the point: options and settings pass what a
    user gave, unchecked."""
    n = exact_size(text)
    if n.denominator != 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(n)


def exact_size(text: object) -> Fraction:
    """The bytes a size says, exactly, whole or not ('2.93GiB' is 3146063544.32): parse_size's reading
    before it asks for whole bytes, for a caller that rounds (a benchmark's cap printed in GiB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return Fraction(text)
    if not isinstance(text, str):
        raise ValueError(f"a size is an int or a string, not {type(text).__name__}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use bytes or a number with a unit such as 512MiB or 8GiB")
    return Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: '1.1GB' is 1100000000, not a float's guess


_FACTORS = sorted(((f, u) for u, f in (("TiB", 1 << 40), ("TB", 1000**4), ("GiB", 1 << 30), ("GB", 1000**3),
                                      ("MiB", 1 << 20), ("MB", 1000**2), ("KiB", 1 << 10), ("KB", 1000))),
                  reverse=True)


def format_size(n: int) -> str:
    """Bytes in the largest unit, binary or decimal, that divides them exactly, so that parse_size
    reads it back to the same number: 1073741824 -> '1GiB', 8000000000 -> '8GB', 1000 -> '1KB'."""
    for factor, unit in _FACTORS:
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)
