"""Full offload's room (storm/room.py): the copy queue and the prefetch window fill only what fits
under the floor a profiled step found, so that neither sits on the step's peak."""

from __future__ import annotations

import random
import threading

import pytest
import torch

import storm
from helpers import Put
from storm import allocator_record
from storm.copy_queue import CopyQueue
from storm.examples.models import same_bits
from storm.room import Profile, Room
from storm.rooms import KIND_TRIES, Rooms
from storm.saved import Step, StepOptions

MiB = 1 << 20


def room() -> Room:
    # held besides the queue at each of four saves (the last, a loss's, the step's highest),
    # and besides queue and window at each of four unpacks
    return Room(Profile(sizes=[8, 8, 8, 8], saves=[10, 10, 50, 80], unpack_sizes=[8, 8, 8, 8],
                        unpacks=[90, 20, 20, 70]))


def test_the_queue_holds_what_fits_under_the_floor_beside_the_next_save_and_backward_start():
    r = room()
    assert r.floor == 90
    assert [r.queue(made) for made in (1, 2, 3)] == [90 - 10, 90 - 50, 90 - 80]
    assert r.queue(4) == 8  # forward's end: backward's first unpack holds the floor, with the last save in it


def test_the_window_fetches_what_fits_under_the_floor_until_those_bytes_are_unpacked():
    r = room()
    assert r.window(0, 100) == 8      # the first save fits beside forward's end, and its unpack counts it
    assert r.window(1, 100) == 0      # the unpack just made holds the floor: nothing more until the next
    assert r.window(2, 100) == 16     # both saves left fit beside the 20 held until their unpacks
    assert r.window(2, 12) == 12      # never more than the user's window
    assert r.window(3, 100) == 8      # the last one, beside 20
    assert r.window(4, 100) == 100    # past the profile: nothing more is held
    step = Step(1, float("inf"), StepOptions(prefetch_bytes=100), full_offload=True)
    assert step.window() == 100
    step.room, step.unpacked = r, 2
    assert step.window() == 16


def test_a_storage_unpacked_again_later_is_fetched_again_where_holding_it_would_make_the_floor():
    """Save 1 (40 bytes) is unpacked twice, at backward's second unpack and its fourth; held in
    between it is under the step's highest reading (100, at the third). Fetched again at its second
    unpack instead, that reading is 60 and so is the floor; where its own unpack is the highest,
    nothing is fetched again."""
    def profile(unpacks: list[int], size: int = 40) -> Profile:
        return Profile(sizes=[8, size, 8, 8], saves=[10, 20, 30, 40], unpack_sizes=[8, size, 8, 0, 8],
                       unpacks=unpacks, unpack_saves=[3, 1, 2, 1, 0])
    r = Room(profile([30, 60, 100, 60, 20]), keep=False)
    assert r.refetched == {1} and r.refetches(1) and not r.refetches(2)
    assert r.floor == 60
    few = Room(profile([30, 60, 500, 60, 20], size=4), keep=False)  # it would take less than 1% off the floor
    assert few.refetched == set() and few.floor == 500
    assert Room(profile([30, 60, 400, 60, 20], size=4), keep=False).floor == 396  # 1%: fetched again
    own = Room(profile([30, 120, 100, 60, 20]), keep=False)
    assert own.refetched == set() and own.floor == 120
    kept = Room(profile([30, 60, 100, 60, 20]))  # the last saves kept: save 1 is fetched, not kept
    assert kept.refetches(1) == (kept.kept < 3)


def test_a_step_report_says_what_its_room_lets_the_queue_and_the_window_hold():
    r = Room(Profile(sizes=[8 * MiB] * 4, saves=[10 * MiB, 10 * MiB, 50 * MiB, 80 * MiB], unpack_sizes=[8 * MiB] * 4,
                     unpacks=[90 * MiB, 20 * MiB, 20 * MiB, 70 * MiB]))
    text = r.describe(queue_limit=64 * MiB, window_limit=256 * MiB)
    assert "reached 90.0 MiB" in text
    assert "at most 64.0 MiB during forward" in text  # the room's 80 MiB, within max_held_bytes
    assert "8.0 MiB as it ends, the window 8.0 MiB at backward's first unpack" in text
    assert "(max_held_bytes 64 MiB, prefetch_bytes 256 MiB)" in text


def test_what_the_allocator_record_saw_rise_between_readings_bounds_the_queue_and_the_window():
    """A save's op allocates a temporary before the next save, and backward's first op allocates
    its gradients right after its unpack: neither is in a reading, both are in the record's rises."""
    r = Room(Profile(sizes=[8, 8, 8, 8], saves=[10, 10, 50, 80], unpack_sizes=[8, 8, 8, 8],
                     unpacks=[90, 20, 20, 70], rises=[60, 0, 0, 0, 30, 0, 0, 0]))
    assert r.floor == 120                                   # backward's first op: 90 + 30
    assert [r.queue(made) for made in (1, 2, 3)] == [120 - 62, 120 - 50, 120 - 80]  # 10 - 8 + 60 after the first
    assert r.queue(4) == min(120 - 72, 120 - 90 + 8)       # forward's end, then backward's first unpack
    assert r.window(1, 100) == 0                            # 120 held after the first unpack
    assert r.window(0, 100) == 8
    unmeasured = Room(Profile(sizes=[8], saves=[10], unpack_sizes=[8], unpacks=[20], rises=[5]))
    assert unmeasured.floor == 20  # rises of another count than the readings': none is counted


def test_rises_replay_the_step_own_memory_between_marks():
    """The record's events between marks: allocations on the marks' stream count, those on others
    (STORM's copies) and their frees do not, nor does a mark's own free."""
    own, copy = 7, 9

    mark = allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark, stream: int = own) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [ev("alloc", 1, 100), ev("alloc", 500, 512), ev("free_requested", 500, 512),  # not a mark: its size
              ev("alloc", 500), ev("free_requested", 500),  # mark 500
              ev("alloc", 2, 40), ev("alloc", 3, 1000, copy), ev("alloc", 4, 30), ev("free_requested", 2, 40),
              ev("alloc", 6, 500, copy), ev("free_requested", 6, 500, copy),  # a frame: the copies' own
              ev("alloc", 500), ev("free_requested", 500),  # mark 500 again
              ev("free_requested", 3, 1000, copy), ev("alloc", 7, 50), ev("free_requested", 1, 100),
              ev("alloc", 5, 20), ev("free_completed", 4, 30)]
    assert allocator_record.replay(events, [500, 500]).rises == [70, 50]  # 40 + 30 before a free; then 50
    assert allocator_record.replay(events, [500, 600]) is None  # a mark the record lost
    assert allocator_record.replay(events, []).rises == []


