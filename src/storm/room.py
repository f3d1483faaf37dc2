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
save, and less the window at each unpack of an offloaded save. Its highest reading is the
floor no queue or window can go under. The steps after it, while their saves come in the
same sizes, let the queue hold only what fits under that floor before the next save, drain
it to what fits under backward's first reading as forward ends, and let the window fetch
only what fits under the floor until those fetched bytes are unpacked. Where the step's own
memory is low the user's limits hold as before.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

Reader = Callable[[torch.device], "int | None"]  # bytes the allocator holds on a device now; None: unknown


@dataclasses.dataclass
class Profile:
    """What one step read: per offloaded save, its bytes and what was held besides the copy
    queue as it was saved; per unpack of an offloaded save (in backward's order), what was held
    besides the queue and the window, and the unpacked storage's bytes."""

    sizes: list[int] = dataclasses.field(default_factory=list)
    saves: list[int] = dataclasses.field(default_factory=list)
    unpack_sizes: list[int] = dataclasses.field(default_factory=list)
    unpacks: list[int] = dataclasses.field(default_factory=list)


class Room:
    """The limits a profile gives the steps after it."""

    def __init__(self, profile: Profile):
        self.sizes = profile.sizes
        self.floor = max(profile.saves + profile.unpacks, default=0)
        self._saves = profile.saves
        self._unpacks = profile.unpacks
        self._unpack_sizes = profile.unpack_sizes

    def matches(self, made: int, nbytes: int) -> bool:
        """Whether a step's ``made``-th offloaded save (1 = its first), of ``nbytes``, is the profile's."""
        return made <= len(self.sizes) and self.sizes[made - 1] == nbytes

    def queue(self, made: int) -> int:
        """Bytes that may wait for their copy once ``made`` saves are made: what fits under the
        floor beside what the step holds at the next save, or, after the last, at backward's
        first unpack; that unpack's reading counts the save it unpacks, the last one made (backward
        takes them in reverse): whether that one waits or is fetched back, it is there, so it may
        wait on top (a language model's log-softmax, which would otherwise go out and straight back)."""
        if made < len(self._saves):
            return max(0, self.floor - self._saves[made])
        if not self._unpacks:
            return 0
        return max(0, self.floor - self._unpacks[0]) + self.sizes[-1]

    def window(self, unpacked: int, limit: int) -> int:
        """Bytes backward may fetch ahead once ``unpacked`` offloaded saves are unpacked, at most
        ``limit``: fetched bytes stay until their own unpack, so as many as fit under the floor
        beside what the step holds at each unpack until those bytes are unpacked."""
        if unpacked >= len(self._unpacks):  # past the profile's last unpack nothing more is held
            return limit
        window, covered, held = 0, 0, 0
        for rest, size in zip(self._unpacks[unpacked:], self._unpack_sizes[unpacked:]):
            held = max(held, rest)
            cap = min(limit, self.floor - held)
            if cap <= window:
                break
            covered += size
            window = min(cap, covered)
            if covered >= cap:
                break
        return window
