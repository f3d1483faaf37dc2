"""The spill file: where tensors go when the pool is full (which go: eviction.py; when: spiller.py).

``SpillFile`` is one unnamed file in the spill directory (O_TMPFILE, or
created and unlinked at once, so a killed daemon leaves nothing behind), as
large as the spill limit and sparse, sub-allocated by the same extent
allocator as the pool. Writes and reads run on one worker thread so the
daemon's loop keeps answering while bytes move; the spiller applies a finished
write (frees the pool extent) on the store's thread. The bytes move through a
``SpillIO``: the one seam between the store and the disk, so a test can stand
a failing disk (full, broken) in for the real one.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .allocator import DEFAULT_ALIGNMENT, ExtentAllocator


class SpillError(RuntimeError):
    """The spill file cannot be created; the message names the directory and the fix."""


class SpillIO:
    """Copies between pool views and the spill file with pwrite/preadv; raises OSError as the disk does."""

    def write(self, fd: int, src: torch.Tensor, where: int) -> None:
        view = memoryview(src.numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], where + done)

    def read(self, fd: int, dst: torch.Tensor, where: int) -> None:
        view = memoryview(dst.numpy())
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], where + done)
            if n == 0:
                raise OSError(f"spill file ended at {where + done} while reading back {len(view)} bytes")
            done += n


class SpillFile:
    """``alignment``: the pool's. A spilled tensor then takes in the file the extent it took in the
    pool, which is what a session's quota counts: with page-aligned extents a session of small
    tensors held many times its quota of the file every session shares."""

    def __init__(self, directory: str, limit: int, io: SpillIO | None = None, alignment: int = DEFAULT_ALIGNMENT):
        try:
            fd = _unnamed_file(directory)
            os.ftruncate(fd, limit)  # sparse: disk blocks are used only where extents are written
        except OSError as e:
            raise SpillError(f"cannot create a spill file of {limit} bytes in {directory}: {e.strerror}; "
                             f"set spill_dir to a writable local disk, lower spill_limit, or turn spill off") from None
        self.fd = fd
        self.directory = directory
        self.space = ExtentAllocator(limit, alignment=alignment)
        self.io = io or SpillIO()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="stormd-spill")

    def write(self, src: torch.Tensor) -> tuple[int, Future] | None:
        """Start copying ``src`` (a pool view) to the file: (file offset, future), or None when full.
        A failed write's future holds its OSError; the file space stays allocated until released."""
        where = self.space.alloc(src.numel())
        if where is None:
            return None
        return where, self._io.submit(self.io.write, self.fd, src, where)

    def read(self, where: int, dst: torch.Tensor) -> Future:
        """Start copying the bytes at file offset ``where`` into ``dst`` (a pool view)."""
        return self._io.submit(self.io.read, self.fd, dst, where)

    def release(self, where: int) -> None:
        self.space.free(where)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        os.close(self.fd)


def _unnamed_file(directory: str) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    # a file system without O_TMPFILE: a named file, unlinked before any byte is written
    path = os.path.join(directory, f"stormd-spill-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd

