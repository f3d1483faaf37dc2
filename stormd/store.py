"""The activation store: key -> extent of the pool plus what it takes to rebuild the tensor.

Keys are chosen by the client and live in its session's namespace, so one
session can neither see nor free another's tensors. Clients copy into the
extent PUT reserved and SEAL it with a checksum; GET hands the extent back
only once sealed. Where the bytes sit is the store's business between SEAL and
GET: extents come from the session's step placement (placement.py) or the general
allocator (allocator.py), and when the pool is full the store moves sealed,
not yet fetched extents to the spill file and back (spill.py). A GET reply
therefore carries the offset the bytes have now, which may differ from PUT's.
With ``check_extents`` on, a ledger (ledger.py) refuses an extent that would
overlap a live one, whichever of the two placed it.
Budgets: a node-wide pool, and per client (by the name it gives in HELLO) a
quota on the bytes it holds and a priority that orders what is spilled first.

Spill I/O fails as disks do (full, a file cut short): a failed write leaves
its tensor in the pool, and background spill rests until a write succeeds
again (a PUT that needs the room tries one write and is refused POOL_FULL
saying why); a failed read-back loses that one key's bytes (its GET is
SPILL_FAILED). Neither is ever raised to a caller that did not ask for that
key, so one bad write cannot fail other sessions' requests or their BYE.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from .allocator import ExtentAllocator
from .config import DaemonConfig
from .ledger import ExtentConflict, ExtentLedger
from .placement import StepPlacement
from .spill import SpillFile, SpillIO, SpillOrder
from .wire.pool import SharedPool
from .wire.protocol import ErrorCode, ProtocolError

log = logging.getLogger("stormd")

# Background spill starts when the pool is this full and stops once it is down to
# SPILL_TARGET, so a burst of PUTs usually finds room without waiting for a write.
# Prefetch (reading spilled extents back before their GET) only fills up to SPILL_TARGET,
# so it never triggers a spill of its own.
SPILL_START = 0.90
SPILL_TARGET = 0.80
MAX_PREFETCHING = 2  # read-backs in flight per session


class Where:
    """Where an entry's bytes are."""

    POOL = "pool"
    SPILLING = "spilling"  # in the pool, a copy to the spill file is being written
    SPILLED = "spilled"    # only in the spill file
    LOADING = "loading"    # being read back into a pool extent
    LOST = "lost"          # reading it back failed: its bytes are gone (Entry.lost says why)


@dataclass
class Entry:
    key: int
    step: int
    offset: int | None  # None while spilled
    nbytes: int
    dtype: str
    shape: list[int]
    strides: list[int]
    storage_offset: int
    codec: str
    raw_nbytes: int         # the storage's size before the client encoded it (= nbytes for raw)
    slot: int = 0           # order within its step: the placement's index
    planned: bool = False   # placed in the session's planned region
    sealed: bool = False
    fetched: bool = False   # GET answered: the client may read the extent, so it stays until FREE
    checksum: int | None = None  # None: sealed without one (not verified on GET)
    where: str = Where.POOL
    file_offset: int | None = None
    io: Future | None = None
    lost: str | None = None  # why its bytes are gone (Where.LOST)

    def describe(self) -> dict[str, Any]:
        return {"offset": self.offset, "nbytes": self.nbytes, "raw_nbytes": self.raw_nbytes, "dtype": self.dtype,
                "shape": self.shape,
                "strides": self.strides, "storage_offset": self.storage_offset, "codec": self.codec,
                "checksum": self.checksum}


@dataclass
class SessionCounters:
    puts: int = 0
    gets: int = 0
    bytes_in: int = 0            # as stored (encoded)
    raw_bytes_in: int = 0        # as the tensors were: raw_bytes_in / bytes_in is the compression ratio
    bytes_out: int = 0
    pool_full: int = 0
    quota_refused: int = 0
    held_bytes: int = 0          # in the pool or spilled: what the quota counts
    peak_held_bytes: int = 0
    spilled_bytes: int = 0       # of held_bytes, in the spill file now


