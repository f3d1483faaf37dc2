"""The activation store: the lifecycle of each stored tensor, PUT -> SEAL -> GET -> FREE, by session.

Keys are chosen by the client and live in its session's namespace, so one
session can neither see nor free another's tensors. Clients copy into the
extent PUT reserved and SEAL it with a checksum; GET hands the extent back
only once sealed. Where the bytes sit is the store's business between SEAL and
GET: extents come from the session's step placement (placement.py) or the
general allocator (allocator.py, extents.py), which may grow first where the
pool grows (growth.py: the embedded store's), and when the pool is full the
spiller (spiller.py) moves sealed, not yet fetched extents, in the order the
eviction policy (eviction.py) gives, to the spill file and back. A GET reply
therefore carries the offset the bytes have now, which may differ from PUT's.
Budgets: a node-wide pool and bound on keys, and per client (by the name it
gives in HELLO) a quota on the bytes it holds, a bound on its keys (so that one
client cannot take the keys the others need) and a priority that orders what
is spilled first (store_options.py).

The allocator, the eviction policy, each session's placement, the pool's
growth and the spill disk (``StoreOptions.spill_io``) are parameters, so a
test can stand in its own for any of them.
"""

from __future__ import annotations

from typing import Any, Callable

from .allocator import Allocator
from .counters import NodeCounters
from .entries import Entry, SessionEntries, Where
from .eviction import EvictionPolicy, SpillOrder
from .extents import PoolExtents
from .growth import GrowthRefused, PoolGrowth
from .ledger import ExtentConflict, ExtentLedger
from .placement import StepPlacement
from .spill import SpillFile
from .spiller import Spiller
from .store_options import StoreOptions
from .wire.pool import SharedPool
from .wire.protocol import ErrorCode, ProtocolError


