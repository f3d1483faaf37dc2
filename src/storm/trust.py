"""Whose stormd this process offloads through: checked before anything is sent.

A daemon sees every tensor its clients store and hands back the bytes (and
the checksums they are verified against), so the client talks only to a
daemon of a user it trusts: its own uid, or the uid named in
``STORM_DAEMON_UID`` (a container or service account that runs stormd).
The default socket directory, /tmp/stormd-UID, is a name any local user can
take first; so the socket's directory must belong to a trusted uid and be
writable by nobody else (or another user could put a socket there), the
socket file must be a socket of a trusted uid, and the pool segment the daemon
names in HELLO must be a stormd segment of a trusted uid that no other user
can open. stormd refuses such a directory for itself
(``stormd.wire.endpoint.ensure_private_dir``); this is the client's side of
the same rule.

A path is a name, and whoever owns a name may repoint it between a check and
its use: the owner of /tmp/stormd-UID, made a symlink, could show the check a
harmless directory of the user's and the connection its own. So the socket's
directory is opened once, without following a symlink, and everything after,
the check of the socket, the liveness probe and every ZeroMQ (re)connect, goes
through that open directory (/proc/self/fd/N/NAME), never the name again.
Components above the directory may be symlinks (/tmp on some systems, a home
or XDG_RUNTIME_DIR on others): whatever they resolve to, the directory that
was opened is the one checked and used, and only its owner can put a socket
in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from stormd.wire.pool import SEGMENT_NAME  # how SharedPool.create names segments

from .errors import StormNoDaemon, StormUnavailable, StormUntrusted

DAEMON_UID_ENV = "STORM_DAEMON_UID"
# O_PATH: the directory is pinned, not read, so one that only lets its group or others through
# (0711, 0750: a stormd of STORM_DAEMON_UID) can be opened too. Linux only, as /proc/self/fd is.
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)


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


class CheckedSocket:
    """The stormd socket ``path``, reached only through its directory as opened and checked by
    ``open_checked_socket``. Whoever connects through it owns it and closes it when the connection
    is closed: ZeroMQ reconnects by path, so the directory must stay open as long as it may."""

    def __init__(self, path: Path, dir_fd: int):
        self.path = path
        self.dir_fd = dir_fd

    @property
    def via(self) -> Path:
        """The socket's path through the opened directory, which no rename or symlink can redirect."""
        if self.dir_fd < 0:
            raise ValueError(f"the directory of {self.path} is closed")
        return Path(f"/proc/self/fd/{self.dir_fd}/{self.path.name}")

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint to connect to (``via``)."""
        return f"ipc://{self.via}"

    def close(self) -> None:
        """Close the directory; once only, so that a number the process has reused is never closed."""
        fd, self.dir_fd = self.dir_fd, -1
        if fd >= 0:
            os.close(fd)


def open_checked_socket(path: Path) -> CheckedSocket:
    """Open the directory of the socket at ``path`` once and check, on what was opened, that it
    belongs to a trusted uid and is writable by nobody else and that the socket in it is a socket of
    a trusted uid. Raise StormUntrusted if not (a symlinked directory included), StormUnavailable
    if there is no socket there or this user may not reach it."""
    uids = trusted_uids()
    directory = path.parent
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        raise _not_opened(path, e) from None
    try:
        d = os.fstat(fd)
        mode = stat.S_IMODE(d.st_mode)
        if d.st_uid not in uids or mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StormUntrusted(
                f"refusing the stormd socket directory {directory}: it belongs to uid {d.st_uid} with mode "
                f"{mode:#o}; accepted: a directory of {_whose(uids)} that group and others cannot write to. "
                f"Another user may have made it to receive your tensors: remove it and start stormd again, "
                f"or set STORMD_SOCKET to a socket in a directory of yours")
        try:
            s = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise _no_socket(path) from None
        except PermissionError:
            raise _no_access(path) from None
        if not stat.S_ISSOCK(s.st_mode) or s.st_uid not in uids:
            what = "a socket" if stat.S_ISSOCK(s.st_mode) else _kind(s.st_mode)
            raise StormUntrusted(f"refusing the stormd socket {path}: it is {what} of uid {s.st_uid}; accepted: "
                                 f"a socket of {_whose(uids)}")
        checked = CheckedSocket(path, fd)
        _check_reachable(checked, d)
        return checked
    except BaseException:
        os.close(fd)
        raise


def _not_opened(path: Path, e: OSError) -> StormUnavailable:
    """Why the socket's directory could not be opened, as the error the caller raises."""
    directory = path.parent
    try:
        st = os.lstat(directory)
        target = os.readlink(directory) if stat.S_ISLNK(st.st_mode) else None
    except OSError:  # gone or changed since: said as the open's own error below
        st = target = None
    if st is not None and target is not None:
        return StormUntrusted(
            f"refusing the stormd socket directory {directory}: it is a symlink (to {target!r}, owned by uid "
            f"{st.st_uid}); accepted: a directory itself, not a symlink to one, of {_whose(trusted_uids())} "
            f"that group and others cannot write to. Whoever owns the link can repoint it between the check "
            f"and the connection: remove it and start stormd again, or set STORMD_SOCKET to a socket in a "
            f"directory of yours")
    if isinstance(e, FileNotFoundError):
        return _no_socket(path)
    if isinstance(e, PermissionError):
        return _no_access(path)
    return StormUnavailable(f"cannot open the stormd socket directory {directory}: {e.strerror}")