def test_a_fetched_storage_freed_once_its_op_ran_is_no_rise_under_the_gradient_it_made():
    """Backward unpacks a storage fetched on STORM's stream, ahead of its reading or on demand after
    it: the unpack's reading counts it (``fetched``), its op frees it and allocates a gradient as
    large. What the step holds did not rise. A block fetched ahead that no reading counted (the
    window, which the readings take off) and a queued save made on another stream are the copies'
    own to their frees."""
    own, copy, mark = 7, 9, allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark, stream: int = own) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [ev("alloc", 500), ev("free_requested", 500),                # a reading
              ev("alloc", 3, 1000, copy), ev("alloc", 8, 300, copy),       # fetched ahead: 3, and 8 (the window)
              ev("alloc", 500), ev("free_requested", 500),                # the unpack's reading counts 3
              ev("free_requested", 3, 1000, copy), ev("alloc", 4, 1000),  # its op ran: the gradient
              ev("alloc", 500), ev("free_requested", 500),                # an unpack's reading, fetched on demand:
              ev("alloc", 5, 600, copy), ev("free_requested", 5, 600, copy), ev("alloc", 6, 600),
              ev("free_requested", 8, 300, copy), ev("alloc", 9, 10)]
    fetched = [[], [3], [5]]
    assert allocator_record.replay(events, [500] * 3, fetched=fetched).rises == [0, 0, 10]
    assert allocator_record.replay(events, [500] * 3).rises == [0, 1000, 610]  # as each were the copies' own
    queued = [ev("alloc", 500), ev("free_requested", 500),
              ev("alloc", 20, 1000, copy),                                # a save made on another stream
              ev("alloc", 500), ev("free_requested", 500),                # its reading: in the queue
              ev("free_requested", 20, 1000, copy), ev("alloc", 21, 1000)]  # copied and freed
    assert allocator_record.replay(queued, [500, 500], [[], [20]], fetched=[[], []]).rises == [0, 1000]
    # a storage an unpack counted that a later reading finds in the queue (saved again in backward)
    # and that is freed there: a window block at its address after it is the copies' own
    again = [ev("alloc", 500), ev("free_requested", 500),
             ev("alloc", 30, 400, copy),
             ev("alloc", 500), ev("free_requested", 500),  # an unpack's reading counts 30
             ev("alloc", 500), ev("free_requested", 500),  # in the queue at this one
             ev("free_requested", 30, 400, copy), ev("alloc", 30, 800, copy),  # a window block at its address
             ev("alloc", 500), ev("free_requested", 500),
             ev("free_requested", 30, 800, copy), ev("alloc", 31, 800)]
    assert allocator_record.replay(again, [500] * 4, [[], [], [30], []], fetched=[[], [30], [], []]).rises[3] == 800


def test_a_step_peak_counts_every_stream_from_its_mark_to_the_record_end():
    """A trial step's peak: the allocator's bytes above its first save's mark, STORM's copies
    counted too (they are on the device as much as the step's tensors), a block from before the
    mark freed below it, the mark's own free not at all."""
    mark = allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark, stream: int = 7) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [ev("alloc", 1, 100),  # before the mark: its free falls below the reading
              ev("alloc", 500), ev("free_requested", 500),
              ev("alloc", 2, 40), ev("alloc", 3, 1000, stream=9), ev("free_requested", 3, 1000, stream=9),
              ev("free_requested", 1, 100), ev("alloc", 4, 1050), ev("free_completed", 4, 1050)]
    assert allocator_record.peak(events, 500) == 1040  # 40 and the copy's 1000; later 40 - 100 + 1050
    assert allocator_record.peak(events, 600) is None  # a mark the record lost
    assert allocator_record.peak(events[:3], 500) == 0


def test_a_record_begun_before_the_step_holds_older_marks_at_the_same_address():
    """The allocator hands each mark the block the one before freed: where the record began
    earlier (someone else's, left running), an older step's marks share the address; the step's
    own are the last ones."""
    mark = allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 7}

    older = [ev("alloc", 500), ev("free_requested", 500), ev("alloc", 1, 900), ev("free_requested", 1, 900)]
    step = [ev("alloc", 500), ev("free_requested", 500), ev("alloc", 2, 10),
            ev("alloc", 500), ev("free_requested", 500), ev("alloc", 3, 20)]
    assert allocator_record.peak(older + step[3:], 500) == 20  # from the older mark: 900
    assert allocator_record.replay(older + step, [500, 500]).rises == [10, 20]  # [900, 10] from the older marks


def test_a_queued_save_freed_before_the_next_mark_is_not_counted_off_twice():
    """A reading leaves out the saves in the copy queue: one of them freed once its copy is done,
    before the next mark, does not lower the level, so what the step allocates after it (a loss's
    gradients once its logits-sized save went out) is a rise."""
    mark = allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 7}

    events = [ev("alloc", 500), ev("free_requested", 500),
              ev("free_requested", 10, 1000),  # the queued save, copied: its block goes
              ev("alloc", 11, 1000),           # the loss's gradient, as large
              ev("alloc", 500), ev("free_requested", 500),
              ev("alloc", 10, 64), ev("free_requested", 10, 64), ev("alloc", 12, 32)]  # a new block at its address
    assert allocator_record.replay(events, [500, 500]).rises == [0, 64]  # counted off twice: no rise seen
    assert allocator_record.replay(events, [500, 500], [[10], [10]]).rises == [1000, 64]


def test_a_save_freed_after_its_copy_while_a_reading_counted_it_is_replayed_as_such():
    """A save whose copy is done while the step still holds it (a log-softmax that the loss's next
    op reads) is counted by the readings from then until its free; the rise after that free is
    what a kept save would sit under. A save in the queue at its free is neither."""
    mark = allocator_record.RECORD_MARK_BYTES

    def ev(action: str, addr: int, size: int = mark) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 7}

    events = [ev("alloc", 500), ev("free_requested", 500),  # save 0's reading: its block is older than the record
              ev("alloc", 20, 40),                          # save 1's block
              ev("alloc", 500), ev("free_requested", 500),  # save 1's reading
              ev("alloc", 500), ev("free_requested", 500),  # an unpack's reading: save 1 out of the queue
              ev("free_requested", 20, 40), ev("alloc", 30, 50)]
    found = allocator_record.replay(events, [500] * 3, [[10], [10, 20], []], [10, 20])
    assert found.rises == [40, 0, 10] and found.frees == [[], [], [(1, 10)]]
    assert found.counted == [range(0), range(2, 3)]
    queued = allocator_record.replay(events, [500] * 3, [[10], [10, 20], [20]], [10, 20])
    assert queued.rises == [40, 0, 50] and queued.frees == [[], [], []] and queued.counted == [range(0)] * 2


def test_a_kept_save_that_the_profile_counted_after_its_copy_is_not_counted_twice():
    """The log-softmax (40) went out, its copy done while the loss still read it: the target's
    reading (82) counts it, and it is freed before backward. Kept, it adds nothing there, and after
    its free only its bytes on top of what came after; counted twice it would not fit under the floor
    that its second unpack's gradients (39) make."""
    def profile(frees: list[list[tuple[int, int]]], counted: list[range]) -> Profile:
        return Profile(sizes=[8, 8, 40, 1, 1], saves=[10, 20, 80, 41, 82], unpack_sizes=[40, 1, 1, 0, 8, 8],
                       unpacks=[41, 41, 41, 81, 30, 20], unpack_saves=[2, 3, 4, 2, 1, 0],
                       rises=[0] * 8 + [39, 0, 0], frees=frees, counted=counted)

    replayed = [[]] * 4 + [[(2, -40)]] + [[]] * 6
    counted = [range(0)] * 2 + [range(4, 5)] + [range(0)] * 2
    r = Room(profile(replayed, counted))
    assert r.floor == 81 + 39 and r.kept == 3
    assert Room(profile([], [])).kept == 2  # not replayed: the two small saves; 82 + 40 + 1 with the log-softmax
    after_free = [[]] * 4 + [[(2, 5)]] + [[]] * 6  # 5 allocated once it was freed: 45 on top of 83
    assert Room(profile(after_free, counted)).kept == 2


