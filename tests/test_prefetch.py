"""storm/prefetch.py: the Prefetcher on steps of fake saves, with a fake fetch injected: what it
starts ahead of backward, within which room, where it waits, and what ``take`` hands back."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import Put
from storm.copies.base import Copy, Landed
from storm.copy_queue import CopyQueue
from storm.prefetch import Prefetcher
from storm.replies import Resolved
from storm.room import Profile, Room
from storm.saved import Marker, State, Step, StepOptions, Stored

KIB = 1024


def step_of(states: list[str], nbytes: int = 4 * KIB, window: int = 0) -> Step:
    """A step whose saves, in saving order, are in these states (each saved once, not unpacked)."""
    step = Step(1, float("inf"), StepOptions(prefetch_bytes=window), full_offload=True)
    for key, state in enumerate(states, 1):
        t = torch.empty(nbytes, dtype=torch.uint8)
        s = Stored(key, step, t, StorageWeakRef(t.untyped_storage()), nbytes)
        s.state, s.handles = state, 1
        step.order.append(s)
    return step


def prefetcher(restored: dict | None = None) -> tuple[Prefetcher, list[int]]:
    fetched: list[int] = []
    return Prefetcher(lambda s: fetched.append(s.key) or Copy(Resolved(Landed())),
                      restored if restored is not None else {},
                      lambda device: None), fetched


def test_backward_fetches_the_saves_before_it_newest_first_within_the_window_once_it_is_open():
    step = step_of([State.OFFLOADED] * 4, window=8 * KIB)
    p, fetched = prefetcher()
    p.ahead(step, 4)
    assert fetched == []  # the window opens at the first offloaded save backward unpacks
    step.fetching = True
    p.ahead(step, 4)
    assert fetched == [4, 3] and p.nbytes == 8 * KIB
    p.take(step.order[3])
    p.ahead(step, 3)
    assert fetched == [4, 3, 2] and p.nbytes == 8 * KIB and p.take(step.order[3]) is None


def test_a_window_smaller_than_a_save_takes_it_unless_a_full_offload_room_set_the_window():
    """A user's window of less than one save still fetches one; a room's window is what fits under
    the step's floor, and a save that does not fit waits for its unpack."""
    step = step_of([State.OFFLOADED] * 2, window=1 * KIB)
    step.fetching = True
    p, fetched = prefetcher()
    p.ahead(step, 2)
    assert fetched == [2]
    step = step_of([State.OFFLOADED] * 2, window=64 * KIB)
    step.fetching = True
    step.room = Room(Profile(sizes=[4 * KIB] * 2, saves=[10 * KIB, 24 * KIB], unpack_sizes=[4 * KIB] * 2,
                             unpacks=[22 * KIB, 20 * KIB]))
    step.unpacked = 1
    assert step.window() == 2 * KIB  # beside 22 KiB under a floor of 24
    p, fetched = prefetcher()
    p.ahead(step, 2)
    assert fetched == []


def test_a_save_stored_in_a_frame_is_fetched_only_where_its_frame_fits_beside_it():
    """A get brings a framed save back in its frame and decodes it into a new tensor: the two are on
    the device together, so the window must hold both."""
    step = step_of([State.OFFLOADED] * 2, window=10 * KIB)
    step.order[0].frame_bytes = 3 * KIB
    step.order[1].frame_bytes = 3 * KIB
    step.fetching = True
    p, fetched = prefetcher()
    p.ahead(step, 2)
    assert fetched == [2] and p.nbytes == 4 * KIB  # the first with its frame fits in 10; the second's would not
    step.order[0].frame_bytes = 0
    p.ahead(step, 1)
    assert fetched == [2, 1]


def test_room_backward_made_lets_saves_come_back_but_only_whole():
    step = step_of([State.OFFLOADED] * 4)
    p, fetched = prefetcher()
    step.fetch_allowance = 6 * KIB  # room for one and a half
    p.ahead(step, 4)
    assert fetched == [4]


