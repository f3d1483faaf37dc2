"""The caching allocator's own record of a step, read for how high its memory rose between
STORM's readings.

Full offload's room (room.py) reads what the allocator holds at each offloaded save and at each
unpack. An op's outputs and temporaries come and go between two readings: a language model's
loss allocates logits-sized gradients right after backward's first unpacks, and no reading
sees them. So while one step profiles, the allocator records its history
(torch.cuda.memory._record_memory_history, without stack traces: each event is its address,
size and stream), each reading leaves a mark in that record (an allocation of a size of its
own, freed at once, whose address says which event it was), and the record, replayed, gives
per reading how far the step's own memory rose above it before the next.

The step's own memory is what its ops allocate on the streams the readings are made on (the
training thread's, and backward's): allocations on other streams are STORM's copies (fetched
buffers, frames) that the room paces itself, and are left out with their frees, except the
storage an unpack's reading counts as the step's (``fetched``: fetched ahead before the reading
or on demand after it): its free lowers what the step holds, or a storage freed once its op ran
would read as a rise as high as itself under the gradient that op allocates next. A reading
leaves out the saves waiting in the copy queue: when one
of them is freed (its copy done) before the next reading, its free is left out too, or the rise
would count its bytes off twice, and a loss's gradients allocated after a logits-sized save went
out would read as no rise at all. Where someone else records already, their record is read and
left running.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, Protocol, Sequence

import torch

# The record's ring, in events, each held in host memory while it runs: a profiled step with more
# events than this loses its first marks, and its room then goes by the readings alone
MAX_EVENTS = 1 << 18
# A mark's bytes: the allocator reuses a freed block for the next request of its size class, so a
# mark's address alone is shared with the step's own small tensors; an odd multiple of the
# allocator's 512-byte rounding that no tensor of the step is likely to have tells them apart
RECORD_MARK_BYTES = 37 * 512


class Record(Protocol):
    """Where a step's memory history comes from (a fake one in tests)."""

    def start(self, device: torch.device) -> None: ...

    def mark(self, device: torch.device) -> int | None: ...

    def finish(self, device: torch.device) -> list[dict[str, Any]] | None: ...


class AllocatorRecord:
    """torch's CUDA caching allocator's history: ``start`` records it (unless it is recorded
    already), ``mark`` leaves a mark and returns its address, ``finish`` returns the events of
    ``device`` and stops what ``start`` began. Elsewhere than CUDA nothing is recorded (None)."""

    def __init__(self) -> None:
        self._started = False

    def start(self, device: torch.device) -> None:
        if device.type != "cuda" or self._started or torch._C._cuda_isHistoryEnabled():
            return
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=MAX_EVENTS)
        self._started = True

    def mark(self, device: torch.device) -> int | None:
        if device.type != "cuda" or not torch._C._cuda_isHistoryEnabled():
            return None
        return torch.empty(RECORD_MARK_BYTES, dtype=torch.uint8, device=device).data_ptr()

    def finish(self, device: torch.device) -> list[dict[str, Any]] | None:
        if device.type != "cuda" or not torch._C._cuda_isHistoryEnabled():
            return None
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return torch.cuda.memory._snapshot()["device_traces"][index]
        finally:
            if self._started:
                torch.cuda.memory._record_memory_history(None)
                self._started = False


@dataclasses.dataclass
class Replay:
    """What the record says of a profiled step, per mark (each reading's): ``rises``, the most the
    step's own memory rose above the reading before the next mark (the last: before the record
    ends), 0 where it only fell; ``frees``, the saves whose blocks the reading counted and that
    were freed before the next mark, in order, each with the most the memory rose above the
    reading from that free until the next such free or the next mark (a kept save, never freed,
    would be on top there); ``counted``, per save, the marks whose readings counted its block
    (after its copy left the queue, while the step still held it: until the interval that freed
    it)."""

    rises: list[int]
    frees: list[list[tuple[int, int]]]
    counted: list[range]