def lm_room(rises: dict[int, int] | None = None, order: list[int] | None = None) -> Room:
    """A language model's step (in MiB): forward's last two saves are its loss's, a log-softmax of 40
    and then a target of 1, which backward unpacks first; right after the log-softmax's unpack,
    backward allocates its gradients (39), the step's highest. ``rises``: by reading (0-4 the
    saves', 5-9 the unpacks')."""
    every = [0] * 10
    for k, rise in (rises or {6: 39}).items():
        every[k] = rise
    return Room(Profile(sizes=[8, 8, 8, 40, 1], saves=[10, 20, 30, 80, 41],
                        unpack_sizes=[1, 40, 8, 8, 8], unpacks=[41, 81, 40, 30, 20],
                        unpack_saves=[4, 3, 2, 1, 0] if order is None else order, rises=every))


def test_the_room_keeps_the_last_saves_that_fit_under_the_floor_until_backward_unpacks_them():
    r = lm_room()
    assert r.floor == 81 + 39
    # both loss saves stay: 80 - 40 + 41 held from the target's save to its unpack, 41 + 40 at it,
    # and 120 at the log-softmax's; a third (8) would put 128 there
    assert r.kept == 2
    assert r.keeps(4, 40) and r.keeps(5, 1) and not r.keeps(3, 8) and not r.keeps(5, 2)
    assert r.queue(3) == 120 - 80    # the log-softmax's reading, which counts it
    assert r.queue(4) == 120 - 81    # the target's reading, and the log-softmax kept beside it
    assert r.queue(5) == 0           # the log-softmax's unpack and its gradients hold the floor
    # a loss's op rising 50 over the target's save before backward begins: the target alone fits
    assert lm_room(rises={4: 50, 6: 39}).kept == 1
    assert lm_room(rises={4: 80, 6: 39}).kept == 0  # 40 + 80, the floor, and the target on top: over


def test_kept_saves_are_held_until_their_first_unpacks_wherever_backward_takes_them():
    assert lm_room(order=[3, 4, 2, 1, 0]).kept == 2  # both loss saves first, in either order
    # the log-softmax's gradients (39, at backward's second unpack) come before the target's
    # unpack: the target kept on top of them is 121
    assert lm_room(order=[3, 2, 4, 1, 0]).kept == 0
    assert lm_room(order=[]).kept == 0               # which save each unpack took is not known


def test_a_save_of_another_storage_unpacked_between_the_kept_ones_is_fetched_in_its_place():
    """T5's labels are a view of the storage of its input ids, which the encoder's embedding saved
    first: the loss's backward unpacks that early save between its own. The loss's saves are kept
    all the same; the steps after the profile count their unpacks of offloaded saves from the
    early save's place."""
    r = Room(Profile(sizes=[8, 8, 40, 1], saves=[10, 20, 80, 41], unpack_sizes=[40, 8, 1, 0, 8],
                     unpacks=[81, 82, 82, 81, 30], unpack_saves=[2, 0, 3, 2, 1], rises=[0] * 7 + [39, 0]))
    assert r.floor == 81 + 39 and r.kept == 2  # with the block's save (8) too, 128 at the gradients
    # forward's end: the queue fits beside what is held until the early save's unpack, the first
    # of an offloaded save (the log-softmax's unpack, the target kept beside it: 82); the window
    # there fetches the early save, and past the profile's unpacks the limit holds
    assert r.queue(4) == 120 - 82 and r.window(0, 100) == 8 and r.window(2, 100) == 100


def test_the_kept_count_is_the_most_that_fits_as_every_count_would_be_checked():
    """The search checks a few counts (each more save kept holds more); against checking every count."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        sizes = [rng.randint(1, 20) for _ in range(n)]
        order = list(range(n - 1, -1, -1))
        if rng.random() < 0.3:
            i = rng.randrange(n)
            order.insert(rng.randrange(len(order) + 1), order[i])  # a storage unpacked twice
        profile = Profile(sizes=sizes, saves=[rng.randint(s, 100) for s in sizes],
                          unpack_sizes=[sizes[s] for s in order], unpacks=[rng.randint(1, 100) for _ in order],
                          unpack_saves=order, rises=[rng.randint(0, 30) for _ in range(n + len(order))])
        readings = n + len(order)
        # some saves counted by readings after their copies, and freed at the last of them
        profile.counted = [range(i + 1, rng.randint(i + 1, readings)) if rng.random() < 0.3 else range(0)
                           for i in range(n)]
        profile.frees = [[] for _ in range(readings)]
        for i, counted in enumerate(profile.counted):
            if counted:
                profile.frees[counted[-1]].append((i, rng.randint(-20, 20)))
        r = Room(profile)
        fitting = [kept for kept in range(1, r._tails() + 1) if max(sum(r._readings(kept, r.refetched), [])) <= r.floor]
        assert r.kept == max(fitting, default=0), profile


def test_a_compiled_graph_save_is_never_kept_and_its_step_follows_a_room_that_keeps_none():
    """A compiled graph reuses a save's memory once it lets go of it: a kept save would be a copy
    beside what the profile measured. Its step follows the same profile with nothing kept, from
    backward's first unpack."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.room = lm_room()
    assert rooms.room.kept == 2
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(step)
    assert step.room is rooms.room and step.unpacked == 0
    storage = torch.empty(4).untyped_storage()
    assert not rooms.keeps(step, storage, 40, compiled=True)
    assert step.room is rooms.room and (step.room.kept, step.unpacked) == (0, 0)
    assert step.room.floor == lm_room().floor and step.room.queue(5) == Room(lm_room().profile, keep=False).queue(5)
    eager = Step(2, float("inf"), StepOptions(), full_offload=True)
    rooms.room = lm_room()
    rooms.start_step(eager)
    eager.order += [object()] * 3  # three saves offloaded: the fourth and fifth are the room's to keep
    assert rooms.keeps(eager, storage, 40) and rooms.keeps(eager, storage, 40)  # the storage again: kept
    assert eager.made == 4


