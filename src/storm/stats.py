"""What a storm.offload step did: its counters (``.stats``), in total and per named layer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    saved: int = 0                 # pack calls, past a step's budget only the first (the rest cost no count)
    offloaded: int = 0             # storages sent to the store
    offloaded_bytes: int = 0
    stored_bytes: int = 0          # what the store holds for them (after compression)
    deduplicated: int = 0          # saves of a storage already stored in this step
    kept: dict[str, int] = field(default_factory=dict)  # reason -> count (see policy.Keep)
    kept_bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    prefetch_hits: int = 0
    fetch_wait_s: float = 0.0      # time unpack waited for bytes that were not there yet
    frame_overflows: int = 0       # CUDA tensors whose frame had too many escapes: stored again, raw
    copies_dropped: int = 0        # offloaded saves backward took from their tensor before the mover began their copy
    dropped_bytes: int = 0         # their bytes, in offloaded_bytes but never copied to host or back


@dataclass
class OffloadStats(Counters):
    """What one ``storm.offload`` step did, in total and, when its layers are named
    (``modules=``), per layer: the innermost module running when the tensor was
    saved. Fetch counters grow during its backward."""

    layers: dict[str, Counters] = field(default_factory=dict)
    # training-thread time spent offloading saves, waits on the mover and the pool's page-locking excluded
    pack_s: float = 0.0
    lock_s: float = 0.0  # the packs' time page-locking the pool (its first CUDA copy, its growths): once per byte
    packs: int = 0       # the offloading packs that pack_s times (a refusal later takes none back)
    framed: int = 0      # of them, those of saves sent in frames
    frame_pack_s: float = 0.0  # of pack_s, their time

    def _counters(self, layer: str | None) -> tuple[Counters, ...]:
        if layer is None:
            return (self,)
        c = self.layers.get(layer)
        if c is None:
            c = self.layers[layer] = Counters()
        return self, c

    def record(self, layer: str | None, keep: str | None = None, **deltas: float) -> None:
        for c in self._counters(layer):
            for name, d in deltas.items():
                setattr(c, name, getattr(c, name) + d)
            if keep is not None:
                c.kept[keep] = c.kept.get(keep, 0) + 1

    def add_pack(self, seconds: float, framed: bool, locking: float = 0.0) -> None:
        """An offloaded save's pack took ``seconds`` on the training thread, ``locking`` of them
        page-locking the pool (counted apart: a cost of the pool's size, which a step of the same
        saves does not pay again, and which made a cold process's trace read the host's time per
        save many times too high); ``framed``: it went in a frame."""
        seconds -= locking
        self.lock_s += locking
        self.pack_s += seconds
        self.packs += 1
        if framed:
            self.framed += 1
            self.frame_pack_s += seconds

    def record_kept(self, layer: str | None, reason: str, nbytes: int) -> None:
        """A save that stays where it is: the most common call, so spelled out."""
        for c in self._counters(layer):
            c.saved += 1
            c.kept_bytes += nbytes
            c.kept[reason] = c.kept.get(reason, 0) + 1