def test_it_waits_at_a_save_still_being_copied_and_passes_saves_not_in_the_store_or_here():
    step = step_of([State.OFFLOADED, State.HELD, State.KEPT, State.OFFLOADED, State.OFFLOADED], window=1 << 20)
    here = torch.empty(1)
    p, fetched = prefetcher(restored={5: weakref.ref(here)})
    step.fetching = True
    p.ahead(step, 5)
    assert fetched == [4]  # 5's bytes are here; 3 stayed on its device; 2's copy to the store still runs
    step.order[1].state = State.OFFLOADED
    p.ahead(step, 5)
    assert fetched == [4, 2, 1]


def test_the_room_a_marker_reports_off_cuda_is_what_was_saved_since_the_marker_before():
    step = step_of([State.OFFLOADED])
    step.fetch_allowance = 3 * KIB
    p, _ = prefetcher()
    assert p.allowance_at(step, Marker(torch.empty(1), step, 5 * KIB)) == 8 * KIB


def test_a_marker_s_allowance_is_what_backward_freed_and_not_the_copies_finished_since_forward():
    """Past a budget, what forward's end held (Step.level) and what a marker reads are the step's
    own memory, the copy queue's saves left out of both: a language model's loss unpacks its first
    marker at the step's peak, by when the copies of forward's last saves have finished, and their
    bytes counted as freed had the prefetcher bring as many back on top of that peak."""
    def poll() -> None:  # the session's: a save whose copy finished leaves the queue
        while queue.copied() is not None:
            queue.pop()

    held = {"bytes": 0}
    queue = CopyQueue(poll, threading.RLock())
    queue.memory = lambda device: held["bytes"]
    step = step_of([State.OFFLOADED] * 3, nbytes=40 * KIB)
    step.options = StepOptions(max_held_bytes=1 << 30)
    waiting = step.order[2]
    waiting.copy_in = Put(waiting.key)
    queue.add(waiting, step)  # forward's last offloaded save, its copy still running as forward ends
    held["bytes"] = 140 * KIB  # the step's own 100 KiB and that save's 40
    step.level = queue.step_memory(torch.device("cpu"))
    queue.drain(0)  # its copy done, the save let go: the allocator holds the step's own alone
    held["bytes"] = 100 * KIB
    p = Prefetcher(lambda s: Copy(Resolved(Landed())), {}, queue.step_memory)
    marker = Marker(torch.empty(1), step, 0)
    assert p.allowance_at(step, marker) == 0  # backward freed nothing yet
    held["bytes"] = 76 * KIB  # the loss's backward freed 24 KiB of its own
    assert p.allowance_at(step, marker) == 24 * KIB


def test_a_storage_the_unpack_fetches_itself_is_not_fetched_ahead_again():
    """Backward's unpack of a storage several ops saved fetches it on demand and then looks ahead:
    the prefetcher must not start a second fetch of the same storage (its later unpacks find the
    first one's bytes)."""
    step = step_of([State.OFFLOADED] * 3, window=64 * KIB)
    step.fetching = True
    shared = step.order[2]
    shared.handles, shared.unpacks = 3, 1  # its first unpack, the fetch on its way
    p, fetched = prefetcher()
    p.ahead(step, 3, now=shared)
    assert fetched == [2, 1]  # the two before it, not it




def test_a_storage_saved_again_later_is_fetched_where_it_was_last_saved():
    """A model's rotary tables, made before the first layer and saved by every layer: the last
    layer's recompute needs them first. Fetched where the first layer saved them, they came
    behind every other fetch on the copy stream, and the last layer waited for all of them."""
    step = step_of([State.OFFLOADED] * 4, window=8 * KIB)
    table = step.order[0]
    table.handles = 3
    step.saved_again = [(2, table), (3, table)]  # saved again after the second save and after the third
    step.fetching = True
    p, fetched = prefetcher()
    p.ahead(step, 4)
    assert fetched == [4, 1]  # the table before the third save, not the third save
    p.take(step.order[3])
    p.ahead(step, 3)
    assert fetched == [4, 1, 3]  # its place after the second save is passed: it is on its way
    p.take(table)  # unpacked, and kept for its later unpacks (restore.py)
    table.unpacks, here = 1, torch.empty(1)
    p.restored[table.key] = weakref.ref(here)
    p.take(step.order[2])
    p.ahead(step, 2)
    assert fetched == [4, 1, 3, 2]  # its place after the first save: here already