def test_a_storage_made_where_a_kept_one_was_freed_is_no_kept_one():
    """A room holds the storages it keeps by a weak reference, as Offload.keep does: one freed (a
    branch of forward dropped), a new storage the allocator makes at its address is a save of its
    own, which the room keeps or not by its place and size (before: it was taken for the kept one,
    stayed on the device whatever its size, and the step's count of saves fell behind the room's)."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.room = lm_room()
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(step)
    step.order += [object()] * 3  # three saves offloaded: the fourth (40) and fifth (1) are the room's to keep
    kept = torch.empty(10).untyped_storage()
    assert rooms.keeps(step, kept, 40) and step.made == 4
    del kept
    made = [torch.empty(10).untyped_storage() for _ in range(64)]  # one at its address, where it was freed
    assert not any(rooms.keeps(step, s, 8) for s in made)  # none is the room's fifth save (1 byte)
    assert step.made == 4


def test_a_step_that_may_go_on_past_its_room_keeps_none_of_its_last_saves():
    """Two forwards before one backward, after steps of one: the first forward's saves are the
    one-forward room's, so their last would be kept and then sit beside the second forward's.
    While a room of such longer steps is known too, a step keeps none of the shorter room's."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    short = lm_room()
    longer = Room(Profile(sizes=[*short.profile.sizes, 8, 8], saves=[*short.profile.saves, 20, 20]))

    def keeps_fourth() -> bool:
        step = Step(1, float("inf"), StepOptions(), full_offload=True)
        rooms.start_step(step)
        step.order += [object()] * 3  # three saves offloaded: the fourth is the short room's to keep
        return step.room is short and rooms.keeps(step, torch.empty(4).untyped_storage(), 40)

    rooms.follow(short)
    assert keeps_fourth()
    rooms.follow(longer)
    rooms.follow(short)  # both kinds known, the short one followed last
    assert not keeps_fourth()


class PeakRecord:
    """An allocator record (a fake: the CPU has none) of trial steps: each read (finish) returns the
    events since the step's mark, where the step rises by the next of ``rises`` and falls back;
    None: no record."""

    def __init__(self, rises: list[int | None]):
        self.rises, self.started, self.address = list(rises), 0, 0

    def start(self, device: torch.device) -> None:
        self.started += 1

    def mark(self, device: torch.device) -> int:
        self.address += 1
        return self.address

    def finish(self, device: torch.device) -> list[dict] | None:
        rise = self.rises.pop(0)
        if rise is None:
            return None
        size = allocator_record.RECORD_MARK_BYTES
        return [{"action": "alloc", "addr": self.address, "size": size, "stream": 0},
                {"action": "free_requested", "addr": self.address, "size": size, "stream": 0},
                {"action": "alloc", "addr": 7, "size": rise, "stream": 1},
                {"action": "free_requested", "addr": 7, "size": rise, "stream": 1}]


