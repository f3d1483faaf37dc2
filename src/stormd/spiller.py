"""Spill orchestration: moving sealed, not yet fetched tensors to the spill file and back.

When the pool is full the store asks the spiller for room: it writes the
eviction policy's next victim to the spill file (eviction.py, spill.py) and,
once written, gives its pool extent back. A spilled tensor is read back into
the pool on its GET, or earlier by prefetch. Writes and reads run on the spill
file's worker thread; the spiller applies finished ones on the store's thread
(``reap``, ``wait_for``).

Spill I/O fails as disks do (full, a file cut short): a failed write leaves
its tensor in the pool, and background spill rests until a write succeeds
again (a PUT that needs the room tries one write and is refused POOL_FULL
saying why); a failed read-back loses that one key's bytes (its GET is
SPILL_FAILED). Neither is ever raised to a caller that did not ask for that
key, so one bad write cannot fail other sessions' requests or their BYE.
"""

from __future__ import annotations

import logging

from .counters import NodeCounters
from .entries import Entry, SessionEntries, Where
from .eviction import EvictionPolicy
from .extents import PoolExtents
from .spill import SpillFile
from .wire.pool import SharedPool

log = logging.getLogger("stormd")

# Background spill starts when the pool is this full and stops once it is down to
# SPILL_TARGET, so a burst of PUTs usually finds room without waiting for a write.
# Prefetch (reading spilled extents back before their GET) only fills up to SPILL_TARGET,
# so it never triggers a spill of its own.
SPILL_START = 0.90
SPILL_TARGET = 0.80
MAX_PREFETCHING = 2  # read-backs in flight per session