@dataclass(frozen=True)
class ClientLimits:
    quota: int = 0      # bytes a session may hold (pool + spill); 0: no limit but the pool
    priority: int = 0   # higher stays in the pool longer; lower is spilled first


@dataclass(frozen=True)
class StoreOptions:
    spill_dir: str | None = None   # None: spill off (a full pool is POOL_FULL)
    spill_limit: int = 0
    default_limits: ClientLimits = ClientLimits()
    clients: dict[str, ClientLimits] = field(default_factory=dict)  # by the name a client gives in HELLO
    # what POOL_FULL says while spill is off: stormd's settings; the embedded store cannot spill
    spill_off: str = "spill is off (set spill = true and spill_dir to let stormd move old tensors to disk)"
    check_extents: bool = False    # keep a ledger that refuses overlapping extents (ledger.py)
    spill_io: SpillIO = field(default_factory=SpillIO)  # how bytes reach the spill file (tests: a failing disk)

    @classmethod
    def from_config(cls, config: DaemonConfig) -> "StoreOptions":
        return cls(config.spill_dir if config.spill else None, config.spill_limit,
                   ClientLimits(config.client_quota, config.client_priority),
                   {name: ClientLimits(row["quota"], row["priority"]) for name, row in config.clients.items()},
                   check_extents=config.check_extents)


@dataclass
class NodeCounters:
    """Totals since start (sessions' own counters go when they end)."""

    spilled_total: int = 0       # bytes written to the spill file
    read_back_total: int = 0     # bytes read back from it
    read_back_on_get: int = 0    # read-backs a GET had to wait for (prefetch came too late)
    prefetched: int = 0          # read-backs started before their GET
    spill_write_errors: int = 0  # writes to the spill file that failed (their tensors stayed in the pool)
    spill_read_errors: int = 0   # read-backs that failed (those keys' bytes are lost)
    plan_hits: int = 0
    plan_misses: int = 0


@dataclass
class _SessionEntries:
    placement: StepPlacement
    name: str = ""
    limits: ClientLimits = ClientLimits()
    entries: dict[int, Entry] = field(default_factory=dict)
    counters: SessionCounters = field(default_factory=SessionCounters)
    spilled: SortedList = field(default_factory=SortedList)  # (step, key) of spilled entries: read back last first
    loading: int = 0