class Store:
    def __init__(self, allocator: Allocator, pool: SharedPool | None = None,
                 options: StoreOptions | None = None, *, eviction: EvictionPolicy | None = None,
                 placement: Callable[[Allocator], StepPlacement] = StepPlacement, growth: PoolGrowth | None = None):
        self.allocator = allocator
        self.pool = pool
        self.growth = growth  # the embedded store's: the pool grows when a PUT does not fit; None: fixed
        self.options = options or StoreOptions()
        self.eviction = eviction if eviction is not None else SpillOrder()  # an empty policy is falsy (len)
        self.node = NodeCounters()
        self._placement = placement
        self._sessions: dict[int, SessionEntries] = {}
        self._keys = 0  # held by all sessions: at most options.max_keys
        self.extents = PoolExtents(allocator, ExtentLedger(self._ceiling()) if self.options.check_extents else None)
        # the file's extents in the pool's unit (aligned(1)): a spilled tensor takes there what its quota counts
        spill = SpillFile(self.options.spill_dir, self.options.spill_limit, self.options.spill_io,
                          alignment=allocator.aligned(1)) if self.options.spill_dir and pool is not None else None
        self.spiller = Spiller(spill, pool, self.extents, self.eviction, self._sessions, self.node)

    def open_session(self, session: int, name: str = "") -> None:
        limits = self.options.clients.get(name, self.options.default_limits)
        self._sessions[session] = SessionEntries(self._placement(self.allocator), name, limits)

    def _of(self, session: int) -> SessionEntries:
        s = self._sessions.get(session)
        if s is None:
            self.open_session(session)
            s = self._sessions[session]
        return s

    def put(self, session: int, f: dict[str, Any], deliver: Callable[[Entry], None] | None = None) -> Entry:
        """Store the PUT ``f``'s tensor: its extent taken, and ``deliver``, where given, called with the
        entry (the daemon's own copy into it queued); what ``deliver`` raises leaves nothing stored and
        nothing counted."""
        self.spiller.reap()
        s = self._of(session)
        if f["key"] in s.entries:
            raise ProtocolError(ErrorCode.DUPLICATE_KEY, f"key {f['key']} is already stored in this session")
        held = len(s.entries)
        if s.limits.max_keys and held >= s.limits.max_keys:  # before max_keys: the keys left are the others'
            s.counters.quota_refused += 1
            raise ProtocolError(ErrorCode.QUOTA, f"{self._who(s)} holds {held} tensors, its limit (client_max_keys "
                                                 f"{s.limits.max_keys}); free some, or raise client_max_keys in "
                                                 f"stormd.toml")
        if self._keys >= self.options.max_keys:
            s.counters.pool_full += 1
            raise ProtocolError(ErrorCode.POOL_FULL, f"the store holds {self._keys} tensors, its max_keys; free some "
                                                     f"or raise max_keys")
        if f["nbytes"] > self._ceiling():
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"{f['nbytes']} bytes is more than the whole pool ({self._ceiling()} bytes)")
        c = s.counters
        quota = s.limits.quota
        # what the extent takes, not what the client asked for: counted by nbytes, 1-byte PUTs held
        # the alignment's worth of pool each past the quota
        charge = self.allocator.aligned(f["nbytes"])
        if quota and c.held_bytes + charge > quota:
            raise self._over_quota(s, f"holds {c.held_bytes} bytes", charge)
        # what the session takes of the pool (and the spill file) now: its tensors, but of those in its
        # step's planned region the whole region, which it holds while one of them lives
        taken = c.held_bytes - s.placement.inside_bytes + s.placement.region_bytes
        slot = s.placement.slot(f["step"])
        offset = s.placement.place(f["step"], slot, charge, room=quota - taken if quota else None)
        planned = offset is not None
        if not planned and quota and taken + charge > quota:
            s.placement.cancel(f["step"], slot)
            raise self._over_quota(s, f"takes {taken} bytes of the pool, {s.placement.region_bytes} of them its "
                                      f"step's planned region,", charge)
        try:
            if offset is None:
                offset = self._alloc(f["nbytes"], s)
            self.extents.claim(session, s, f["key"], offset, f["nbytes"], planned)
        except (ProtocolError, ExtentConflict):
            s.placement.cancel(f["step"], slot)  # not stored: no lifetime to learn from
            raise
        e = Entry(f["key"], f["step"], offset, f["nbytes"], f["dtype"], list(f["shape"]), list(f["strides"]),
                  f["storage_offset"], f["codec"], f.get("raw_nbytes", f["nbytes"]), slot=slot, planned=planned)
        s.entries[e.key] = e
        self._keys += 1
        c.held_bytes += charge
        if deliver is not None:
            try:
                deliver(e)
            except BaseException:
                self.free(session, keys=[e.key])
                raise
        c.puts += 1
        c.bytes_in += e.nbytes
        c.raw_bytes_in += e.raw_nbytes
        c.peak_held_bytes = max(c.peak_held_bytes, c.held_bytes)
        return e

    @staticmethod
    def _over_quota(s: SessionEntries, holds: str, charge: int) -> ProtocolError:
        """QUOTA for a PUT of ``charge`` more bytes by ``s``, which ``holds`` (what it has, in words)."""
        s.counters.quota_refused += 1
        who = Store._who(s)
        return ProtocolError(ErrorCode.QUOTA,
                             f"{who} {holds} and its quota is {s.limits.quota}; {charge} more do not fit: raise "
                             f"its quota (client_quota, or clients.{s.name or 'NAME'}.quota in stormd.toml) or "
                             f"offload less (storm.offload(budget=...))")

    @staticmethod
    def _who(s: SessionEntries) -> str:
        return f"client {s.name!r}" if s.name else "this client"

    def _alloc(self, nbytes: int, s: SessionEntries) -> int:
        """A general-allocator extent; when the pool is full, spill (waiting for the writes) until one fits."""
        offset = self.allocator.alloc(nbytes)
        while offset is None and self.spiller.spill_one(wait=True):
            offset = self.allocator.alloc(nbytes)
        refused = None
        while offset is None and self.growth is not None and refused is None:
            try:
                self.allocator.grow(self.growth.grow(self.allocator.aligned(nbytes)))
                offset = self.allocator.alloc(nbytes)
            except GrowthRefused as e:
                refused = str(e)
        if offset is None:
            s.counters.pool_full += 1
            st = self.allocator.stats()
            why = refused or self.spiller.why_full(nbytes) or self.options.spill_off
            raise ProtocolError(ErrorCode.POOL_FULL,
                                f"no free extent of {nbytes} bytes ({st.capacity - st.used} bytes free, "
                                f"largest extent {st.largest_free}); {why}")
        return offset

    def _ceiling(self) -> int:
        """The most bytes the pool may hold: its cap when it grows."""
        return self.growth.cap if self.growth is not None else self.allocator.capacity

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
        self.spiller.reap()
        s = self._of(session)
        e = self._entry(session, key)
        if not e.sealed:
            e.sealed, e.checksum = True, checksum
            if not e.fetched:
                self.eviction.add(session, s.limits.priority, e)
        self.spiller.spill_in_background()

    def get(self, session: int, key: int, deliver: Callable[[Entry], None] | None = None) -> Entry:
        """The entry, in the pool: a spilled one is read back first (the reply's offset may differ
        from PUT's). From now on it stays where it is until FREE. ``deliver``, where given, is called
        with it first (the daemon's own copy out of it queued): what it raises leaves the entry as it
        was, free to move, and nothing counted."""
        self.spiller.reap()
        s = self._of(session)
        e = self._entry(session, key)
        if not e.sealed:
            raise ProtocolError(ErrorCode.NOT_SEALED, f"key {key} was reserved by PUT but never sealed")
        self.spiller.wait_for(session, e)
        if e.where == Where.SPILLED:
            self.node.read_back_on_get += 1
            self.spiller.read_back(session, s, e, self._alloc(e.nbytes, s))
            self.spiller.wait_for(session, e)
        if e.where == Where.LOST:
            raise ProtocolError(ErrorCode.SPILL_FAILED,
                                f"key {key}: {e.lost}; its bytes are lost (this key's only: the session's other "
                                f"tensors are intact); FREE it")
        if deliver is not None:
            deliver(e)
        if not e.fetched:
            e.fetched = True
            self.eviction.discard(session, s.limits.priority, e)
        c = s.counters
        c.gets += 1
        c.bytes_out += e.nbytes
        self.spiller.prefetch(session, s)
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
        self.spiller.reap()
        s = self._sessions.get(session)
        if s is None:
            return 0
        doomed = self.keys(session, keys, step)
        for k in doomed:
            e = s.entries[k]
            self.spiller.wait_for(session, e)
            if e.where == Where.SPILLED:
                self.spiller.drop_spilled(s, e)
            elif e.where != Where.LOST:  # a lost entry's extent and file space went when its read failed
                self.extents.release(s, e)
            self.eviction.discard(session, s.limits.priority, e)
            s.placement.forget(e.step, e.slot)
            del s.entries[k]
            self._keys -= 1
            s.counters.held_bytes -= self.allocator.aligned(e.nbytes)
        self.spiller.prefetch(session, s)
        return len(doomed)

    # --- sessions and statistics ----------------------------------------------

    def drop_session(self, session: int) -> int:
        freed = self.free(session)
        s = self._sessions.pop(session, None)
        if s is not None:  # free() gave back the plan's region with its last tensor
            self.node.plan_hits += s.placement.stats.plan_hits
            self.node.plan_misses += s.placement.stats.plan_misses
        return freed

    def close(self) -> None:
        self.spiller.close()

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
        spill = self.spiller.file.space.stats() if self.spiller.file is not None else None
        return {"capacity": st.capacity, "used": st.used, "peak": st.peak,
                "fragmentation": round(st.fragmentation, 6), "free_extents": st.free_extents,
                "largest_free": st.largest_free,
                "keys": sum(len(s.entries) for s in live),
                "spill": self.spiller.file is not None,
                "spill_capacity": spill.capacity if spill else 0,
                "spilled_bytes": sum(s.counters.spilled_bytes for s in live),
                **vars(self.node),
                "plan_hits": self.node.plan_hits + sum(s.placement.stats.plan_hits for s in live),
                "plan_misses": self.node.plan_misses + sum(s.placement.stats.plan_misses for s in live)}