class Spiller:
    """The store's spill: ``file`` None is spill off (nothing ever moves)."""

    def __init__(self, file: SpillFile | None, pool: SharedPool | None, extents: PoolExtents,
                 eviction: EvictionPolicy, sessions: dict[int, SessionEntries], node: NodeCounters):
        self.file = file
        self.pool = pool
        self.extents = extents
        self.allocator = extents.allocator
        self.eviction = eviction
        self._sessions = sessions  # the store's, by session id
        self.node = node
        self._in_flight: list[tuple[int, Entry]] = []  # (session, entry) with spill I/O running
        # Why the last spill write failed, until one succeeds: background spill rests meanwhile, so
        # a full disk costs one log line and one write per PUT that needs room, not one per SEAL.
        self.failure: str | None = None
        self._reads_failing = False  # a read-back failed and none has succeeded since: logged once

    def why_full(self, nbytes: int) -> str | None:
        """Why spilling could not make room for ``nbytes`` (for POOL_FULL), or None when spill is off."""
        if self.file is None:
            return None
        if self.failure is not None:
            return (f"spilling to make room failed: {self.failure}; the tensors stay in the pool "
                    f"until the spill file takes writes again (free space there, or set spill_dir to another disk)")
        free = self.file.space.stats().largest_free
        if free < nbytes:
            return f"the spill file is full too (spill_limit {self.file.space.capacity} bytes; raise it)"
        if len(self.eviction):
            return (f"the tensors that could leave the pool are larger than the spill file has room for "
                    f"({free} bytes free in one piece, spill_limit {self.file.space.capacity} bytes; raise it)")
        return ("every tensor left in the pool is being written or was fetched and not yet freed "
                "(lower the client's prefetch_bytes so fetched tensors fit)")

    def spill_one(self, wait: bool) -> bool:
        """Start spilling the first victim the spill file has room for (and wait for it, and any write
        in flight, when asked). False when nothing can move: spill off, no victim that fits, or
        (waiting) the write failed."""
        if self.file is None:
            return False
        if wait and any(e.where == Where.SPILLING for _, e in self._in_flight):
            self.reap(block=True)  # writes already under way free their extents first
            return True
        victim = self.eviction.pop_victim(self.file.space.stats().largest_free)
        if victim is None:
            return False
        session, key = victim
        s = self._sessions[session]
        e = s.entries[key]
        started = self.file.write(self.pool.view(e.offset, e.nbytes))
        if started is None:
            self.eviction.add(session, s.limits.priority, e)
            return False
        e.file_offset, e.io = started
        e.where = Where.SPILLING
        self._in_flight.append((session, e))
        if wait:
            self.wait_for(session, e)
            return e.where == Where.SPILLED
        return True

    def spill_in_background(self) -> None:
        """Start writes (not waiting for them) while the pool is fuller than SPILL_START, down to SPILL_TARGET."""
        if self.file is None or self.failure is not None:
            return
        cap = self.allocator.capacity
        if self.allocator.stats().used <= SPILL_START * cap:
            return
        leaving = sum(e.nbytes for _, e in self._in_flight if e.where == Where.SPILLING)
        while self.allocator.stats().used - leaving > SPILL_TARGET * cap:
            if not self.spill_one(wait=False):
                return
            leaving += self._in_flight[-1][1].nbytes

    def read_back(self, session: int, s: SessionEntries, e: Entry, offset: int) -> None:
        """Start reading spilled ``e`` back into the pool extent at ``offset``."""
        self.extents.claim(session, s, e.key, offset, e.nbytes, planned=False)
        s.spilled.discard((e.step, e.key))
        e.offset = offset
        e.io = self.file.read(e.file_offset, self.pool.view(offset, e.nbytes))
        e.where = Where.LOADING
        s.loading += 1
        self._in_flight.append((session, e))

    def prefetch(self, session: int, s: SessionEntries) -> None:
        """Read back the spilled tensors backward needs next (the latest saved) while the pool has
        room below SPILL_TARGET, so their GET finds them in the pool."""
        if self.file is None:
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
            self.read_back(session, s, e, offset)

    def drop_spilled(self, s: SessionEntries, e: Entry) -> None:
        """Spilled ``e`` is freed: its file space goes."""
        self._release_file(e)
        s.spilled.discard((e.step, e.key))
        s.counters.spilled_bytes -= e.nbytes

    def wait_for(self, session: int, e: Entry) -> None:
        """Wait for ``e``'s spill I/O, if any, and apply it."""
        if e.io is not None:
            self._in_flight.remove((session, e))
            self._finish(session, e)

    def reap(self, block: bool = False) -> None:
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

    def close(self) -> None:
        if self.file is not None:
            self.reap(block=True)
            self.file.close()

    def _release_file(self, e: Entry) -> None:
        self.file.release(e.file_offset)
        e.file_offset = None

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
            self.extents.release(s, e)
            e.where = Where.SPILLED
            s.spilled.add((e.step, e.key))
            s.counters.spilled_bytes += e.nbytes
            self.node.spilled_total += e.nbytes
            if self.failure is not None:
                log.warning("spill writes succeed again; background spill resumes",
                            extra={"spill_dir": self.file.directory, "failed_writes": self.node.spill_write_errors})
                self.failure = None
        else:  # read back: the file space is free, the entry is in the pool again
            self._release_file(e)
            e.where = Where.POOL
            s.loading -= 1
            s.counters.spilled_bytes -= e.nbytes
            self.node.read_back_total += e.nbytes
            self._reads_failing = False
            if not e.fetched:
                self.eviction.add(session, s.limits.priority, e)

    def _write_failed(self, session: int, s: SessionEntries, e: Entry, failure: BaseException) -> None:
        """The bytes are still in the pool extent: the entry stays there, and may be spilled again
        once the disk takes writes."""
        self._release_file(e)
        e.where = Where.POOL
        self.eviction.add(session, s.limits.priority, e)
        self.node.spill_write_errors += 1
        if self.failure is None:
            log.error("spill write failed: tensors stay in the pool and background spill rests until a write "
                      "succeeds", extra={"spill_dir": self.file.directory, "error": str(failure)})
        self.failure = f"writing to the spill file in {self.file.directory} failed: {failure}"

    def _read_failed(self, session: int, s: SessionEntries, e: Entry, failure: BaseException) -> None:
        """The pool extent holds no whole copy and the file's cannot be read: the key's bytes are lost.
        Both places are released now; the entry stays (its GET says why) until FREE."""
        self.extents.release(s, e)
        self._release_file(e)
        e.where = Where.LOST
        e.lost = f"reading it back from the spill file in {self.file.directory} failed: {failure}"
        s.loading -= 1
        s.counters.spilled_bytes -= e.nbytes
        self.node.spill_read_errors += 1
        if not self._reads_failing:  # the rest are counted (spill_read_errors) and their GETs logged as errors
            self._reads_failing = True
            log.error("spill read-back failed: that tensor's bytes are lost", extra={
                "session": session, "key": e.key, "spill_dir": self.file.directory, "error": str(failure)})