def _no_socket(path: Path) -> StormNoDaemon:
    return StormNoDaemon(f"no stormd socket at {path}; start one with `stormd`, set STORMD_SOCKET, "
                         f"or use mode='embedded'")


def _no_access(path: Path) -> StormUnavailable:
    return StormUnavailable(f"no access to the stormd socket {path}: its directory is private to the daemon's "
                            f"user; run training as that user, or use mode='embedded'")


def _kind(mode: int) -> str:
    return ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a regular file" if stat.S_ISREG(mode) else "a file other than a socket")


def _check_reachable(checked: CheckedSocket, d: os.stat_result) -> None:
    """Refuse to go on if /proc/self/fd does not lead to the directory that was opened (no /proc
    mounted): connecting by the name instead would reopen the race the open directory closes."""
    try:
        through = os.stat(checked.via.parent)
        why = "it leads to another directory"
    except OSError as e:
        through, why = None, e.strerror
    if through is None or (through.st_dev, through.st_ino) != (d.st_dev, d.st_ino):
        raise StormUntrusted(f"refusing the stormd socket {checked.path}: the client connects only through the "
                             f"directory it checked, as {checked.via.parent}, and that failed ({why}); "
                             f"accepted: a Linux system with /proc mounted. Use mode='embedded' here")


def check_pool(path: str, st: os.stat_result) -> None:
    """Raise StormUntrusted unless the pool segment the daemon named (``st``: its status, taken on the
    opened file) is a regular file of a trusted uid that group and others cannot open, and a stormd
    segment by its name (stormd-UID-PID-HEX, as SharedPool.create names them) at an absolute path.
    So whatever a daemon names, the client writes into no other file of the user's (a key, a
    document that happens to be 0600)."""
    uids = trusted_uids()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in uids or mode & 0o077:
        raise StormUntrusted(
            f"refusing stormd's pool segment {path}: it belongs to uid {st.st_uid} with mode {mode:#o}; "
            f"accepted: a file of {_whose(uids)} that only its owner can open (mode 0600), as stormd creates "
            f"it. The daemon at this socket is not one of yours, or its pool is open to other users")
    if not os.path.isabs(path) or not SEGMENT_NAME.fullmatch(os.path.basename(path)):
        raise StormUntrusted(
            f"refusing stormd's pool segment {path}: it is not named as stormd names its segments; accepted: "
            f"an absolute path whose file name is stormd-UID-PID-HEX (stormd creates one such in its "
            f"pool_dir). The daemon at this socket is not one of yours")
