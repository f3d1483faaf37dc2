"""storm/copy_queue.py: the CopyQueue on fake saves whose copies finish when waited for: what saving
drains to, the limit past a budget, and drain waiting oldest first. Full offload's room is
tests/test_room.py's."""

from __future__ import annotations

import threading

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from helpers import Put
from storm.copy_queue import CopyQueue
from storm.rooms import Rooms
from storm.saved import Step, StepOptions, Stored


def queue_and_waits() -> tuple[CopyQueue, list[int]]:
    """A queue whose poll lets go of the saves whose copy finished, oldest first, as the session's does."""
    def poll() -> None:
        while queue.copied() is not None:
            queue.pop()

    queue = CopyQueue(poll, threading.RLock())
    return queue, []


def save(queue: CopyQueue, step: Step, nbytes: int, waited: list[int],
         frame: int = 0) -> tuple[Stored, int | None]:
    """An offloaded save of ``nbytes``, its put begun (encoded into a frame of ``frame`` bytes where
    not 0), added to the queue; and what add says to drain to."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    stored = Stored(len(step.order) + 1, step, t, StorageWeakRef(t.untyped_storage()), nbytes)
    step.order.append(stored)
    stored.copy_in = Put(stored.key, waited)
    return stored, queue.add(stored, step, frame)


def test_over_its_limit_a_save_drains_the_queue_by_its_oldest_copy():
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=100), full_offload=True)
    assert save(queue, step, 60, waited)[1] is None
    assert save(queue, step, 60, waited)[1] == 60  # over by less than one save: the oldest's wait is enough
    assert queue.nbytes == 120 and waited == []


def test_a_save_encoded_into_a_frame_holds_its_frame_too_until_its_copy_is_done():
    """The frame the encoder writes stays on the device beside the save until the copy has read it:
    the queue's limit bounds both."""
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=100), full_offload=True)
    assert save(queue, step, 40, waited, frame=30)[1] is None and queue.nbytes == 70
    assert save(queue, step, 40, waited, frame=30)[1] == 70  # 140 held: over by what the oldest holds
    queue.drain(70)
    assert waited == [1] and queue.nbytes == 70


def test_of_the_queue_the_allocator_counts_the_saves_and_not_their_frames():
    """A frame leaves the caching allocator's count as its put returns (the put let go of it; its
    streams keep its memory until they have run): what the queue takes and what the allocator's
    count shows of it differ by the frames waiting."""
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=1 << 30), full_offload=True)
    save(queue, step, 40, waited, frame=30)
    save(queue, step, 20, waited)
    assert (queue.nbytes, queue.frame_nbytes, queue.allocated) == (90, 30, 60)
    queue.drain(20)
    assert (queue.nbytes, queue.frame_nbytes, queue.allocated) == (20, 0, 20)


def test_the_step_s_own_memory_is_what_the_allocator_holds_less_the_saves_waiting_here():
    """A save waiting for its copy is the queue's, not the step's: what the step holds of its own
    does not fall as the copy finishes (the allocator's count does), and a frame, which the
    allocator no longer counts, is not taken off it."""
    queue, waited = queue_and_waits()
    held = {"bytes": 500}
    queue.memory = lambda device: held["bytes"]
    step = Step(1, float("inf"), StepOptions(max_held_bytes=1 << 30), full_offload=True)
    save(queue, step, 40, waited, frame=30)
    save(queue, step, 20, waited)
    assert queue.step_memory(torch.device("cpu")) == 440
    queue.drain(0)
    held["bytes"] = 440  # the two copies done, the step's own memory as it was
    assert queue.step_memory(torch.device("cpu")) == 440
    queue.memory = lambda device: None
    assert queue.step_memory(torch.device("cpu")) is None  # off CUDA: unknown


def test_drain_waits_oldest_first_until_the_queue_is_within_the_limit():
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=1 << 30), full_offload=True)
    saves = [save(queue, step, 10, waited)[0] for _ in range(3)]
    queue.drain(15)
    assert waited == [1, 2] and queue.nbytes == 10 and queue.copies() == [saves[2].copy_in]
    assert queue.copied() is None  # the last one's copy has not finished
    queue.drain(0)
    assert waited == [1, 2, 3] and queue.nbytes == 0 and queue.copies() == []


def test_past_a_budget_copies_may_run_behind_by_what_the_last_step_saved_past_its_own():
    queue, waited = queue_and_waits()
    options = StepOptions(max_held_bytes=100)
    first = Step(1, 1000, options, full_offload=False)
    Rooms(queue).start_step(first)
    assert first.room is None and first.profile is None  # a budget: no room, no profile
    second = Step(2, 1000, options, full_offload=False)
    second.past_budget_before = 50  # the session's, from the step before (session.end_step)
    assert queue.limit(second) == 100 + 50
    second.past_budget_bytes = 20
    assert queue.limit(second) == 100 + 30
    second.past_budget_bytes = 80
    assert queue.limit(second) == 100