class Store:
    def __init__(self, allocator: ExtentAllocator, pool: SharedPool | None = None,
                 options: StoreOptions | None = None):
        self.allocator = allocator
        self.pool = pool
        self.options = options or StoreOptions()
        self.spill = SpillFile(self.options.spill_dir, self.options.spill_limit, self.options.spill_io) \
            if self.options.spill_dir and pool is not None else None
        self.order = SpillOrder()
        self.node = NodeCounters()
        self._sessions: dict[int, _SessionEntries] = {}
        self._in_flight: list[tuple[int, Entry]] = []  # (session, entry) with spill I/O running
        self.ledger = ExtentLedger(allocator.capacity) if self.options.check_extents else None
        # Why the last spill write failed, until one succeeds: background spill rests meanwhile, so
        # a full disk costs one log line and one write per PUT that needs room, not one per SEAL.
        self.spill_failure: str | None = None
        self._reads_failing = False  # a read-back failed and none has succeeded since: logged once

    def open_session(self, session: int, name: str = "") -> None:
        limits = self.options.clients.get(name, self.options.default_limits)
        self._sessions[session] = _SessionEntries(StepPlacement(self.allocator), name, limits)

    def _of(self, session: int) -> _SessionEntries:
        s = self._sessions.get(session)
        if s is None:
            self.open_session(session)
            s = self._sessions[session]
        return s

    def put(self, session: int, f: dict[str, Any]) -> Entry:
        self._reap()
        s = self._of(session)
        if f["key"] in s.entries:
            raise ProtocolError(ErrorCode.DUPLICATE_KEY, f"key {f['key']} is already stored in this session")
        if f["nbytes"] > self.allocator.capacity:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"{f['nbytes']} bytes is more than the whole pool ({self.allocator.capacity} bytes)")
        c = s.counters
        quota = s.limits.quota
        if quota and c.held_bytes + f["nbytes"] > quota:
            c.quota_refused += 1
            who = f"client {s.name!r}" if s.name else "this client"
            raise ProtocolError(ErrorCode.QUOTA,
                                f"{who} holds {c.held_bytes} bytes and its quota is {quota}; {f['nbytes']} more "
                                f"do not fit: raise its quota (client_quota, or clients.{s.name or 'NAME'}.quota "
                                f"in stormd.toml) or offload less (storm.offload(budget=...))")
        slot = s.placement.slot(f["step"])
        offset = s.placement.place(f["step"], slot, self.allocator.aligned(f["nbytes"]))
        planned = offset is not None
        try:
            if offset is None:
                offset = self._alloc(f["nbytes"], s)
            self._claim(session, s, f["key"], offset, f["nbytes"], planned)
        except (ProtocolError, ExtentConflict):
            s.placement.cancel(f["step"], slot)  # not stored: no lifetime to learn from
            raise
        e = Entry(f["key"], f["step"], offset, f["nbytes"], f["dtype"], list(f["shape"]), list(f["strides"]),
                  f["storage_offset"], f["codec"], f.get("raw_nbytes", f["nbytes"]), slot=slot, planned=planned)
        s.entries[e.key] = e
        c.puts += 1
        c.bytes_in += e.nbytes
        c.raw_bytes_in += e.raw_nbytes
        c.held_bytes += e.nbytes
        c.peak_held_bytes = max(c.peak_held_bytes, c.held_bytes)
        return e

    def _alloc(self, nbytes: int, s: _SessionEntries) -> int:
        """A general-allocator extent; when the pool is full, spill (waiting for the writes) until one fits."""
        offset = self.allocator.alloc(nbytes)
        while offset is None and self.spill is not None:
            if not self._spill_next(wait=True):
                break
            offset = self.allocator.alloc(nbytes)
        if offset is None:
            s.counters.pool_full += 1
            st = self.allocator.stats()
            if self.spill is None:
                why = self.options.spill_off
            elif self.spill_failure is not None:
                why = (f"spilling to make room failed: {self.spill_failure}; the tensors stay in the pool "
                       f"until the spill file takes writes again (free space there, or set spill_dir to another disk)")
            elif self.spill.space.stats().largest_free < nbytes:
                why = f"the spill file is full too (spill_limit {self.spill.space.capacity} bytes; raise it)"
            else:
                why = ("every tensor left in the pool is being written or was fetched and not yet freed "
                       "(lower the client's prefetch_bytes so fetched tensors fit)")
            raise ProtocolError(ErrorCode.POOL_FULL,
                                f"no free extent of {nbytes} bytes ({st.capacity - st.used} bytes free, "
                                f"largest extent {st.largest_free}); {why}")
        return offset

    def find(self, session: int, key: int) -> Entry | None:
        """The session's entry of ``key``, or None."""
        s = self._sessions.get(session)
        return s.entries.get(key) if s is not None else None

    def _entry(self, session: int, key: int) -> Entry:
        e = self.find(session, key)
        if e is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"key {key} is not stored in this session")
        return e

    def seal(self, session: int, key: int, checksum: int | None) -> None:
        self._reap()
        s = self._of(session)
        e = self._entry(session, key)
        if not e.sealed:
            e.sealed, e.checksum = True, checksum
            if not e.fetched:
                self.order.add(s.limits.priority, e.step, e.key, session)
        self._spill_in_background()

    def get(self, session: int, key: int) -> Entry:
        """The entry, in the pool: a spilled one is read back first (the reply's offset may differ
        from PUT's). From now on it stays where it is until FREE."""
        self._reap()
        s = self._of(session)
        e = self._entry(session, key)
        if not e.sealed:
            raise ProtocolError(ErrorCode.NOT_SEALED, f"key {key} was reserved by PUT but never sealed")
        self._settle(session, e)
        if e.where == Where.SPILLED:
            self.node.read_back_on_get += 1
            self._read_back(session, s, e, self._alloc(e.nbytes, s))
            self._settle(session, e)
        if e.where == Where.LOST:
            raise ProtocolError(ErrorCode.SPILL_FAILED,
                                f"key {key}: {e.lost}; its bytes are lost (this key's only: the session's other "
                                f"tensors are intact); FREE it")
        if not e.fetched:
            e.fetched = True
            self.order.discard(s.limits.priority, e.step, e.key, session)
        c = s.counters
        c.gets += 1
        c.bytes_out += e.nbytes
        self._prefetch(session, s)
        return e

    def keys(self, session: int, keys: list[int] | None = None, step: int | None = None) -> list[int]:
        """The given keys (all stored, or NOT_FOUND), or those of a step, or (neither given) all."""
        s = self._sessions.get(session)
        if s is None:
            return []
        if keys is not None:
            missing = [k for k in keys if k not in s.entries]
            if missing:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"keys {missing[:8]} are not stored in this session")
            return list(dict.fromkeys(keys))  # a key named twice is freed once
        if step is not None:
            return [k for k, e in s.entries.items() if e.step == step]
        return list(s.entries)

    def free(self, session: int, keys: list[int] | None = None, step: int | None = None) -> int:
        """Free the given keys, or all of a step, or (neither given) all of the session."""
        self._reap()
        s = self._sessions.get(session)
        if s is None:
            return 0
        doomed = self.keys(session, keys, step)
        for k in doomed:
            e = s.entries[k]
            self._settle(session, e)
            if e.where == Where.SPILLED:
                self._unspill(s, e)
            elif e.where != Where.LOST:  # a lost entry's extent and file space went when its read failed
                self._release_extent(s, e)
            self.order.discard(s.limits.priority, e.step, e.key, session)
            s.placement.forget(e.step, e.slot)
            del s.entries[k]
            s.counters.held_bytes -= e.nbytes
        self._prefetch(session, s)
        return len(doomed)

    def _claim(self, session: int, s: _SessionEntries, key: int, offset: int, nbytes: int, planned: bool) -> None:
        """Record a tensor's new pool extent in the ledger, when checking. One that overlaps a live extent
        is a placement bug: it is given back and the request refused, so the tensor there keeps its bytes."""
        if self.ledger is None:
            return
        try:
            self.ledger.place(offset, self.allocator.aligned(nbytes), f"key {key} of session {session}")
        except ExtentConflict:
            self._give_back(s, offset, planned)
            raise

    def _release_extent(self, s: _SessionEntries, e: Entry) -> None:
        if self.ledger is not None:
            self.ledger.release(e.offset, self.allocator.aligned(e.nbytes))
        self._give_back(s, e.offset, e.planned)
        e.offset, e.planned = None, False

    def _give_back(self, s: _SessionEntries, offset: int, planned: bool) -> None:
        if planned:
            s.placement.release(offset)
        else:
            self.allocator.free(offset)

    def _unspill(self, s: _SessionEntries, e: Entry) -> None:
        self.spill.release(e.file_offset)
        s.spilled.discard((e.step, e.key))
        s.counters.spilled_bytes -= e.nbytes
        e.file_offset = None

    # --- spill ----------------------------------------------------------------

    def _spill_next(self, wait: bool) -> bool:
        """Start spilling the first victim (and wait for it, and any write in flight, when asked).
        False when nothing can move: no victim, no room in the spill file, or (waiting) the write failed."""
        if wait and any(e.where == Where.SPILLING for _, e in self._in_flight):
            self._reap(block=True)  # writes already under way free their extents first
            return True
        victim = self.order.pop_first()
        if victim is None:
            return False
        session, key = victim
        s, e = self._sessions[session], self._sessions[session].entries[key]
        started = self.spill.write(self.pool.view(e.offset, e.nbytes))
        if started is None:
            self.order.add(s.limits.priority, e.step, e.key, session)
            return False
        e.file_offset, e.io = started
        e.where = Where.SPILLING
        self._in_flight.append((session, e))
        if wait:
            self._settle(session, e)
            return e.where == Where.SPILLED
        return True

    def _spill_in_background(self) -> None:
        if self.spill is None or self.spill_failure is not None:
            return
        cap = self.allocator.capacity
        if self.allocator.stats().used <= SPILL_START * cap:
            return
        leaving = sum(e.nbytes for _, e in self._in_flight if e.where == Where.SPILLING)
        while self.allocator.stats().used - leaving > SPILL_TARGET * cap:
            if not self._spill_next(wait=False):
                return
            leaving += self._in_flight[-1][1].nbytes

    def _read_back(self, session: int, s: _SessionEntries, e: Entry, offset: int) -> None:
        self._claim(session, s, e.key, offset, e.nbytes, planned=False)
        s.spilled.discard((e.step, e.key))
        e.offset = offset
        e.io = self.spill.read(e.file_offset, self.pool.view(offset, e.nbytes))
        e.where = Where.LOADING
        s.loading += 1
        self._in_flight.append((session, e))

    def _prefetch(self, session: int, s: _SessionEntries) -> None:
        """Read back the spilled tensors backward needs next (the latest saved) while the pool has
        room below SPILL_TARGET, so their GET finds them in the pool."""
        if self.spill is None:
            return
        target = SPILL_TARGET * self.allocator.capacity
        while s.spilled and s.loading < MAX_PREFETCHING:
            e = s.entries[s.spilled[-1][1]]
            if self.allocator.stats().used + e.nbytes > target:
                return
            offset = self.allocator.alloc(e.nbytes)
            if offset is None:
                return
            self.node.prefetched += 1
            self._read_back(session, s, e, offset)

    def _settle(self, session: int, e: Entry) -> None:
        """Wait for ``e``'s spill I/O, if any, and apply it."""
        if e.io is not None:
            self._in_flight.remove((session, e))
            self._finish(session, e)

    def _reap(self, block: bool = False) -> None:
        """Apply spill I/O that has finished (all of it, waiting, when ``block``). Never raises for a
        failed one: _finish applies the failure to its own entry."""
        if not self._in_flight:
            return
        still = []
        for session, e in self._in_flight:
            if block or e.io.done():
                self._finish(session, e)
            else:
                still.append((session, e))
        self._in_flight = still

    def _finish(self, session: int, e: Entry) -> None:
        """Apply ``e``'s spill I/O (waiting for it): its new place, or what its failure leaves."""
        s = self._sessions[session]
        failure = e.io.exception()  # whatever the worker raised is this entry's, never the caller's
        e.io = None
        if failure is not None:
            if e.where == Where.SPILLING:
                self._write_failed(session, s, e, failure)
            else:
                self._read_failed(session, s, e, failure)
        elif e.where == Where.SPILLING:  # written: the pool extent is free for others now
            self._release_extent(s, e)
            e.where = Where.SPILLED
            s.spilled.add((e.step, e.key))
            s.counters.spilled_bytes += e.nbytes
            self.node.spilled_total += e.nbytes
            if self.spill_failure is not None:
                log.warning("spill writes succeed again; background spill resumes",
                            extra={"spill_dir": self.spill.directory, "failed_writes": self.node.spill_write_errors})
                self.spill_failure = None
        else:  # read back: the file space is free, the entry is in the pool again
            self.spill.release(e.file_offset)
            e.file_offset = None
            e.where = Where.POOL
            s.loading -= 1
            s.counters.spilled_bytes -= e.nbytes
            self.node.read_back_total += e.nbytes
            self._reads_failing = False
            if not e.fetched:
                self.order.add(s.limits.priority, e.step, e.key, session)

    def _write_failed(self, session: int, s: _SessionEntries, e: Entry, failure: BaseException) -> None:
        """The bytes are still in the pool extent: the entry stays there, and may be spilled again
        once the disk takes writes."""
        self.spill.release(e.file_offset)
        e.file_offset = None
        e.where = Where.POOL
        self.order.add(s.limits.priority, e.step, e.key, session)
        self.node.spill_write_errors += 1
        if self.spill_failure is None:
            log.error("spill write failed: tensors stay in the pool and background spill rests until a write "
                      "succeeds", extra={"spill_dir": self.spill.directory, "error": str(failure)})
        self.spill_failure = f"writing to the spill file in {self.spill.directory} failed: {failure}"

    def _read_failed(self, session: int, s: _SessionEntries, e: Entry, failure: BaseException) -> None:
        """The pool extent holds no whole copy and the file's cannot be read: the key's bytes are lost.
        Both places are released now; the entry stays (its GET says why) until FREE."""
        self._release_extent(s, e)
        self.spill.release(e.file_offset)
        e.file_offset = None
        e.where = Where.LOST
        e.lost = f"reading it back from the spill file in {self.spill.directory} failed: {failure}"
        s.loading -= 1
        s.counters.spilled_bytes -= e.nbytes
        self.node.spill_read_errors += 1
        if not self._reads_failing:  # the rest are counted (spill_read_errors) and their GETs logged as errors
            self._reads_failing = True
            log.error("spill read-back failed: that tensor's bytes are lost", extra={
                "session": session, "key": e.key, "spill_dir": self.spill.directory, "error": str(failure)})

    # --- sessions and statistics ----------------------------------------------

    def drop_session(self, session: int) -> int:
        freed = self.free(session)
        s = self._sessions.pop(session, None)
        if s is not None:  # free() gave back the plan's region with its last tensor
            self.node.plan_hits += s.placement.stats.plan_hits
            self.node.plan_misses += s.placement.stats.plan_misses
        return freed

    def close(self) -> None:
        if self.spill is not None:
            self._reap(block=True)
            self.spill.close()

    def held_bytes(self, session: int) -> int:
        """What the session holds, in the pool and spilled (0 for a session the store does not know)."""
        s = self._sessions.get(session)
        return s.counters.held_bytes if s is not None else 0

    def session_stats(self, session: int) -> dict[str, Any]:
        s = self._of(session)
        return {"keys": len(s.entries), **vars(s.counters), "name": s.name, "quota": s.limits.quota,
                "priority": s.limits.priority, **vars(s.placement.stats), "plan": s.placement.describe()}

    def node_stats(self) -> dict[str, Any]:
        st = self.allocator.stats()
        live = self._sessions.values()
        spill = self.spill.space.stats() if self.spill is not None else None
        return {"capacity": st.capacity, "used": st.used, "peak": st.peak,
                "fragmentation": round(st.fragmentation, 6), "free_extents": st.free_extents,
                "largest_free": st.largest_free,
                "keys": sum(len(s.entries) for s in live),
                "spill": self.spill is not None,
                "spill_capacity": spill.capacity if spill else 0,
                "spilled_bytes": sum(s.counters.spilled_bytes for s in live),
                **vars(self.node),
                "plan_hits": self.node.plan_hits + sum(s.placement.stats.plan_hits for s in live),
                "plan_misses": self.node.plan_misses + sum(s.placement.stats.plan_misses for s in live)}
