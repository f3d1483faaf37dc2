"""Files their owner holds locked for its life: whether the owner is gone, as the kernel knows it.

The owner takes an exclusive flock on the file as it creates it and keeps that descriptor open
while it lives; the kernel drops the lock when the process ends, however it ends. So whoever can
take the lock knows the owner is gone. A pid in the file's name cannot tell that: the owner may
live in another PID namespace (a container that shares /dev/shm, ``--ipc=host``), where its pid
names no process, or another one. Used for stormd's pool segments (pool.py) and for the embedded
stores' ledger of the host's memory (stormd/host_share.py).
"""

from __future__ import annotations

import fcntl
import os

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


def create_held(path: str | os.PathLike, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """Create the file ``path`` (it must not exist) and lock it; returns the descriptor that holds the
    lock, for the caller to keep open as long as it lives. Raises FileNotFoundError if a sweep
    (remove_if_unheld) took the new file's lock before this did and removed it: try another name."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, mode, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweep holds it, which then unlinks the file
        if not _still_named(fd, path, dir_fd):
            raise FileNotFoundError(f"{os.fspath(path)} was removed as it was created")
        return fd
    except BaseException:
        os.close(fd)
        raise


def remove_if_unheld(path: str | os.PathLike, dir_fd: int | None = None) -> bool:
    """Unlink ``path`` if no process holds its lock (its owner is gone), taking the lock itself and
    unlinking while it holds it; True if it was removed. A file that is locked, gone, or cannot be
    opened is left as it is."""
    try:  # O_NONBLOCK: a FIFO of that name would block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            return False
        if not _still_named(fd, path, dir_fd):  # replaced since it was opened: not the file that was judged
            return False
        os.unlink(path, dir_fd=dir_fd)
        return True
    finally:
        os.close(fd)


def _still_named(fd: int, path: str | os.PathLike, dir_fd: int | None) -> bool:
    try:
        named = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
