"""Room: how many bytes a full-offload step's copy queue and prefetch window may take at each
moment without raising its peak, learned from a step of the same saves.

A step that offloads every save holds, besides what it would hold anyway (the ops' outputs
and temporaries, gradients, what stays), the saves waiting for their copy to the host (the
copy queue, ``max_held_bytes``) and, in backward, the saves fetched ahead of their unpack
(the prefetch window, ``prefetch_bytes``). Both buy speed: the link never waits for the
training thread. But the step's own memory is far from flat: a language model's head and
loss hold its logits several times over, at forward's end and backward's start, and a full
queue or window there puts its bytes on the step's peak.

So one step (the profile) reads what the allocator holds less the queue at each offloaded
save, and less the window at each unpack of an offloaded save, and the allocator's own record
of that step (allocator_record.py) says how far the step's memory rose between two readings:
an op's outputs and temporaries, such as a loss's gradients right after backward's first
unpack, come and go between them. The highest the step held is the floor no queue or window
can go under. The steps after it, while their saves come in the same sizes, let the queue hold
only what fits under that floor until the next save, drain it as forward ends to what fits
until backward's first unpack, and let the window fetch only what fits under the floor until
those fetched bytes are unpacked. Where the step's own memory is low the user's limits hold
as before.

A storage several ops saved comes back at its first unpack and is held until its last (restore.py):
T5's decoder layers each save the position bias the first of them made, so it sits under the
whole of the decoder's backward, the step's highest moment with it. Where it is under the highest
reading, the steps after the profile fetch it again at each of its unpacks instead (``refetched``):
more bytes over the link, less held at the peak.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch

# the least share of the floor a save fetched again at each unpack must take off it (Room._refetches):
# the tolerance a full offload's peak is judged by against torch's own
REFETCH_GAIN = 0.01
Reader = Callable[[torch.device], "int | None"]  # bytes the allocator holds on a device now; None: unknown


@dataclasses.dataclass
class Profile:
    """What one step read: per offloaded save, its bytes and what was held besides the copy queue as
    it was saved (the save counted); per unpack of an offloaded save (in backward's order), what was
    held besides the queue and the window (the unpacked storage counted), the bytes it brought back
    (the storage's, or none where an earlier unpack brought it) and which save it unpacked (its
    place in ``sizes``), on ``device``. ``marks``: each reading's mark in the allocator's record
    (allocator_record.py), saves' then unpacks', where one is kept, and ``left_out``: per reading,
    the addresses of the saves it did not count (those in the queue); ``fetched``: per reading, the
    address of the storage an unpack's reading counted, once it is known (brought back then, or
    before), and ``landing``: per save (by key) an unpack's reading counted whose storage is not on
    the device yet, where its address goes; ``addresses``: per save, its storage's. Read from that
    record once the step has ended (allocator_record.Replay; empty: not known): ``rises``, how far
    the step's own memory rose above each reading before the next; ``frees``, the saves freed after
    a reading counted them, each with how far it rose after that free; ``counted``, per save, the
    readings that counted it (its copy done, the step still holding it)."""

    sizes: list[int] = dataclasses.field(default_factory=list)
    saves: list[int] = dataclasses.field(default_factory=list)
    unpack_sizes: list[int] = dataclasses.field(default_factory=list)
    unpacks: list[int] = dataclasses.field(default_factory=list)
    unpack_saves: list[int] = dataclasses.field(default_factory=list)
    device: torch.device | None = None  # where the readings were made
    marks: list[int] = dataclasses.field(default_factory=list)
    left_out: list[list[int]] = dataclasses.field(default_factory=list)
    fetched: list[list[int]] = dataclasses.field(default_factory=list)
    landing: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    addresses: list[int] = dataclasses.field(default_factory=list)
    rises: list[int] = dataclasses.field(default_factory=list)
    frees: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    counted: list[range] = dataclasses.field(default_factory=list)


class Room:
    """The limits a profile gives the steps after it. Each reading bounds what is held from it
    to the next reading, with the rise the allocator's record saw in between: after a save,
    what was held less that save (it waits in the queue now); after an unpack, what was held,
    the unpacked storage with it.

    Forward's last saves are backward's first unpacks: a language model's log-softmax goes out
    at forward's end and comes straight back, with nothing to compute under either copy. The
    room keeps on the device as many of the last saves (``kept``) as fit under the floor at
    every reading from their save to their first unpack, their bytes added to each; the steps
    after the profile keep them instead of copying them (``keeps``), and the queue and the window
    fit beside them. An earlier save that backward unpacks between theirs (T5's labels share the
    storage of its input ids, saved first) is fetched at its place: the steps after the profile
    count their unpacks of offloaded saves, and ``window`` reads that count at its place among
    the profile's unpacks. ``keep=False``: none is kept (a compiled graph's saves, whose memory the
    graph reuses once it lets go of them)."""

    def __init__(self, profile: Profile, keep: bool = True):
        self.profile = profile  # what it was made from (bench/full_offload.py shows it)
        n, readings = len(profile.saves), len(profile.saves) + len(profile.unpacks)
        measured = len(profile.rises) == readings  # else none is counted
        self._rises = profile.rises if measured else [0] * readings
        self._frees = profile.frees if measured and len(profile.frees) == readings else [[] for _ in range(readings)]
        self._counted = profile.counted if len(profile.counted) == n else [range(0)] * n
        self._first_unpack: dict[int, int] = {}  # per save backward unpacks, its first unpack
        self._last_unpack: dict[int, int] = {}  # and its last
        for u, save in enumerate(profile.unpack_saves):
            self._first_unpack.setdefault(save, u)
            self._last_unpack[save] = u
        self.refetched = self._refetches()
        self._saves, self._between = self._readings(0, self.refetched)
        self.floor = max(self._saves + self._between, default=0)
        self.kept = self._tail() if keep else 0
        if self.kept:
            self._saves, self._between = self._readings(self.kept, self.refetched)
        # the profile's place of each unpack of a save not kept, in backward's order: the steps after
        # it count only those (a kept save's unpacks fetch nothing, wherever they come)
        of_kept = {u for u, save in enumerate(profile.unpack_saves) if save >= n - self.kept} if self.kept else set()
        self._places = [u for u in range(len(profile.unpacks)) if u not in of_kept]
        self._unpack_sizes = [0 if u in of_kept else size for u, size in enumerate(profile.unpack_sizes)]

    def _tails(self) -> int:
        """How many of the last saves could be kept: those that backward unpacks (keeping a save
        never unpacked buys nothing), counted back from forward's last save to the first that is not."""
        n, order = len(self.profile.sizes), self.profile.unpack_saves
        if len(order) != len(self.profile.unpacks) or any(not 0 <= save < n for save in order):
            return 0
        tails = 0
        while tails < n and n - 1 - tails in self._first_unpack:
            tails += 1
        return tails

    def _readings(self, kept: int, refetched: frozenset[int]) -> tuple[list[int], list[int]]:
        """What is held at each save while the queue waits (at it and since the save before), and
        from forward's last save until backward's first unpack, then from each unpack to the next,
        with the last ``kept`` saves on the device from their save to their first unpack (whose
        reading counts the storage it unpacks). A reading that counted a kept save already (its
        copy done, the step still holding it) does not count it twice."""
        p, n = self.profile, len(self.profile.saves)
        sizes = p.sizes
        extra = [0] * (n + len(p.unpacks) + 1)  # per reading, saves' then unpacks': kept bytes it did not count
        for i in range(n - kept, n):
            until = n + self._first_unpack[i]
            counted = range(max(self._counted[i].start, i + 1), min(self._counted[i].stop, until))
            for start, stop, size in ((i, until, sizes[i]), (counted.start, counted.stop, -sizes[i])):
                if start < stop:
                    extra[start] += size
                    extra[stop] -= size
        held = list(itertools.accumulate(extra[:-1]))
        rises = self._kept_rises(kept)
        after = [at - size + h + rise for at, size, h, rise in zip(p.saves, sizes, held, rises)]
        before = [0, *after]
        saves = [max(at + held[j] - (sizes[j] if j >= n - kept else 0), before[j]) for j, at in enumerate(p.saves)]
        between = after[-1:] + [at + h + rise for at, h, rise in zip(p.unpacks, held[n:], rises[n:])]
        for save in refetched:
            if save < n - kept:  # a kept one is never fetched
                for u in range(self._first_unpack[save] + 1, self._last_unpack[save]):
                    if p.unpack_saves[u] != save:
                        between[1 + u] -= sizes[save]
        return saves, between

    def _refetches(self) -> frozenset[int]:
        """The saves backward unpacks more than once (a storage several ops saved: T5's decoder
        layers each save the position bias the first of them made) whose bytes, fetched at their first
        unpack, are better fetched again at each: held from the first to the last they sit under every
        reading in between, and where the step's highest reading is one of those, they are its floor's.
        Picked one at a time, the largest under the highest reading, while each lowers the floor by
        REFETCH_GAIN of it at least: a model's rotary tables, saved by every layer, are under every
        reading of backward, and fetched again they would make each layer wait for a few bytes."""
        p, n = self.profile, len(self.profile.saves)
        if len(p.unpack_saves) != len(p.unpacks) or len(p.unpack_sizes) != len(p.unpacks):
            return frozenset()
        first, last = self._first_unpack, self._last_unpack
        held = {save for save in first if last[save] > first[save] + 1 and p.unpack_sizes[first[save]] > 0
                and 0 <= save < n}  # brought back at its first
        chosen: frozenset[int] = frozenset()
        saves, between = self._readings(0, chosen)
        readings = saves + between
        while True:
            top = readings.index(max(readings, default=0)) - n - 1 if readings else -1  # its unpack, if one
            under = [save for save in held - chosen if first[save] < top < last[save] and p.unpack_saves[top] != save]
            if not under:
                return chosen
            more = chosen | {max(under, key=lambda save: (p.sizes[save], save))}
            saves, between = self._readings(0, more)
            if max(readings) - max(saves + between) < max(readings) * REFETCH_GAIN:
                return chosen
            chosen, readings = more, saves + between

    def _kept_rises(self, kept: int) -> list[int]:
        """How far the step's memory rises after each reading with the last ``kept`` saves kept:
        where the profiled step freed one of them while its reading counted it (its copy done),
        a kept one is never freed before its unpack, so its bytes stay on top of what came after."""
        n, sizes = len(self.profile.saves), self.profile.sizes
        rises = list(self._rises)
        for k, frees in enumerate(self._frees):
            on_top = 0
            for save, high in frees:
                if save >= n - kept and k < n + self._first_unpack[save]:
                    on_top += sizes[save]
                if on_top:
                    rises[k] = max(rises[k], high + on_top)
        return rises

    def _tail(self) -> int:
        """The most of the last saves that fit under the floor on the device until their first
        unpacks. Each more save kept adds its bytes to the same readings and to more, so the counts
        that fit are the fewest ones."""
        best, low, high = 0, 1, self._tails()
        while low <= high:
            middle = (low + high) // 2
            saves, between = self._readings(middle, self.refetched)
            if max(saves + between) <= self.floor:
                best, low = middle, middle + 1
            else:
                high = middle - 1
        return best

    def matches(self, made: int, nbytes: int) -> bool:
        """Whether a step's ``made``-th offloaded or kept save (1 = its first), of ``nbytes``, is the profile's."""
        sizes = self.profile.sizes
        return made <= len(sizes) and sizes[made - 1] == nbytes

    def refetches(self, index: int) -> bool:
        """Whether the save at ``index`` of a step's saving order is fetched again at each of its
        unpacks rather than held from its first to its last (``_refetches``)."""
        return index in self.refetched and index < len(self.profile.sizes) - self.kept

    def keeps(self, made: int, nbytes: int) -> bool:
        """Whether a step's ``made``-th save, of ``nbytes``, stays on the device: one of the last
        ``kept``, the profile's."""
        return made > len(self.profile.sizes) - self.kept and self.matches(made, nbytes)

    def complete(self, made: int) -> bool:
        """Whether a forward that made ``made`` offloaded or kept saves made all of the profile's."""
        return made == len(self.profile.sizes)

    def queue(self, made: int) -> int:
        """Bytes that may wait for their copy once ``made`` saves are made: what fits under the
        floor beside what the step holds until the next save, or, after the last, until backward's
        first unpack of an offloaded save, and at it; that unpack's reading counts the save it
        unpacks, the last one offloaded (backward takes them in reverse): whether that one waits
        or is fetched back, it is there, so it may wait on top."""
        if made < len(self._saves):
            return max(0, self.floor - self._saves[made])
        if not self._between:
            return 0
        unpacks, order = self.profile.unpacks, self.profile.unpack_saves
        first = self._places[0] if self._places else len(unpacks)
        room = self.floor - max(self._between[:1 + first])
        if first < len(unpacks):
            n, sizes = len(self.profile.sizes), self.profile.sizes
            last = order[first] if len(order) == len(unpacks) else n - 1
            kept = sum(sizes[i] for i in range(n - self.kept, n) if self._first_unpack[i] > first)
            room = min(room, self.floor - unpacks[first] - kept + sizes[last])
        return max(0, room)

    def fits(self, made: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more on the device fit under the floor at the ``made``-th save (1 = the
        first) beside what the step holds there, the save counted."""
        return nbytes <= self.floor - self._saves[made - 1]

    def describe(self, queue_limit: int, window_limit: int) -> str:
        """What the room lets a step hold, within the step's ``max_held_bytes`` and ``prefetch_bytes``
        (``queue_limit``, ``window_limit``), for report(): the floor, the saves it keeps, the most the
        copy queue may hold in forward and as forward ends, and the window at backward's first
        unpack of an offloaded save."""
        mib = 1 << 20
        forward = max((self.queue(made) for made in range(1, len(self._saves))), default=0)
        kept = sum(self.profile.sizes[len(self.profile.sizes) - self.kept:])
        return (f"copy queue and prefetch window: within the room a profiled step found (its own memory reached "
                f"{self.floor / mib:.1f} MiB with the copy queue and window left out): forward's last "
                f"{self.kept} saves ({kept / mib:.1f} MiB) stay on the device for backward, the queue holds at most "
                f"{min(queue_limit, forward) / mib:.1f} MiB during forward and "
                f"{min(queue_limit, self.queue(len(self._saves))) / mib:.1f} MiB as it ends, the window "
                f"{self.window(0, window_limit) / mib:.1f} MiB at backward's first unpack "
                f"(max_held_bytes {queue_limit / mib:.0f} MiB, prefetch_bytes {window_limit / mib:.0f} MiB)"
                + (f"; {len(self.refetched)} saves that backward unpacks more than once are fetched again at each "
                   f"unpack rather than held between them" if self.refetched else ""))

    def window(self, unpacked: int, limit: int) -> int:
        """Bytes backward may fetch ahead once ``unpacked`` offloaded saves are unpacked, at most
        ``limit``: a fetched save is held from now until its own unpack, where it counts as held,
        so as many as fit under the floor beside what the step holds until then."""
        if unpacked >= len(self._places):  # past the profile's last unpack nothing more is held
            return limit
        place = self._places[unpacked]
        window, covered, held = 0, 0, 0
        for before, size in zip(self._between[place:], self._unpack_sizes[place:]):
            held = max(held, before)
            cap = min(limit, self.floor - held)
            if cap <= window:
                break
            covered += size
            window = min(cap, covered)
            if covered >= cap:
                break
        return window
