"""Step placement: place each step's saved tensors at offsets learnt from an earlier step.

Training repeats itself: every step saves the same sizes in the same order
during forward and frees them in (roughly) reverse order during backward. A
session's first complete step is recorded as a trace of lifetimes (a logical
clock ticks at every PUT and every freed key); once all of its tensors are
freed, ``pack_lifetimes`` assigns offsets so that tensors alive at the same
time never overlap while the whole step fits in as few bytes as possible
(interval packing, greedy by size: the largest tensor first, each into the
tightest gap left by the tensors whose lifetimes overlap its own). Later steps
then take one region of that size from the general allocator and place the
tensor saved n-th at the n-th planned offset, as long as its size fits; any
other tensor (a bigger one, one past the planned count, one whose slot is
still occupied by the previous step, or one whose slot lies past the end of a
smaller region that a tensor of an earlier plan still holds) takes the first
free gap of the region that fits it, else falls back to the general
allocator: a step that saves less than the recorded one, or other sizes (a
plan's recomputed blocks' inputs), would otherwise leave most of the region
unused while a tight pool refuses its misses.

A planned step never fragments the general pool, and the report says how
close the plan is to the ideal: "using X of Y", X the planned footprint, Y
the peak of live bytes in the recorded step.
"""

from __future__ import annotations

from dataclasses import dataclass

from sortedcontainers import SortedDict

from .allocator import Allocator

# Planning is O(n^2) in the tensors of a step and runs on the daemon's loop; tensors past
# this many in one step are not planned (they use the general allocator) so it stays well
# under a second even in the worst case.
MAX_PLANNED_TENSORS = 1024


@dataclass(frozen=True)
class Lifetime:
    size: int   # bytes, already aligned
    start: int  # clock at PUT
    end: int    # clock at FREE (exclusive)


def peak_live_bytes(lifetimes: list[Lifetime]) -> int:
    """The most bytes alive at any one time: no placement can use less."""
    events = sorted([(t.end, -t.size) for t in lifetimes] + [(t.start, t.size) for t in lifetimes])
    live = peak = 0
    for _, delta in events:  # at equal times frees (negative) sort first: [start, end) intervals
        live += delta
        peak = max(peak, live)
    return peak


def pack_lifetimes(lifetimes: list[Lifetime]) -> tuple[list[int], int]:
    """Offsets for ``lifetimes`` (same order) such that overlapping lifetimes never share bytes,
    and the footprint (highest end) they need. Greedy by size, best-fitting gap."""
    order = sorted(range(len(lifetimes)), key=lambda i: (-lifetimes[i].size, lifetimes[i].start))
    offsets = [0] * len(lifetimes)
    placed: list[int] = []
    footprint = 0
    for i in order:
        t = lifetimes[i]
        busy = sorted((offsets[j], offsets[j] + lifetimes[j].size) for j in placed
                      if lifetimes[j].start < t.end and t.start < lifetimes[j].end)
        best, best_gap, pos = None, None, 0
        for lo, hi in busy:
            gap = lo - pos
            if gap >= t.size and (best_gap is None or gap < best_gap):
                best, best_gap = pos, gap
            pos = max(pos, hi)
        offsets[i] = pos if best is None else best
        placed.append(i)
        footprint = max(footprint, offsets[i] + t.size)
    return offsets, footprint


def first_fit_footprint(lifetimes: list[Lifetime]) -> int:
    """What an unplanned first-fit allocator needs for the same trace (the baseline reported
    beside a plan): each PUT takes the lowest free gap among the tensors alive at that time."""
    events = sorted([(t.end, 0, i) for i, t in enumerate(lifetimes)]
                    + [(t.start, 1, i) for i, t in enumerate(lifetimes)])
    live: SortedDict = SortedDict()  # offset -> end
    where: dict[int, int] = {}
    footprint = 0
    for _, is_start, i in events:
        if not is_start:
            del live[where.pop(i)]
            continue
        size, pos = lifetimes[i].size, 0
        for lo, hi in live.items():
            if lo - pos >= size:
                break
            pos = hi
        live[pos] = pos + size
        where[i] = pos
        footprint = max(footprint, pos + size)
    return footprint


@dataclass
class PlanStats:
    plan_hits: int = 0            # tensors placed at their planned offset
    plan_misses: int = 0          # tensors of planned steps that went to the general allocator
    planned_footprint: int = 0    # X of "using X of Y"
    plan_peak_live: int = 0       # Y: peak live bytes of the recorded step
    plan_first_fit: int = 0       # what first-fit needed for the recorded step, for comparison