@pytest.mark.parametrize("rises, keeps", [([90, 50], False), ([50, 50], True), ([None], True), ([50, None], True)])
def test_a_room_that_keeps_saves_is_tried_against_keeping_none_and_the_lower_peak_is_followed(rises, keeps, caplog):
    """The room's kept saves come from a model of the step: the step after the profile follows it,
    the next one the same profile keeping none, each step's peak read from the allocator's record
    from its first save; then the steps follow the one that peaked lower (the keeping one where
    even, or where a peak could not be read)."""
    import logging

    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    rooms.record = record = PeakRecord(rises)
    rooms.profiling = lm_room().profile
    storage = torch.empty(2).untyped_storage()

    def step(number: int) -> Step:
        s = Step(number, float("inf"), StepOptions(), full_offload=True)
        rooms.start_step(s)
        s.order.append(object())  # its first save, offloaded
        rooms.follow_room(s, storage, 8)
        s.unpacked = 1  # and backward unpacked it
        return s

    with caplog.at_level(logging.INFO, logger="storm"):
        tried = [step(n) for n in range(1, 2 + len(rises))]
    assert tried[0].room.kept == 2 and rooms.trial is None
    assert [s.room.kept for s in tried[1:len(rises)]] == [0] * (len(rises) - 1)  # the second tries none kept
    assert tried[-1].room.kept == (2 if keeps else 0)
    assert record.started == len(rises) and record.rises == []
    assert any("keeping none" in r.getMessage() for r in caplog.records) == (not keeps)
    later = Step(len(rises) + 2, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(later)
    assert later.room is tried[-1].room and record.started == len(rises)  # no more steps measured


@pytest.mark.parametrize("saves, unpacked", [(1, 0), (0, 0)])
def test_a_trial_step_without_backward_measures_nothing_and_the_next_tries_the_room_again(saves, unpacked):
    """A trial step abandoned after forward (its peak is forward's alone), or one that made no save
    (an evaluation's forward), is no measure of the room it tried: the next step tries the same
    room; past MAX_TRIAL_STEPS such steps the trial ends on the keeping room."""
    from storm.rooms import MAX_TRIAL_STEPS

    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    rooms.record = PeakRecord([10] * (MAX_TRIAL_STEPS + 8))
    rooms.profiling = lm_room().profile
    storage = torch.empty(2).untyped_storage()

    def step(number: int, made: int, unpacked: int) -> Step:
        s = Step(number, float("inf"), StepOptions(), full_offload=True)
        rooms.start_step(s)
        for _ in range(made):
            s.order.append(object())
            rooms.follow_room(s, storage, 8)
        s.unpacked = unpacked
        return s

    first = step(1, 1, 1)  # the keeping room, measured
    skipped = step(2, saves, unpacked)
    assert skipped.room is rooms.trial.bare and rooms.trial.peaks == [110]
    again = step(3, 1, 1)
    assert again.room is rooms.trial.bare  # tried again: the skipped step measured nothing
    step(4, 1, 1)
    assert rooms.trial is None and first.room.kept == 2
    # a trial whose steps never run backward ends, on the keeping room
    rooms.profiling = lm_room().profile
    steps = [step(10 + n, 1, 0) for n in range(MAX_TRIAL_STEPS + 1)]
    assert rooms.trial is None and steps[-1].room.kept == 2


def test_a_step_is_settled_once_it_follows_to_its_end_the_room_no_trial_weighs():
    """storm.plan measures full offload by the first step that ran as the steps after it will
    (Rooms.settled, Offload.room_settled): not a step that profiled with readings, nor a trial's
    step, nor one that left its room part-way; a step whose profile read nothing (no allocator
    to read: the CPU) is, since no room can be made for it."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    storage = torch.empty(2).untyped_storage()

    def step(number: int, sizes: tuple[int, ...] = (8,)) -> Step:
        s = Step(number, float("inf"), StepOptions(), full_offload=True)
        rooms.start_step(s)
        for size in sizes:
            s.order.append(object())
            rooms.follow_room(s, storage, size)
        s.unpacked = 1
        return s

    rooms.queue.memory = lambda device: None  # nothing read
    unread = step(1)
    assert unread.profile is not None and rooms.settled(unread)
    rooms.queue.memory = lambda device: 100
    profiled = step(2)
    assert profiled.profile.saves and not rooms.settled(profiled)
    rooms.record = PeakRecord([50, 50])
    rooms.profiling = lm_room().profile
    keeping, bare = step(3), step(4)
    assert keeping.room is rooms.trial.keeping and not rooms.settled(keeping)
    assert bare.room is rooms.trial.bare and not rooms.settled(bare)
    kept = step(5)
    assert rooms.trial is None and kept.room is rooms.room and rooms.settled(kept)
    left = step(6, (8, 16))  # its second save is not the room's
    assert left.room is None and not rooms.settled(left)


def test_a_room_that_keeps_every_save_is_measured_from_its_first_kept_save():
    """Kept saves make no put: a trial step whose room keeps its first save starts the record there."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    rooms.record = record = PeakRecord([10, 10])
    rooms.profiling = Room(Profile(sizes=[8], saves=[10], unpack_sizes=[8], unpacks=[18],
                                   unpack_saves=[0], rises=[0, 0])).profile
    s = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(s)
    assert s.room is rooms.trial.keeping and s.room.kept == 1
    assert rooms.keeps(s, torch.empty(2).untyped_storage(), 8)
    assert record.started == 1  # no record without it: the keeping room never measured


def test_a_profiled_step_without_backward_gives_no_room_and_the_next_step_profiles():
    """A profile's unpacks bound backward: a step abandoned after forward (or two forwards before
    a backward) gives none, so it makes no room; the next full-offload step profiles again, and
    what the abandoned step does later is not the new profile's."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    storage = torch.empty(2).untyped_storage()
    first = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(first)
    assert first.profile is not None
    first.order.append(object())
    rooms.follow_room(first, storage, 8)
    second = Step(2, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(second)
    assert second.room is None and second.profile is not None
    assert first.profile is None  # detached: its backward adds nothing to a profile


def test_a_trial_step_that_leaves_its_room_measures_nothing_and_the_next_tries_the_room_again():
    """A trial step whose first save is not its room's (another kind of step, as two kinds in turn
    make) follows another room: its peak is not the tried room's, so the next step tries it again."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    rooms.record = record = PeakRecord([10])
    other = Room(Profile(sizes=[16, 16], saves=[10, 20]))
    rooms.follow(other)
    rooms.profiling = lm_room().profile
    first = Step(1, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(first)
    assert first.room is rooms.trial.keeping
    first.order.append(object())
    rooms.follow_room(first, torch.empty(2).untyped_storage(), 16)  # not the profile's first size
    first.unpacked = 1
    assert first.room is other and record.started == 0  # the other kind's room; nothing measured
    after = Step(2, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(after)
    assert rooms.trial is not None and not rooms.trial.peaks and after.room is rooms.trial.keeping


def test_a_profile_of_another_kind_made_while_a_trial_runs_starts_its_own_trial_in_its_place():
    """A step of another kind (the shapes changed, or two kinds in turn) profiles while the first
    kind's room is tried: its room, which would keep saves, is tried in its place, and the first
    kind's room keeps what its profile said, untried (a trial's steps are one kind's)."""
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    rooms.record = PeakRecord([10])
    rooms.profiling = lm_room().profile
    rooms.start_step(Step(1, float("inf"), StepOptions(), full_offload=True))
    trial = rooms.trial
    assert trial is not None and trial.keeping.kept == 2
    other = lm_room().profile
    other.sizes = [8, 8, 8, 40, 2]  # its last save of another size: another kind
    rooms.profiling = other
    after = Step(2, float("inf"), StepOptions(), full_offload=True)
    rooms.start_step(after)
    assert rooms.trial is not trial and rooms.trial.keeping.profile is other and after.room is rooms.trial.keeping
    assert rooms._rooms[tuple(lm_room().profile.sizes)].kept == 2


def test_a_room_follows_only_the_saves_it_was_profiled_on():
    r = room()
    assert r.matches(1, 8) and r.matches(4, 8)
    assert not r.matches(2, 16) and not r.matches(5, 8)


def head_heavy_step(ctx_options: dict, n: int = 6, reports: list[str] | None = None,
                    stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A chain of ``n`` saves of one size; returns the input, its gradient and the copy queue's
    limit after each save (and appends the step's report() to ``reports``, its stats to ``stats``)."""
    limits = []
    with storm.offload(mode="embedded", min_bytes=0, **ctx_options) as ctx:
        x = torch.randn(64, 64, requires_grad=True)
        h = x
        for _ in range(n):
            h = h.tanh()
            limits.append(ctx._session.copy_queue.limit(ctx._step))
        loss = h.sum()
    loss.backward()
    if reports is not None:
        reports.append(ctx.report())
    if stats is not None:
        stats.append(ctx.stats)
    return x, x.grad, limits


class RisingRecord:
    """An allocator record (a fake: the CPU has none) where the step allocates ``rises[k]`` bytes
    right after its ``k``-th reading (1 = the first save's) and frees them before the next: after
    the last save, a loss's op; after the one after it, backward's first op."""

    def __init__(self, rises: dict[int, int]):
        self.rises, self.events, self.marks = rises, [], 0

    def start(self, device: torch.device) -> None:
        self.events.clear()
        self.marks = 0

    def mark(self, device: torch.device) -> int:
        self.marks += 1
        address = 1000 + self.marks
        size = allocator_record.RECORD_MARK_BYTES
        self.events += [{"action": "alloc", "addr": address, "size": size, "stream": 0},
                        {"action": "free_requested", "addr": address, "size": size, "stream": 0}]
        rise = self.rises.get(self.marks, 0)
        if rise:
            self.events += [{"action": "alloc", "addr": 1, "size": rise, "stream": 0},
                            {"action": "free_requested", "addr": 1, "size": rise, "stream": 0}]
        return address

    def finish(self, device: torch.device) -> list[dict]:
        return self.events


@pytest.mark.parametrize("rises, floor, kept", [({}, 12, 1), ({7: 15}, 18, 1), ({6: 5}, 16, 0)])
def test_full_offload_profiles_one_step_then_keeps_its_queue_and_window_under_the_floor(monkeypatch, rises,
                                                                                          floor, kept):
    """With the allocator read (a fake one here: the CPU has none), the first step profiles; the
    next follows its room: the queue limit is the floor less what the next save holds, and forward's
    end drains to what backward's first unpack leaves; a step of other saves profiles again. Where
    the allocator's record saw the step rise above a reading, the floor is that rise's top. The
    last save, which backward unpacks first, stays on the device where it fits under the floor
    until then: not where a loss's op rises on top of it before backward begins."""
    session = storm.registry.session_for("embedded", None, None)
    queue, rooms = session.copy_queue, session.rooms
    one = 64 * 64 * 4
    besides = [0, 0, 0, 4 * one, 10 * one, 12 * one]  # a head: the step holds more at its last saves
    at_unpack = 3 * one

    def reader(device: torch.device) -> int:
        step = current[0]
        if step.fetching:  # backward: what is held besides the queue and the window, and those
            return at_unpack - one + queue.nbytes + session.restorer.prefetch.nbytes  # the unpacked save counts
        return besides[min(len(step.order), len(besides)) - 1] + queue.nbytes  # the save just made counts

    current: list[Step] = []
    real_new_step = session.new_step

    def new_step(*args, **kwargs) -> Step:
        current[:] = [real_new_step(*args, **kwargs)]
        return current[0]

    drained: list[int] = []
    made: list[int] = []  # the saves the room followed when each drain came
    real_drain = queue.drain

    def drain(limit: int) -> None:
        drained.append(limit)
        made.append(current[0].made)
        real_drain(limit)

    monkeypatch.setattr(rooms.queue, "memory", reader)
    monkeypatch.setattr(session, "new_step", new_step)
    monkeypatch.setattr(queue, "drain", drain)
    monkeypatch.setattr(rooms, "room", None)
    monkeypatch.setattr(rooms, "profiling", None)
    monkeypatch.setattr(rooms, "record", RisingRecord({k: rise * one for k, rise in rises.items()}))
    held = 64 * one

    reports: list[str] = []
    stats: list = []
    _, _, first = head_heavy_step({"max_held_bytes": held}, reports=reports, stats=stats)
    assert first == [held] * 6  # profiling: the user's limit
    assert reports[-1].splitlines()[-1].startswith("copy queue and prefetch window: this step read its memory")
    assert rooms.room is None and rooms.profiling is not None and len(rooms.profiling.saves) == 6
    assert rooms.profiling.unpack_saves == [5, 4, 3, 2, 1, 0]  # backward unpacks the chain in reverse
    assert storm.Keep.ROOM not in stats[-1].kept

    drained.clear()
    _, _, second = head_heavy_step({"max_held_bytes": held}, reports=reports, stats=stats)
    assert "within the room a profiled step found" in reports[-1].splitlines()[-1], reports[-1]
    assert f"forward's last {kept} saves" in reports[-1].splitlines()[-1]
    assert rooms.room is not None and rooms.room.floor == floor * one and rooms.room.kept == kept
    assert stats[-1].kept.get(storm.Keep.ROOM, 0) == kept and stats[-1].offloaded == 6 - kept
    # forward's end: what the step holds until backward's start, beside the kept save while it
    # waits for its unpack, and what backward's first unpack of an offloaded save leaves beside it
    if kept:
        end = 0  # the kept save holds the floor's last bytes until backward unpacks it
    else:
        end = min(floor * one - (besides[-1] - one + rises.get(6, 0) * one), floor * one - at_unpack + one)
    assert second == [floor * one - b for b in besides[1:]] + [end]
    # the last save drains the queue to the room's limit (a put's own drain, or a kept save's, which
    # has no put), and forward's end again
    assert list(zip(made, drained)).count((6, end)) == 2

    drained.clear()
    _, _, other = head_heavy_step({"max_held_bytes": held}, n=7)  # a seventh save: not the profile's
    assert other[-1] == held  # past the room's saves, the user's limit
    head_heavy_step({"max_held_bytes": held}, n=7, reports=reports)  # the step after it profiles
    assert reports[-1].splitlines()[-1].startswith("copy queue and prefetch window: this step read its memory")


def kind_step(width: int, n: int = 4) -> str:
    """A full-offload step of ``n`` saves of ``width`` x ``width`` floats; the last line of its report."""
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = torch.randn(width, width, requires_grad=True)
        for _ in range(n):
            h = h.tanh()
        loss = h.sum()
    loss.backward()
    return ctx.report().splitlines()[-1]


@pytest.fixture
def fresh_rooms():
    """A new session's rooms, whose memory reads as constant beside the queue and the window."""
    storm.close_all()
    session = storm.registry.session_for("embedded", None, None)
    queue, rooms = session.copy_queue, session.rooms
    rooms.queue.memory = lambda device: queue.nbytes + session.restorer.prefetch.nbytes + MiB
    yield rooms
    storm.close_all()


PROFILES = "copy queue and prefetch window: this step read its memory"
FOLLOWS = "copy queue and prefetch window: within"


def test_steps_of_two_kinds_in_turn_each_follow_their_own_room(fresh_rooms):
    """Two models trained in turn (or batches of two shapes): the first step of each kind profiles,
    from its first save where the room it found is the other's; after that each follows its own."""
    lines = [kind_step(width) for width in (64, 32, 64, 32, 64, 32)]
    assert [line.startswith(PROFILES) for line in lines] == [True, True, False, False, False, False]
    assert all(line.startswith(FOLLOWS) for line in lines[2:])
    assert fresh_rooms.room is not None and fresh_rooms.room.profile.sizes == [32 * 32 * 4] * 4


def trunk_step(head: str, width: int = 64) -> Step:
    """A full-offload step whose first save is alike in every kind (a shared trunk), then ``head``'s
    saves: "a" of the trunk's size, "b" four times larger, "c" a's and two more four times larger
    (as a second forward before one backward); the step, once its backward has run."""
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = torch.randn(width, width, requires_grad=True).tanh()
        if head == "b":
            h = h.repeat(2, 2)
        for _ in range(3):
            h = h.sigmoid() if head == "b" else h.tanh()
        if head == "c":
            h = h.repeat(2, 2).sigmoid().sigmoid()
        loss = h.sum()
    loss.backward()
    return ctx._step


def test_steps_of_two_kinds_alike_in_their_first_saves_each_get_their_own_room_in_turn(fresh_rooms):
    """Two heads on one trunk, trained in turn: the second kind leaves the first's room after its
    first save, and the next step, of the first kind, would profile again and again. Steps that
    begin as it did profile until one of its kind has (a profile of a known kind changes nothing),
    and from then on each kind follows its own room, a step of either changing to its own as its
    saves part from the other's: it is settled only from the next step on."""
    steps = [trunk_step("ab"[i % 2]) for i in range(10)]
    rooms = fresh_rooms
    a, b = (tuple(steps[i].order[j].nbytes for j in range(4)) for i in (0, 1))
    assert set(rooms._rooms) == {a, b} and not rooms._unknown
    assert rooms._profiled == 3  # a, a again (the step after b's first), then b
    for i, step in enumerate(steps[-4:]):
        assert step.profile is None and tuple(step.room.profile.sizes) == (a, b)[i % 2]
        assert step.changed_room and not rooms.settled(step)  # it began in the other kind's room
    steps = [trunk_step("a") for _ in range(2)]  # one kind from now on: the first begins in b's room
    assert steps[0].changed_room and not rooms.settled(steps[0])
    assert not steps[1].changed_room and tuple(steps[1].room.profile.sizes) == a and rooms.settled(steps[1])


def test_a_kind_alike_in_its_first_saves_that_comes_once_is_given_up_after_a_few_profiles(fresh_rooms):
    """A step of another head comes once: steps that begin as it did profile KIND_TRIES times at
    most, then follow their room as before, and the kind is not looked for again."""
    trunk_step("a")
    trunk_step("b")
    for _ in range(KIND_TRIES + 4):
        trunk_step("a")
    assert fresh_rooms._profiled == 1 + KIND_TRIES and not fresh_rooms._unknown and fresh_rooms._given_up
    trunk_step("b")
    assert not fresh_rooms._unknown  # given up: its steps go on without a room
    assert trunk_step("a").profile is None


def test_a_kind_that_goes_on_past_another_gets_its_room_in_turn_and_each_changes_to_its_own(fresh_rooms):
    """One kind's saves and more (a second forward before one backward), in turn with the first:
    it parts from the first's room past the saves that room kept, and a step of the first kind
    begun in the longer room reaches backward on fewer saves. Each changes to its own room, so the
    process stops profiling; the first kind keeps none of its last saves, which the other goes on
    past."""
    steps = [trunk_step("ac"[i % 2]) for i in range(12)]
    a = tuple(s.nbytes for s in steps[0].order)
    assert sorted(fresh_rooms._rooms) == [a, a + (4 * a[0],) * 2]
    assert fresh_rooms._profiled == 3 and not fresh_rooms._profile_next
    for i, step in enumerate(steps[-4:]):
        assert step.profile is None and step.changed_room and len(step.room.profile.sizes) == (4, 6)[i % 2]
    assert not any(step.kept_by_room for step in steps[-4::2])  # a's room keeps none: c goes on past them


def test_a_kind_left_unknown_holds_back_only_the_steps_that_begin_as_it_did(fresh_rooms):
    """A kind seen once, whose first save nothing begins with any more (the shapes changed): the
    steps of the new shapes follow their room and settle."""
    for head in "aaaab":
        trunk_step(head)
    steps = [trunk_step("a", width=32) for _ in range(6)]
    assert fresh_rooms._unknown  # b's kind, never seen again
    assert fresh_rooms.settled(steps[-1]) and steps[-1].room is fresh_rooms.room


def two_forward_step(width: int = 64) -> tuple[str, bool]:
    """A full-offload step of two forwards before one backward (Offload.resume(), as storm.enable
    makes of chosen and rejected sequences): the last line of its report, and whether it ran as
    the steps after it will (Offload.room_settled)."""
    x = torch.randn(width, width, requires_grad=True)
    ctx = storm.offload(mode="embedded", min_bytes=0)
    with ctx:
        a = x.tanh().tanh()
    with ctx.resume():
        b = x.sigmoid().sigmoid()
    (a.sum() + b.sum()).backward()
    return ctx.report().splitlines()[-1], ctx.room_settled


def test_steps_of_two_forwards_follow_their_room_and_a_step_of_fewer_saves_lets_it_go_at_backward(fresh_rooms):
    """Each forward's end comes at the context's exit, but a step resumed for another forward goes
    on: its room holds until backward begins, which finds all of the room's saves made. A step
    that begins backward with fewer saves than its room's lets it go, and the next one profiles."""
    lines = [two_forward_step() for _ in range(4)]
    assert [line.startswith(PROFILES) for line, _ in lines] == [True, False, False, False]
    assert all(line.startswith(FOLLOWS) for line, _ in lines[1:]) and lines[-1][1]
    assert fresh_rooms._profiled == 1  # one profile gave the room every later step follows
    x = torch.randn(64, 64, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:  # the first forward's saves alone
        a = x.tanh().tanh()
    assert ctx.report().splitlines()[-1].startswith(FOLLOWS)  # its forward's end lets no room go
    a.sum().backward()
    assert not ctx.report().splitlines()[-1].startswith(FOLLOWS) and not ctx.room_settled
    assert two_forward_step()[0].startswith(PROFILES)


def test_a_profiled_unpack_of_a_save_the_store_refused_counts_it_once():
    """A save the store refused stays with the step (State.KEPT), out of the copy queue: the
    allocator counts it already, and the unpack's reading does not add it again."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from storm.saved import State, Stored

    rooms = Rooms(CopyQueue(lambda: None, threading.RLock()))
    t = torch.empty(400, dtype=torch.uint8)
    rooms.queue.memory = lambda device: 1000 + t.untyped_storage().nbytes()
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    step.profile = Profile(sizes=[400], saves=[1400])
    stored = Stored(1, step, t, StorageWeakRef(t.untyped_storage()), 400)
    stored.state = State.KEPT
    rooms.unpacked(stored, prefetched=0)
    assert step.profile.unpacks == [1400]


def test_a_process_profiles_a_bounded_number_of_kinds_of_step(fresh_rooms, monkeypatch, caplog):
    """Each profiled step runs under the allocator's record: steps whose saves never come in the same
    sizes again would profile every other step. Past MAX_PROFILES a new kind keeps the user's
    limits, said once; the kinds profiled before still follow their rooms."""
    import logging

    from storm import rooms
    monkeypatch.setattr(rooms, "MAX_PROFILES", 2)
    with caplog.at_level(logging.INFO, logger="storm"):
        lines = [kind_step(width) for width in (64, 32, 16, 16, 64, 16)]
    assert [line.startswith(PROFILES) for line in lines] == [True, True, False, False, False, False]
    assert [line.startswith(FOLLOWS) for line in lines] == [False, False, False, False, True, False]
    assert sum("kinds of step profiled" in r.getMessage() for r in caplog.records) == 1


def test_profiles_that_gave_no_room_count_towards_the_bound_too(monkeypatch):
    """A step whose backward comes after the next step's forward (a model split by graph breaks:
    each compiled graph's saves are a step) has no unpacks when the next step begins, so its
    profile gives no room; it ran under the allocator's record all the same, and counts towards
    MAX_PROFILES, so such steps stop profiling."""
    from storm import rooms as rooms_mod
    monkeypatch.setattr(rooms_mod, "MAX_PROFILES", 2)
    rooms = Rooms(CopyQueue(lambda: None, threading.Lock()))
    rooms.queue.memory = lambda device: 100
    storage = torch.empty(2).untyped_storage()
    profiled = []
    for number in range(6):
        s = Step(number, float("inf"), StepOptions(), full_offload=True)
        rooms.start_step(s)
        profiled.append(s.profile is not None)
        s.order.append(object())
        rooms.follow_room(s, storage, 8 * (number % 3 + 1))  # each graph's saves of their own size
    assert profiled == [True, True, False, False, False, False] and rooms.room is None


def test_a_full_offload_step_with_a_room_computes_the_same_gradients(monkeypatch):
    """The room changes when copies are waited for, never what is saved or restored."""
    session = storm.registry.session_for("embedded", None, None)
    queue, rooms = session.copy_queue, session.rooms
    monkeypatch.setattr(rooms.queue, "memory", lambda device: queue.nbytes + session.restorer.prefetch.nbytes + MiB)
    monkeypatch.setattr(rooms, "room", None)
    monkeypatch.setattr(rooms, "profiling", None)
    grads = []
    for _ in range(3):
        torch.manual_seed(0)
        x, grad, _ = head_heavy_step({})
        grads.append(grad)
    assert rooms.room is not None
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    h = x
    for _ in range(6):
        h = h.tanh()
    h.sum().backward()
    assert all(same_bits(g, x.grad) for g in grads)


def test_a_profiled_unpack_of_a_storage_brought_back_already_is_read_as_held(monkeypatch):
    """A storage two saves share (a * a) is fetched at its first unpack and still alive at its second:
    the profile's reading there must not count it on top of what the allocator holds."""
    session = storm.registry.session_for("embedded", None, None)
    rooms = session.rooms
    seen: list[bool] = []
    real_unpacked = rooms.unpacked

    def unpacked(stored, prefetched: int, restored: bool = False) -> None:
        seen.append(restored)
        real_unpacked(stored, prefetched, restored)

    monkeypatch.setattr(rooms, "unpacked", unpacked)
    x = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        a = x.tanh()
        b = (a * a).sum()
    session.synchronize()  # the copy is in: backward fetches the storage back
    session.poll()
    b.backward()
    assert ctx.stats.offloaded == 1 and ctx.stats.deduplicated == 2  # tanh's output, saved by tanh and twice by mul
    assert seen == [False, True, True], seen  # fetched by mul's first unpack, alive at its second and at tanh's


def framed_saves(sizes_and_frames: list[tuple[int, int]], own: list[int]) -> tuple[Rooms, CopyQueue, Step]:
    """A profiling step's saves of these sizes, each put into a frame of its size (0: none), with
    ``own[i]`` held besides the queue as save i is made (the save counted). The memory reader is the
    caching allocator's count: the step's own, and the queue's saves, not their frames, which leave
    the count as their puts return."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from storm.saved import Stored
    queue = CopyQueue(lambda: None, threading.RLock())
    rooms = Rooms(queue)
    now = {"own": 0}
    rooms.queue.memory = lambda device: now["own"] + sum(s.nbytes for s, *_ in queue._saves)
    step = Step(1, float("inf"), StepOptions(max_held_bytes=1 << 40), full_offload=True)
    rooms.start_step(step)
    for (nbytes, frame), held in zip(sizes_and_frames, own):
        t = torch.empty(nbytes, dtype=torch.uint8)
        stored = Stored(len(step.order) + 1, step, t, StorageWeakRef(t.untyped_storage()), nbytes)
        step.order.append(stored)
        now["own"] = held
        rooms.follow_room(step, t.untyped_storage(), nbytes)
        now["own"] = held - nbytes  # from here on the queue holds the save
        stored.copy_in = Put()
        queue.add(stored, step, frame)
    return rooms, queue, step


def test_a_profile_reads_the_step_own_memory_while_framed_saves_wait_for_their_copy():
    """The queue takes each save and its frame, but the allocator's count has only the save: a
    reading that took the frames off too read the step's memory low by them, and its room let the
    queue and the window fill the step's real peak."""
    rooms, queue, step = framed_saves([(400, 200), (1000, 880), (64, 0)], own=[400, 2500, 1564])
    assert step.profile is not None and step.profile.saves == [400, 2500, 1564]
    assert queue.nbytes == 1464 + 1080  # the queue takes the frames


def test_a_frame_is_made_only_where_it_fits_under_the_floor_beside_the_step_and_the_queue():
    """The put of a framed save makes its frame while the save is still on the device: at forward's
    end, beside a loss's tensors, a frame as large as the save is the step's peak."""
    room = Room(Profile(sizes=[100, 1000], saves=[500, 2500], unpack_sizes=[1000, 100], unpacks=[3000, 600]))
    queue = CopyQueue(lambda: None, threading.RLock())
    rooms = Rooms(queue)
    step = Step(1, float("inf"), StepOptions(), full_offload=True)
    step.room = room
    step.order = [object(), object()]  # the step has made its second save, the loss's
    assert room.floor == 3000
    assert rooms.frame_fits(step, 500) and not rooms.frame_fits(step, 501)
    assert rooms.frame_fits(step, 0)
    step.order = [object()]  # at the first save, beside 500 held: 2500 fit
    assert rooms.frame_fits(step, 2500) and not rooms.frame_fits(step, 2501)
    t = torch.empty(0, dtype=torch.uint8)
    from torch.multiprocessing.reductions import StorageWeakRef

    from storm.saved import Stored
    queue.add(Stored(9, step, t, StorageWeakRef(t.untyped_storage()), 600), step, 400)  # a save and its frame wait
    assert rooms.frame_fits(step, 1500) and not rooms.frame_fits(step, 1501)
    step.room = None  # no room: nothing says where the floor is
    assert rooms.frame_fits(step, 1 << 40)


@pytest.mark.parametrize("refetch", [False, True])
def test_a_storage_the_room_fetches_again_comes_back_at_each_unpack_with_the_same_gradients(monkeypatch, refetch):
    """tanh's output is saved by tanh, by the first sin and by the last mul: held from the mul's
    unpack to tanh's it is fetched once; where the room says to fetch it again (Room.refetches), it
    is let go of between its unpacks and comes back for each op that needs it after a gap, and the
    gradients are the same bits."""
    session = storm.registry.session_for("embedded", None, None)
    queue, rooms = session.copy_queue, session.rooms
    monkeypatch.setattr(rooms.queue, "memory", lambda device: queue.nbytes + session.restorer.prefetch.nbytes + MiB)
    monkeypatch.setattr(rooms, "room", None)
    monkeypatch.setattr(rooms, "profiling", None)
    monkeypatch.setattr(Room, "refetches", lambda self, index: refetch)

    def step() -> tuple[torch.Tensor, object]:
        torch.manual_seed(0)
        x = torch.randn(64, 64, requires_grad=True)
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            a = x.tanh()
            h = a
            for _ in range(4):
                h = h.sin()
            loss = (h * a).sum()
        session.synchronize()
        session.poll()  # every copy in: backward fetches each storage from the store
        loss.backward()
        return x.grad, ctx.stats

    def plain() -> torch.Tensor:
        torch.manual_seed(0)
        x = torch.randn(64, 64, requires_grad=True)
        a = x.tanh()
        h = a
        for _ in range(4):
            h = h.sin()
        (h * a).sum().backward()
        return x.grad

    plain()  # a process's first tanh on the CPU, STORM's threads alive, was seen to differ in its last bits
    results = [step() for _ in range(3)]
    want = plain()
    assert rooms.room is not None  # the steps after the first followed a room
    assert all(same_bits(grad, want) for grad, _ in results)
    saves_of_a = 3  # tanh's output, the first sin's input, the mul's other operand
    fetched = results[-1][1].fetched
    assert fetched == (results[-1][1].offloaded + (saves_of_a - 1 if refetch else 0)), (fetched, results[-1][1])


def test_a_profiled_unpack_says_which_block_its_reading_counted_once_the_storage_is_on_the_device(monkeypatch):
    """Each unpack's reading counts the storage it unpacks: its block's address goes with the
    reading's mark (Profile.fetched), fetched now or alive since an earlier unpack, so that the
    record's replay counts that block's free; a save's reading counts none."""
    session = storm.registry.session_for("embedded", None, None)
    queue, rooms = session.copy_queue, session.rooms
    monkeypatch.setattr(rooms.queue, "memory", lambda device: queue.nbytes + session.restorer.prefetch.nbytes + MiB)
    monkeypatch.setattr(rooms, "room", None)
    monkeypatch.setattr(rooms, "profiling", None)
    monkeypatch.setattr(rooms, "record", RisingRecord({}))
    x = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0):
        a = x.tanh()
        b = (a * a).sin().sum()
    session.synchronize()
    session.poll()
    profile = rooms.profiling
    b.backward()
    assert profile is not None and len(profile.marks) == len(profile.saves) + len(profile.unpacks) == 2 + 4
    saves, unpacks = profile.fetched[:2], profile.fetched[2:]
    assert saves == [[], []]
    assert all(len(addresses) == 1 for addresses in unpacks), unpacks
    assert profile.unpack_saves == [1, 0, 0, 0]  # sin's input, then tanh's output: by mul twice, by tanh
    assert unpacks[1] == unpacks[2] == unpacks[3]  # one block, fetched at mul's first unpack
    assert not profile.landing
