"""Whose stormd this process offloads through: checked before anything is sent.

A daemon sees every tensor its clients store and hands back the bytes (and
the checksums they are verified against), so the client talks only to a
daemon of a user it trusts: its own uid, or the uid named in
``STORM_DAEMON_UID`` (a container or service account that runs stormd).
The default socket directory, /tmp/stormd-UID, is a name any local user can
take first; so the socket's directory must belong to a trusted uid and be
writable by nobody else (or another user could put a socket there), the
socket file must belong to a trusted uid, and the pool segment the daemon
names in HELLO must be a file of a trusted uid that no other user can open.
stormd refuses such a directory for itself (``config.ensure_private_dir``);
this is the client's side of the same rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import StormUntrusted

DAEMON_UID_ENV = "STORM_DAEMON_UID"


def trusted_uids() -> frozenset[int]:
    """This process's uid, and the one in $STORM_DAEMON_UID if set."""
    named = os.environ.get(DAEMON_UID_ENV, "").strip()
    if not named:
        return frozenset((os.getuid(),))
    if not named.isdigit():
        raise ValueError(f"{DAEMON_UID_ENV}={named!r}: must be a numeric uid (the user stormd runs as, "
                         f"e.g. `id -u storm`), or unset to trust only this user")
    return frozenset((os.getuid(), int(named)))


def _whose(uids: frozenset[int]) -> str:
    others = sorted(uids - {os.getuid()})
    return f"this user (uid {os.getuid()})" + (f" or {DAEMON_UID_ENV} (uid {others[0]})" if others else "")


def check_socket(path: Path) -> None:
    """Raise StormUntrusted unless the directory of the socket at ``path``, and the socket where it
    exists, belong to a trusted uid and the directory is writable by nobody else. A socket that does
    not exist or that this user may not reach is left to the caller (no daemon for it there)."""
    uids = trusted_uids()
    try:
        d = os.stat(path.parent)
    except (FileNotFoundError, PermissionError):  # no daemon there, or none this user may reach
        return
    mode = stat.S_IMODE(d.st_mode)
    if d.st_uid not in uids or mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StormUntrusted(
            f"refusing the stormd socket directory {path.parent}: it belongs to uid {d.st_uid} with mode "
            f"{mode:#o}; accepted: a directory of {_whose(uids)} that group and others cannot write to. "
            f"Another user may have made it to receive your tensors: remove it and start stormd again, "
            f"or set STORMD_SOCKET to a socket in a directory of yours")
    try:
        s = os.lstat(path)
    except (FileNotFoundError, PermissionError):
        return
    if s.st_uid not in uids:
        raise StormUntrusted(f"refusing the stormd socket {path}: it belongs to uid {s.st_uid}; accepted: a socket "
                             f"of {_whose(uids)}")


def check_pool(path: str, st: os.stat_result) -> None:
    """Raise StormUntrusted unless the pool segment the daemon named (``st``: its status, taken on the
    opened file) is a regular file of a trusted uid that group and others cannot open."""
    uids = trusted_uids()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in uids or mode & 0o077:
        raise StormUntrusted(
            f"refusing stormd's pool segment {path}: it belongs to uid {st.st_uid} with mode {mode:#o}; "
            f"accepted: a file of {_whose(uids)} that only its owner can open (mode 0600), as stormd creates "
            f"it. The daemon at this socket is not one of yours, or its pool is open to other users")
