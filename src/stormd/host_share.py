"""One cap for all the embedded stores of a host, so that together they stay within its memory.

An embedded store without a pool_size grows its pool on demand (growth.py). Were each store to
take its cap from the host's free memory alone, eight ranks training without a daemon would each
see all of it and together grow past it, to meet the OOM killer instead of POOL_FULL: free memory
falls only as a pool's pages are written, not as its growths are granted. So the stores of one
user on one host keep a ledger in /dev/shm, ``storm-embedded-UID`` (0700): one entry per live
store, holding its pool's size and held locked by it for its life (stormd/wire/held.py: the
kernel drops the lock of a store that dies, and the next look at the ledger removes its entry),
and the budget, the host's room (host_room) as the first store to join with no other alive read
it. A growth, decided and made under the ledger's lock, reaches at most the budget less what the
other stores hold, and never more than the pool's size and the room of that moment. Without a
ledger (no /dev/shm, or a directory there that is not this user's alone) a store's cap is its own,
and the log line that announces it says why. A pool of a fixed pool_size joins no ledger.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from .limits import host_room
from .wire.held import create_held, remove_if_unheld
from .wire.sizes import format_size

LEDGER_ROOT = "/dev/shm"  # a tmpfs every process of the host sees (containers: with --ipc=host)
Room = Callable[[], tuple[int, str]]  # host_room's signature: bytes a pool may take now, and whence
_LOCK, _BUDGET, _ENTRY = "lock", "budget", "store-"
_SIZE_WIDTH = 20  # an entry's size is rewritten in place at this width, so no rewrite needs new space
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC


class _Unshared(Exception):
    """No ledger to join; the message says why."""


class _Ledger:
    """The ledger's directory, opened once without following a symlink: nothing in it is reached by
    its path again, which a directory that is not this user's alone would let another repoint."""

    def __init__(self, root: str):
        if not os.path.isdir(root):
            raise _Unshared(f"{root} does not exist")
        self.path = Path(root, f"storm-embedded-{os.getuid()}")
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass  # checked below as it is, on what is opened
        except OSError as e:
            raise _Unshared(f"cannot make the ledger {self.path}: {e.strerror}") from None
        try:
            self.dir = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
        except OSError as e:  # a symlink (ELOOP) or a file (ENOTDIR) in its place
            raise _Unshared(f"refusing the ledger {self.path}: {e.strerror}; accepted: a directory, not a "
                            f"symlink, of this user that no one else can write to") from None
        self._lock = self._entry = -1
        self._name = ""
        try:
            st = os.fstat(self.dir)
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid != os.getuid() or mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise _Unshared(f"refusing the ledger {self.path}: it belongs to uid {st.st_uid} with mode "
                                f"{mode:#o}; accepted: a directory of this user that no one else can write to")
            self._lock = os.open(_LOCK, os.O_RDWR | os.O_CREAT | _OPEN, 0o600, dir_fd=self.dir)
        except BaseException:
            self.close()
            raise

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def others(self) -> list[int]:
        """The pool sizes of the other live stores; the entries of those that died are removed."""
        sizes = []
        for name in os.listdir(self.dir):
            if name.startswith(_ENTRY) and name != self._name and not remove_if_unheld(name, self.dir):
                lines = self._read(name)
                if lines:
                    sizes.append(int(lines[0]))
        return sizes

    def budget(self) -> tuple[int, str] | None:
        lines = self._read(_BUDGET)
        return (int(lines[0]), lines[1]) if len(lines) == 2 else None

    def set_budget(self, budget: int, source: str) -> None:
        fd = os.open(_BUDGET, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN, 0o600, dir_fd=self.dir)
        try:
            os.write(fd, f"{budget}\n{source}\n".encode())
        finally:
            os.close(fd)

    def enter(self) -> None:
        """Add this store's entry, at size 0, held for its life."""
        self._name = f"{_ENTRY}{os.getpid()}-{secrets.token_hex(4)}"
        self._entry = create_held(self._name, dir_fd=self.dir)
        self.record(0)

    def record(self, size: int) -> None:
        os.pwrite(self._entry, f"{size:0{_SIZE_WIDTH}d}\n".encode(), 0)

    def _read(self, name: str) -> list[str]:
        """The lines of ``name`` in the ledger; none if it is gone or unreadable."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _OPEN, dir_fd=self.dir)
        except OSError:
            return []
        try:
            lines = os.read(fd, 4096).decode(errors="replace").splitlines()
        finally:
            os.close(fd)
        return lines if lines and lines[0].isdigit() else []

    def close(self) -> None:
        if self._entry >= 0:
            try:
                os.unlink(self._name, dir_fd=self.dir)  # before the lock goes: no sweep takes a live entry
            except FileNotFoundError:
                pass
            os.close(self._entry)
        for fd in (self._lock, self.dir):
            if fd >= 0:
                os.close(fd)
        self._entry = self._lock = self.dir = -1


class HostShare:
    """One embedded store's part of the host's memory: ``cap``, the most its pool may ever reach (the
    address space it reserves), and ``source``, whence; ``allowance``, what it may reach now;
    ``shared_with``, what the cap is shared with, or why it is not (for the log line)."""

    def __init__(self, room: Room, cap: int, source: str, shared_with: str, ledger: _Ledger | None = None):
        self._room = room
        self.cap, self.source = cap, source
        self.shared_with = shared_with
        self._ledger = ledger

    def turn(self) -> AbstractContextManager:
        """Hold the ledger (the other stores' growths wait) while a growth is decided, made and
        recorded, so that no two stores are granted the same bytes."""
        return self._ledger.locked() if self._ledger is not None else nullcontext()

    def allowance(self, size: int) -> tuple[int, str]:
        """The most bytes the pool, now of ``size``, may reach, and why; within ``turn``."""
        limit, why = self.cap, self.source
        others = self._ledger.others() if self._ledger is not None else []
        if others:
            limit = self.cap - sum(others)
            why = (f"{format_size(self.cap)}: {self.source}; shared with {_others(len(others))} of this user "
                   f"on this host, which hold{'s' if len(others) == 1 else ''} {format_size(sum(others))}")
        room, whence = self._room()
        if size + room < limit:
            limit, why = size + room, f"its {format_size(size)} and what the host can give now: {whence}"
        return max(limit, 0), why

    def record(self, size: int) -> None:
        """Say in the ledger that the pool is now of ``size`` bytes; within ``turn``."""
        if self._ledger is not None:
            self._ledger.record(size)

    def close(self) -> None:
        """Leave the ledger: what the pool held is the other stores' again."""
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None


def join_host(room: Room = host_room, root: str | None = None) -> HostShare:
    """This store's share of the host: the ledger in ``root`` (LEDGER_ROOT when None) joined, its
    budget set from ``room()`` if no other store lives; where there is no ledger, a cap of its own
    from ``room()``, saying why it is not shared."""
    root = LEDGER_ROOT if root is None else root
    try:
        ledger = _Ledger(root)
    except _Unshared as e:
        return HostShare(room, *room(), f"not shared with other embedded stores: {e}")
    try:
        with ledger.locked():
            alive = len(ledger.others())
            budget = ledger.budget() if alive else None
            if budget is None:
                budget = room()
                ledger.set_budget(*budget)
            else:
                budget = budget[0], f"{budget[1]}, when the first of them started"
            ledger.enter()
    except OSError as e:  # a full /dev/shm, say: each store then keeps a cap of its own
        ledger.close()
        return HostShare(room, *room(), f"not shared with other embedded stores: the ledger {ledger.path}: "
                                        f"{e.strerror or e}")
    return HostShare(room, *budget, f"shared with the other embedded stores of this user on this host through "
                                    f"the ledger {ledger.path} ({_others(alive)} now)", ledger)


def _others(n: int) -> str:
    return f"{n} other embedded store{'' if n == 1 else 's'}"