def replay(events: list[dict[str, Any]], marks: list[int], left_out: Sequence[Collection[int]] | None = None,
           addresses: Sequence[int] = (), fetched: Sequence[Collection[int]] | None = None) -> Replay | None:
    """Replays the record between ``marks``. ``left_out``: per mark, the addresses of the blocks
    its reading did not count (the copy queue's saves), whose frees before the next mark are not
    counted either. ``addresses``: per save, its block's address; the first marks are the saves'
    readings, one each, in order. ``fetched``: per mark, the addresses of blocks on other streams
    that its reading counted (the storage an unpack brought back, there at the mark or allocated
    after it), whose frees from there on are counted. None where a mark is not in the record (its
    ring wrapped, or the record began after it). The marks are the last of their addresses in the record, in
    order: the allocator hands each mark the block the one before freed, so a record begun
    earlier (someone else's) holds older marks at the same addresses."""
    at: list[int] = []
    end = len(events)
    for address in reversed(marks):
        found = _mark_before(events, address, end)
        if found is None:
            return None
        at.append(found)
        end = found
    at.reverse()
    if not at:
        return Replay([], [], [range(0) for _ in addresses])
    own = {events[i]["stream"] for i in at}  # the streams the readings were made on
    others: set[int] = set()  # live allocations on other streams: STORM's copies
    counted: set[int] = set()  # those of them a reading counted as the step's
    coming: set[int] = set()  # addresses a reading counted whose blocks are not yet allocated (fetched on demand)
    live: set[int] = set()  # the step's own blocks allocated since the record began, not yet freed
    saved: dict[int, int] = {}  # address -> the save whose block it is, from its reading until its free
    first = [len(marks)] * len(addresses)  # per save, the first mark whose reading counted it
    freed = [len(marks)] * len(addresses)  # per save, the mark after the free of its block
    out: list[int] = []
    frees: list[list[tuple[int, int]]] = []
    for k, (mark, start, end) in enumerate(zip(marks, at, at[1:] + [len(events)])):
        if k < len(addresses) and addresses[k] in live:  # a block from before the record: never counted
            saved[addresses[k]] = k
        uncounted = set(left_out[k]) if left_out is not None else set()
        for address in fetched[k] if fetched is not None else ():
            if address in others:
                counted.add(address)
            elif address not in live:  # the step's own block (its free counts anyway), or one to come
                coming.add(address)
        for address, save in saved.items():
            if address not in uncounted and first[save] == len(marks):
                first[save] = k
        level = high = 0
        pending: int | None = mark
        split: list[tuple[int, int]] = []  # the frees of counted saves, with the high since each
        for e in events[start + 1:end]:
            action, address = e["action"], e["addr"]
            if action == "alloc":
                uncounted.discard(address)  # the reading's block at this address was freed before
                if e["stream"] in own:
                    level += e["size"]
                    live.add(address)
                    coming.discard(address)  # the storage came on the step's stream
                else:
                    others.add(address)
                    if address in coming:
                        coming.discard(address)
                        counted.add(address)
            elif action == "free_requested":
                live.discard(address)
                save = saved.pop(address, -1)
                if save >= 0:
                    freed[save] = k + 1
                if address == pending:  # the mark, freed at once: it never counted
                    pending = None
                elif address in uncounted:  # its block is free now: a later one at its address counts
                    uncounted.discard(address)
                    others.discard(address)  # a queued save made on another stream
                    counted.discard(address)  # a storage an unpack counted, in the queue again since
                elif address in others:
                    others.discard(address)
                    if address in counted:
                        counted.discard(address)
                        level -= e["size"]
                else:
                    level -= e["size"]
                    if save >= 0:
                        split.append((save, level))
            high = max(high, level)
            if split:
                split[-1] = (split[-1][0], max(split[-1][1], level))
        out.append(high)
        frees.append(split)
    return Replay(out, frees, [range(min(f, e), e) for f, e in zip(first, freed)])


def peak(events: list[dict[str, Any]], mark: int) -> int | None:
    """The most the allocator held above what it held at ``mark`` (a reading's), on every stream
    (STORM's copies count: they are on the device as much as the step's own tensors), from there
    until the record ends: a step's peak, read from its first save. None where the mark is not
    in the record; the last at its address (replay)."""
    at = _mark_before(events, mark, len(events))
    if at is None:
        return None
    level = high = 0
    pending: int | None = mark
    for e in events[at + 1:]:
        if e["action"] == "alloc":
            level += e["size"]
            high = max(high, level)
        elif e["action"] == "free_requested":
            if e["addr"] == pending:  # the mark, freed at once: it never counted
                pending = None
            else:
                level -= e["size"]
    return high


def _mark_before(events: list[dict[str, Any]], mark: int, end: int) -> int | None:
    """The index of ``mark``'s last allocation in the record before ``end`` (an allocation of
    RECORD_MARK_BYTES at its address); None where the record does not have it."""
    return next((i for i in range(end - 1, -1, -1) if events[i]["action"] == "alloc"
                 and events[i]["addr"] == mark and events[i]["size"] == RECORD_MARK_BYTES), None)