def test_a_step_whose_forward_has_room_below_its_peak_lets_copies_run_behind_by_it():
    """storm.plan says what forward holds below the plan's peak before each block (allow_queued):
    saves wait for no copy within it, and from the allowance's end on the queue keeps to its own."""
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=60), full_offload=False)
    step.queue_allowance = 120
    assert [save(queue, step, 60, waited)[1] for _ in range(3)] == [None, None, None]
    step.queue_allowance = 0  # the last block's end
    assert save(queue, step, 60, waited)[1] == 180 and queue.limit(step) == 60


def test_a_look_without_the_lock_at_a_save_another_thread_just_released_finds_no_finished_copy():
    """poll looks at the oldest save without the session's lock: another thread may pop it and
    release it (its copy_in set to None) between that look's two reads. The look says no copy has
    finished, where it raised AttributeError; the locked pass that follows sees the queue as it is."""
    queue, waited = queue_and_waits()
    step = Step(1, float("inf"), StepOptions(max_held_bytes=1 << 30), full_offload=True)
    stored, _ = save(queue, step, 10, waited)
    stored.copy_in = None  # what the other thread's _release leaves, seen before it pops the queue here
    assert queue.copied() is None


class ScriptedRecord:
    """An allocator record (a fake: the CPU has none): the devices it was started on, marks numbered
    from 1, how often it was read (finish), and ``events`` as what each read returns."""

    def __init__(self, events: list[dict] | None = None) -> None:
        self.events = events
        self.started: list[torch.device] = []
        self.marks = self.finished = 0

    def start(self, device: torch.device) -> None:
        self.started.append(device)

    def mark(self, device: torch.device) -> int:
        self.marks += 1
        return self.marks

    def finish(self, device: torch.device) -> list[dict] | None:
        self.finished += 1
        return self.events


def test_a_profiled_unpack_brings_back_the_storage_once_and_leaves_its_mark_in_the_record():
    """The profile counts a storage's bytes brought back at its first unpack only, and not where it is
    still on the device (a room's window would otherwise be spent on saves further on); each
    reading leaves a mark in the allocator's record, which starts at the first."""

    queue, waited = queue_and_waits()
    rooms = Rooms(queue)
    rooms.record = record = ScriptedRecord()
    rooms.queue.memory = lambda device: 100
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(step)
    assert step.profile is not None
    stored, _ = save(queue, step, 10, waited)
    held, _ = save(queue, step, 20, waited)
    for s in (stored, held):
        rooms.follow_room(step, s.tensor.untyped_storage(), s.nbytes)
    assert step.profile.addresses == [s.tensor.untyped_storage().data_ptr() for s in (stored, held)]
    stored.tensor = None  # its copy is done and let go of: backward fetches it
    rooms.unpacked(held, 0)  # still on the device: nothing to bring back
    for restored in (False, True):
        rooms.unpacked(stored, 0, restored=restored)
        stored.unpacks += 1  # the session counts a fetched unpack after the reading
    assert step.profile.unpack_sizes == [0, 10, 0]
    # what is held counts a storage an earlier unpack brought back and that is still alive: its second
    # unpack's reading does not count it again
    held_now = 100 - queue.nbytes
    assert step.profile.unpacks[1:] == [held_now + 10, held_now]
    assert step.profile.unpack_saves == [1, 0, 0]  # which save each unpack took, by its place in forward
    assert step.profile.marks == [1, 2, 3, 4, 5] and record.started == [stored.device]
    # each reading left out the saves in the queue (whose copies are not done): at an unpack, the one
    # still on the device; at a save, that save too
    address = held.tensor.untyped_storage().data_ptr()
    assert step.profile.left_out[2:] == [[address]] * 3
    assert address in step.profile.left_out[1]


def test_closing_stops_the_record_of_a_step_still_profiling():
    """A session closed before the profiled step's room is made stops the allocator's record it started."""

    queue, waited = queue_and_waits()
    rooms = Rooms(queue)
    rooms.record = record = ScriptedRecord()
    rooms.queue.memory = lambda device: 100
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(step)
    stored, _ = save(queue, step, 10, waited)
    rooms.follow_room(step, stored.tensor.untyped_storage(), 10)
    rooms.close()
    assert record.finished == 1


def test_the_profiled_step_record_is_read_once_though_budget_steps_come_between():
    """A budget step after the profiled one reads the record (so it stops); the full-offload step
    after it makes the room from what was read, without reading (a user's record: snapshotting) again."""
    from storm import allocator_record

    queue, waited = queue_and_waits()
    rooms = Rooms(queue)
    # the one save's mark and its unpack's (1 and 2), as the record saw them
    size = allocator_record.RECORD_MARK_BYTES
    rooms.record = record = ScriptedRecord([{"action": "alloc", "addr": mark, "size": size, "stream": 0}
                                            for mark in (1, 2)])
    rooms.queue.memory = lambda device: 100
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(step)
    stored, _ = save(queue, step, 10, waited)
    rooms.follow_room(step, stored.tensor.untyped_storage(), 10)
    rooms.unpacked(stored, 0)
    profile = step.profile
    # a budget: the room waits, the record is read
    rooms.start_step(Step(2, 1 << 20, StepOptions(), full_offload=False))
    assert record.finished == 1 and profile.rises == [0, 0] and step.profile is None  # read: the step's no more
    assert profile.frees == [[], []] and profile.counted == [range(0)]  # its block predates the record
    after = Step(3, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(after)
    assert record.finished == 1 and after.room is not None
