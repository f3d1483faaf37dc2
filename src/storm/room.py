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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

Reader = Callable[[torch.device], "int | None"]  # bytes the allocator holds on a device now; None: unknown


@dataclasses.dataclass
class Profile:
    """What one step read: per offloaded save, its bytes and what was held besides the copy
    queue as it was saved (the save counted); per unpack of an offloaded save (in backward's
    order), what was held besides the queue and the window (the unpacked storage counted), and
    the bytes it brought back (the storage's, or none where an earlier unpack brought it), on
    ``device``. ``marks``: each reading's mark in the allocator's record
    (allocator_record.py), saves' then unpacks', where one is kept; ``rises``: how far the step's
    own memory rose above each reading before the next, read from that record once the step
    has ended (empty: not known, none is counted)."""

    sizes: list[int] = dataclasses.field(default_factory=list)
    saves: list[int] = dataclasses.field(default_factory=list)
    unpack_sizes: list[int] = dataclasses.field(default_factory=list)
    unpacks: list[int] = dataclasses.field(default_factory=list)
    device: torch.device | None = None  # where the readings were made
    marks: list[int] = dataclasses.field(default_factory=list)
    rises: list[int] = dataclasses.field(default_factory=list)


class Room:
    """The limits a profile gives the steps after it. Each reading bounds what is held from it
    to the next reading, with the rise the allocator's record saw in between: after a save,
    what was held less that save (it waits in the queue now); after an unpack, what was held,
    the unpacked storage with it."""

    def __init__(self, profile: Profile):
        self.profile = profile  # what it was made from (bench/full_offload.py shows it)
        n = len(profile.saves)
        rises = profile.rises if len(profile.rises) == n + len(profile.unpacks) else [0] * (n + len(profile.unpacks))
        # held besides the queue from each save until the next reading
        after = [held - size + rise for held, size, rise in zip(profile.saves, profile.sizes, rises)]
        # held while the queue waits for each save: at it, and since the save before
        self._saves = [max(held, before) for held, before in zip(profile.saves, [0, *after])]
        self._first_unpack = profile.unpacks[0] if profile.unpacks else None
        # held from forward's last save until backward's first unpack, then from each unpack to the next
        self._between = after[-1:] + [held + rise for held, rise in zip(profile.unpacks, rises[n:])]
        self.floor = max(self._saves + self._between, default=0)
        self._unpack_sizes = profile.unpack_sizes

    def matches(self, made: int, nbytes: int) -> bool:
        """Whether a step's ``made``-th offloaded save (1 = its first), of ``nbytes``, is the profile's."""
        sizes = self.profile.sizes
        return made <= len(sizes) and sizes[made - 1] == nbytes

    def complete(self, made: int) -> bool:
        """Whether a forward that made ``made`` offloaded saves made all of the profile's."""
        return made == len(self.profile.sizes)

    def queue(self, made: int) -> int:
        """Bytes that may wait for their copy once ``made`` saves are made: what fits under the
        floor beside what the step holds until the next save, or, after the last, until backward's
        first unpack, and at it; that unpack's reading counts the save it unpacks, the last one
        made (backward takes them in reverse): whether that one waits or is fetched back, it is
        there, so it may wait on top (a language model's log-softmax, which would otherwise go
        out and straight back)."""
        if made < len(self._saves):
            return max(0, self.floor - self._saves[made])
        if not self._between:
            return 0
        room = self.floor - self._between[0]
        if self._first_unpack is not None:
            room = min(room, self.floor - self._first_unpack + self.profile.sizes[-1])
        return max(0, room)

    def describe(self, queue_limit: int, window_limit: int) -> str:
        """What the room lets a step hold, within the step's ``max_held_bytes`` and ``prefetch_bytes``
        (``queue_limit``, ``window_limit``), for report(): the floor, the most the copy queue may
        hold in forward and as forward ends, and the window at backward's first unpack."""
        mib = 1 << 20
        forward = max((self.queue(made) for made in range(1, len(self._saves))), default=0)
        return (f"copy queue and prefetch window: within the room a profiled step found (its own memory reached "
                f"{self.floor / mib:.1f} MiB with the copy queue and window left out): the queue holds at most "
                f"{min(queue_limit, forward) / mib:.1f} MiB during forward and "
                f"{min(queue_limit, self.queue(len(self._saves))) / mib:.1f} MiB as it ends, the window "
                f"{self.window(0, window_limit) / mib:.1f} MiB at backward's first unpack (max_held_bytes "
                f"{queue_limit / mib:.0f} MiB, prefetch_bytes {window_limit / mib:.0f} MiB)")

    def window(self, unpacked: int, limit: int) -> int:
        """Bytes backward may fetch ahead once ``unpacked`` offloaded saves are unpacked, at most
        ``limit``: a fetched save is held from now until its own unpack, where it counts as held,
        so as many as fit under the floor beside what the step holds until then."""
        if unpacked >= len(self._unpack_sizes):  # past the profile's last unpack nothing more is held
            return limit
        window, covered, held = 0, 0, 0
        for before, size in zip(self._between[unpacked:], self._unpack_sizes[unpacked:]):
            held = max(held, before)
            cap = min(limit, self.floor - held)
            if cap <= window:
                break
            covered += size
            window = min(cap, covered)
            if covered >= cap:
                break
        return window
