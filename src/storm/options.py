"""storm.offload's options, checked where they are given (the constructor, not the ``with``).

Each error names the option, or the environment variable the value came
from, and what is accepted, so a misspelt mode or a size of ``"-1"`` is
reported at the line that wrote it.
"""

from __future__ import annotations

import os

from stormd.wire.endpoint import normalize_endpoint
from stormd.wire.pool import MIN_POOL_SIZE
from stormd.wire.sizes import format_size, parse_size

MODES = ("auto", "daemon", "embedded")
POOL_SIZE_ENV = "STORM_POOL_SIZE"


def mode_option(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}")
    return mode


def bytes_option(name: str, value: object, minimum: int = 0) -> int:
    """An option in bytes: an int, or a size such as '256MiB' (whole bytes, at least ``minimum``)."""
    accepted = (f"an int >= {minimum} or a size such as '256MiB'" if minimum == 0 else
                f"at least {format_size(minimum)}: an int or a size such as '512MiB'")
    try:
        n = parse_size(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be bytes: {accepted}; got {value!r} ({e})") from None
    if n < minimum:
        raise ValueError(f"{name} must be bytes: {accepted}; got {value!r}")
    return n


def pool_size_option(pool_size: object) -> int | None:
    """The embedded store's fixed pool: ``pool_size``, else $STORM_POOL_SIZE, else None (a pool
    that grows on demand)."""
    if pool_size is not None:
        return bytes_option("pool_size", pool_size, MIN_POOL_SIZE)
    if os.environ.get(POOL_SIZE_ENV):
        return bytes_option(POOL_SIZE_ENV, os.environ[POOL_SIZE_ENV], MIN_POOL_SIZE)
    return None


def socket_option(mode: str, socket: object) -> str | None:
    """The daemon's endpoint for ``mode`` (checked already): a ``socket`` given, else
    $STORMD_SOCKET's or the default one, named now if it is no endpoint. None for
    mode='embedded' with no socket given: that store reads no daemon's variable."""
    if mode == "embedded" and socket is None:
        return None
    return normalize_endpoint(socket)