class StepPlacement:
    """One session's placement. The store calls ``place`` on PUT and ``release`` on FREE."""

    def __init__(self, allocator: Allocator):
        self.allocator = allocator
        self.stats = PlanStats()
        self._clock = 0
        self._recording: int | None = None          # the step whose trace is being recorded
        self._trace: dict[int, list[int]] = {}      # slot -> [size, start, end or -1]
        # Recorded slots not yet freed. A set, not a count: a client may come back to the recorded
        # step after another one (its slots count from 0 again) and free keys of either visit, and
        # a lifetime must end once, after it began, for the plan to be made from ended ones only.
        self._open: set[int] = set()
        self._plan: dict[int, tuple[int, int]] | None = None  # slot -> (size, offset in region)
        self._region: int | None = None             # offset of the reserved region in the pool
        self._live: SortedDict = SortedDict()       # region offset -> end, of placed tensors alive
        self.inside_bytes = 0                       # what the tensors alive in the region take of it
        self._step: int | None = None               # the step PUTs arrive for now
        self._slots = 0                             # PUTs seen in that step
        self._step_hits = self._step_misses = 0

    def slot(self, step: int) -> int:
        """The order of this PUT within its step (the plan's index)."""
        if step != self._step:
            self._begin_step(step)
        self._slots += 1
        return self._slots - 1

    def _begin_step(self, step: int) -> None:
        if self._recording is not None and not self._open:
            self._make_plan()  # the usual case: backward freed the recorded step before this one began
        if self._plan is not None and self._step_misses > self._step_hits:
            self._drop_plan()  # the last step no longer looks like the recorded one: learn again
        self._step, self._slots = step, 0
        self._step_hits = self._step_misses = 0
        if self._plan is None and self._recording is None:
            self._recording, self._trace, self._open = step, {}, set()

    @property
    def region_bytes(self) -> int:
        """What the region takes of the pool while a tensor holds it (0 when none does)."""
        return self.allocator.size_of(self._region) if self._region is not None else 0

    def place(self, step: int, slot: int, size: int, room: int | None = None) -> int | None:
        """The pool offset planned for this tensor, or None to use the general allocator. ``room``:
        the most a region taken now may be (what the session's quota leaves), None for any."""
        self._clock += 1
        if step == self._recording and slot < MAX_PLANNED_TENSORS:
            self._trace[slot] = [size, self._clock, -1]
            self._open.add(slot)
        if self._plan is None:
            return None
        if self._region is None:
            # Taken when a planned step places its first tensor and given back when its last one
            # goes (so the region exists exactly while it holds a tensor and an idle session holds
            # no pool memory). None: no room for the whole region now, in the pool or the quota.
            fits = room is None or self.allocator.aligned(self.stats.planned_footprint) <= room
            self._region = self.allocator.alloc(self.stats.planned_footprint) if fits else None
            if self._region is None:
                self._miss()
                return None
        start = self._planned_start(slot, size)
        if start is None:
            self._miss()
            start = self._first_gap(size)
            if start is None:
                if not self._live:  # taken for this tensor, which does not fit it: no tensor holds it
                    self.allocator.free(self._region)
                    self._region = None
                return None
        else:
            self.stats.plan_hits += 1
            self._step_hits += 1
        self._live[start] = start + size
        self.inside_bytes += size
        return start

    def _planned_start(self, slot: int, size: int) -> int | None:
        """The slot's planned offset in the region, where the tensor fits there and it is free."""
        if slot not in self._plan or size > self._plan[slot][0]:
            return None
        if self._plan[slot][1] + size > self.allocator.size_of(self._region):
            # The region was taken for an earlier plan and a tensor of that time still holds it
            # (a plan is remade or dropped while one lives on), so it may be smaller than this
            # plan's footprint: bytes past its end belong to someone else.
            return None
        start = self._region + self._plan[slot][1]
        end = start + size
        i = self._live.bisect_left(start)
        if ((i > 0 and self._live.peekitem(i - 1)[1] > start)
                or (i < len(self._live) and self._live.peekitem(i)[0] < end)):
            return None  # the previous step still holds bytes there
        return start

    def _first_gap(self, size: int) -> int | None:
        """The lowest offset in the region where ``size`` bytes are free, or None."""
        pos, end = self._region, self._region + self.allocator.size_of(self._region)
        for lo, hi in self._live.items():
            if lo - pos >= size:
                return pos
            pos = max(pos, hi)
        return pos if end - pos >= size else None

    def _miss(self) -> None:
        self.stats.plan_misses += 1
        self._step_misses += 1

    def release(self, offset: int) -> None:
        """A planned tensor left its offset (freed or spilled)."""
        self.inside_bytes -= self._live.pop(offset) - offset
        if not self._live and self._region is not None:
            self.allocator.free(self._region)
            self._region = None

    def cancel(self, step: int, slot: int) -> None:
        """The PUT of this slot was refused: it has no lifetime to learn from."""
        if step == self._recording and self._trace.pop(slot, None) is not None:
            self._open.discard(slot)

    def forget(self, step: int, slot: int) -> None:
        """The key is freed: its lifetime in the recorded step ends now."""
        self._clock += 1
        if step != self._recording or slot not in self._open:
            return
        self._trace[slot][2] = self._clock
        self._open.discard(slot)
        if not self._open and self._step != self._recording:
            self._make_plan()  # the recorded step is over and all of it freed

    def _make_plan(self) -> None:
        slots = sorted(self._trace)  # refused PUTs and slots past the cap are not in it
        lifetimes = [Lifetime(*self._trace[s]) for s in slots]
        self._recording, self._trace = None, {}
        if not lifetimes:
            return
        offsets, footprint = pack_lifetimes(lifetimes)
        self._plan = {slot: (t.size, o) for slot, t, o in zip(slots, lifetimes, offsets)}
        self.stats.planned_footprint = footprint
        self.stats.plan_peak_live = peak_live_bytes(lifetimes)
        self.stats.plan_first_fit = first_fit_footprint(lifetimes)

    def _drop_plan(self) -> None:
        self._plan = None  # the region goes when its last tensor does (release)

    def describe(self) -> str:
        s = self.stats
        if not s.planned_footprint:
            return "no plan yet"
        return f"using {s.planned_footprint} of {s.plan_peak_live} bytes (first fit: {s.plan_first_fit})"
