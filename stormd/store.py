"""The activation store: key -> extent of the pool plus what it takes to rebuild the tensor.

Keys are chosen by the client and live in its session's namespace, so one
session can neither see nor free another's tensors. The store never touches
the bytes: clients copy into the extent PUT reserved and SEAL it with a
checksum; GET hands the extent back only once sealed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .allocator import ExtentAllocator
from .protocol import ErrorCode, ProtocolError


@dataclass
class Entry:
    key: int
    step: int
    offset: int
    nbytes: int
    dtype: str
    shape: list[int]
    strides: list[int]
    storage_offset: int
    codec: str
    sealed: bool = False
    checksum: int | None = None  # None: sealed without one (not verified on GET)

    def describe(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype, "shape": self.shape,
                "strides": self.strides, "storage_offset": self.storage_offset, "codec": self.codec,
                "checksum": self.checksum}


@dataclass
class SessionCounters:
    puts: int = 0
    gets: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    pool_full: int = 0
    held_bytes: int = 0
    peak_held_bytes: int = 0


@dataclass
class _SessionEntries:
    entries: dict[int, Entry] = field(default_factory=dict)
    counters: SessionCounters = field(default_factory=SessionCounters)


class Store:
    def __init__(self, allocator: ExtentAllocator):
        self.allocator = allocator
        self._sessions: dict[int, _SessionEntries] = {}

    def _of(self, session: int) -> _SessionEntries:
        return self._sessions.setdefault(session, _SessionEntries())

    def put(self, session: int, f: dict[str, Any]) -> Entry:
        s = self._of(session)
        if f["key"] in s.entries:
            raise ProtocolError(ErrorCode.DUPLICATE_KEY, f"key {f['key']} is already stored in this session")
        if f["nbytes"] > self.allocator.capacity:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"{f['nbytes']} bytes is more than the whole pool ({self.allocator.capacity} bytes)")
        offset = self.allocator.alloc(f["nbytes"])
        if offset is None:
            s.counters.pool_full += 1
            st = self.allocator.stats()
            raise ProtocolError(ErrorCode.POOL_FULL,
                                f"no free extent of {f['nbytes']} bytes ({st.capacity - st.used} bytes free, "
                                f"largest extent {st.largest_free})")
        e = Entry(f["key"], f["step"], offset, f["nbytes"], f["dtype"], list(f["shape"]), list(f["strides"]),
                  f["storage_offset"], f["codec"])
        s.entries[e.key] = e
        c = s.counters
        c.puts += 1
        c.bytes_in += e.nbytes
        c.held_bytes += e.nbytes
        c.peak_held_bytes = max(c.peak_held_bytes, c.held_bytes)
        return e

    def _entry(self, session: int, key: int) -> Entry:
        e = self._of(session).entries.get(key)
        if e is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"key {key} is not stored in this session")
        return e

    def seal(self, session: int, key: int, checksum: int | None) -> None:
        e = self._entry(session, key)
        e.sealed, e.checksum = True, checksum

    def get(self, session: int, key: int) -> Entry:
        e = self._entry(session, key)
        if not e.sealed:
            raise ProtocolError(ErrorCode.NOT_SEALED, f"key {key} was reserved by PUT but never sealed")
        c = self._of(session).counters
        c.gets += 1
        c.bytes_out += e.nbytes
        return e

    def free(self, session: int, keys: list[int] | None = None, step: int | None = None) -> int:
        """Free the given keys, or all of a step, or (neither given) all of the session."""
        s = self._sessions.get(session)
        if s is None:
            return 0
        if keys is not None:
            missing = [k for k in keys if k not in s.entries]
            if missing:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"keys {missing[:8]} are not stored in this session")
            doomed = keys
        elif step is not None:
            doomed = [k for k, e in s.entries.items() if e.step == step]
        else:
            doomed = list(s.entries)
        for k in doomed:
            e = s.entries.pop(k)
            self.allocator.free(e.offset)
            s.counters.held_bytes -= e.nbytes
        return len(doomed)

    def drop_session(self, session: int) -> int:
        freed = self.free(session)
        self._sessions.pop(session, None)
        return freed

    def session_stats(self, session: int) -> dict[str, Any]:
        s = self._of(session)
        return {"keys": len(s.entries), **vars(s.counters)}

    def node_stats(self) -> dict[str, Any]:
        st = self.allocator.stats()
        return {"capacity": st.capacity, "used": st.used, "peak": st.peak,
                "fragmentation": round(st.fragmentation, 6), "free_extents": st.free_extents,
                "keys": sum(len(s.entries) for s in self._sessions.values())}
