"""The host pool: one shared-memory segment the daemon owns and clients map.

The daemon creates a file in a tmpfs (``/dev/shm`` by default), reserves its
pages up front with ``posix_fallocate`` (so a full tmpfs is a clear start-up
error, not a SIGBUS in the middle of a step) and maps it. Clients map the same
file from the path in the HELLO reply and copy tensors in and out of it.
The daemon holds the segment locked for as long as its pool lives (held.py),
so a segment is removed as stale only once no process holds it.
The embedded store uses an anonymous mapping of the same class, which may
reserve more address space than it exposes and grow into it (``grow``): the
mapping never moves, so offsets and addresses handed out stay valid.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .held import create_held, remove_if_unheld

SEGMENT_PREFIX = "stormd-"
MIN_POOL_SIZE = 4096  # the smallest pool stormd or the embedded store accepts
# A growable pool maps its whole cap at once as address space only: no swap or commit charge is
# set aside for pages not yet written. Python's mmap module names the flag from 3.12 on; Linux's value.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class PoolError(RuntimeError):
    """The pool cannot be created or mapped; the message names the limit and the fix."""


@dataclass(frozen=True)
class PoolDescriptor:
    path: str
    size: int

    def to_wire(self) -> dict:
        return {"path": self.path, "size": self.size}


class SharedPool:
    def __init__(self, mapping: mmap.mmap, size: int, path: str | None, owner: bool, held: int | None = None):
        """``held``: the descriptor of the segment whose lock says that its daemon lives (create's)."""
        self._mmap = mapping
        self.size = size  # the bytes in use: extents lie below it; ``grow`` raises it up to ``reserved``
        self.reserved = len(mapping)
        self.path = path
        self._owner = owner
        self._held = held
        self.cuda_registered = False  # page-locked with cudaHostRegister (stormd.wire.cuda.register_pool)
        self.cuda_ranges: list[tuple[int, int]] = []  # the (offset, bytes) of each cudaHostRegister call
        self._bytes: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8, count=self.reserved)

    @classmethod
    def create(cls, size: int, directory: str = "/dev/shm") -> "SharedPool":
        """Create, reserve and map a new segment; refuse clearly when it cannot fit."""
        if size <= 0:
            raise PoolError(f"pool size must be positive, got {size}")
        d = Path(directory)
        if not d.is_dir():
            raise PoolError(f"pool directory {directory} does not exist; set --pool-dir to a tmpfs such as /dev/shm")
        remove_stale_segments(d)
        path, fd = _new_segment(d)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                raise PoolError(f"cannot reserve {size} bytes in {directory}: {e.strerror}; "
                                f"lower --pool-size or free space there") from None
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, size, str(path), owner=True, held=fd)

    @classmethod
    def anonymous(cls, size: int, reserve: int | None = None) -> "SharedPool":
        """A private pool for the embedded store; pages are only committed when written. ``reserve``:
        the address space to map (no memory is set aside for it), so that ``grow`` can extend the pool
        in place up to it."""
        if size <= 0:
            raise PoolError(f"pool size must be positive, got {size}")
        reserve = size if reserve is None else reserve
        if reserve < size:
            raise PoolError(f"cannot reserve {reserve} bytes for a pool of {size}")
        flags = mmap.MAP_SHARED | _MAP_NORESERVE
        try:
            mapping = mmap.mmap(-1, reserve, flags=flags)
        except OSError as e:
            raise PoolError(f"cannot map {reserve} bytes of address space for the pool: {e.strerror}") from None
        return cls(mapping, size, None, owner=False)

    @property
    def page_locked_bytes(self) -> int:
        """The bytes of the pool this process has page-locked for CUDA copies (0: none)."""
        return sum(n for _, n in self.cuda_ranges)

    def grow(self, size: int) -> None:
        """Extend the pool in place to ``size`` bytes, within the address space it reserved."""
        if not self.size <= size <= self.reserved:
            raise PoolError(f"cannot grow the pool of {self.size} bytes to {size}: it reserved {self.reserved}")
        self.size = size

    @classmethod
    def attach(cls, path: str, size: int, check: Callable[[os.stat_result], None] | None = None) -> "SharedPool":
        """Map a segment a daemon created (client side). ``check`` sees the opened file's status
        before it is mapped (the client's trust check: whose file it is, who else may open it)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise PoolError(f"cannot open the daemon's pool {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if check is not None:
                check(st)
            actual = st.st_size
            if actual < size:
                raise PoolError(f"pool {path} has {actual} bytes, the daemon announced {size}")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(mapping, size, path, owner=False)

    @property
    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(self.path or "", self.size)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over [offset, offset + nbytes) of the pool (no copy)."""
        return self._mapped(offset, nbytes)[offset:offset + nbytes]

    def address(self, offset: int, nbytes: int) -> int:
        """The virtual address of [offset, offset + nbytes) in this process (for CUDA copies)."""
        return self._mapped(offset, nbytes).data_ptr() + offset

    def _mapped(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._bytes is None:
            raise PoolError("pool is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise PoolError(f"extent [{offset}, {offset + nbytes}) lies outside the pool of {self.size} bytes")
        return self._bytes

    def close(self) -> None:
        self._bytes = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the last view does
        if self._owner and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._owner = False
        if self._held is not None:  # after the unlink: until then no sweep may take the segment for stale
            os.close(self._held)
            self._held = None


# stormd-UID-PID-HEX: what create names a segment; clients accept no other pool (storm/trust.py)
SEGMENT_NAME = re.compile(rf"^{SEGMENT_PREFIX}(\d+)-(\d+)-[0-9a-f]+$")


def _new_segment(directory: Path) -> tuple[Path, int]:
    """A new segment's path and the descriptor that holds it locked for the pool's life."""
    # Between the file's creation and its lock, another namespace's daemon, to which this pid names no
    # process, may sweep it as stale; then it is gone and a second name is taken.
    for _ in range(3):
        path = directory / f"{SEGMENT_PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            return path, create_held(path)
        except FileNotFoundError:
            continue
    raise PoolError(f"each new segment in {directory} was removed as it was created: another stormd sweeps "
                    f"that directory; give each daemon a --pool-dir of its own")


def remove_stale_segments(directory: Path) -> list[str]:
    """Unlink segments of this uid whose daemon is gone (a kill -9 leaves them behind): only those
    no process holds locked (the kernel drops a daemon's lock when it dies, in whichever PID
    namespace it ran) and whose pid names no live process here either (a daemon of an earlier
    version holds no lock)."""
    removed = []
    for p in directory.iterdir():
        m = SEGMENT_NAME.match(p.name)
        if not m or int(m.group(1)) != os.getuid():
            continue
        pid = int(m.group(2))
        if pid == os.getpid() or _alive(pid):
            continue
        if remove_if_unheld(p):
            removed.append(str(p))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
