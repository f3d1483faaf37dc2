"""Full offload's room (storm/room.py): the copy queue and the prefetch window fill only what fits
under the floor a profiled step found, so that neither sits on the step's peak."""

from __future__ import annotations

import pytest
import torch

import storm
from storm import allocator_record
from storm.examples.models import same_bits
from storm.room import Profile, Room
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
    step = Step(1, float("inf"), StepOptions(prefetch_bytes=100))
    assert step.window() == 100
    step.room, step.unpacked = r, 2
    assert step.window() == 16


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

    mark = allocator_record.MARK_BYTES

    def ev(action: str, addr: int, size: int = mark, stream: int = own) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [ev("alloc", 1, 100), ev("alloc", 500, 512), ev("free_requested", 500, 512),  # not a mark: its size
              ev("alloc", 500), ev("free_requested", 500),  # mark 500
              ev("alloc", 2, 40), ev("alloc", 3, 1000, copy), ev("alloc", 4, 30), ev("free_requested", 2, 40),
              ev("alloc", 6, 500, copy), ev("free_requested", 6, 500, copy),  # a frame: the copies' own
              ev("alloc", 500), ev("free_requested", 500),  # mark 500 again
              ev("free_requested", 3, 1000, copy), ev("alloc", 7, 50), ev("free_requested", 1, 100),
              ev("alloc", 5, 20), ev("free_completed", 4, 30)]
    assert allocator_record.rises(events, [500, 500]) == [70, 50]  # 40 + 30 before a free; then 50
    assert allocator_record.rises(events, [500, 600]) is None  # a mark the record lost
    assert allocator_record.rises(events, []) == []


def test_a_room_follows_only_the_saves_it_was_profiled_on():
    r = room()
    assert r.matches(1, 8) and r.matches(4, 8)
    assert not r.matches(2, 16) and not r.matches(5, 8)


def head_heavy_step(ctx_options: dict, n: int = 6, reports: list[str] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A chain of ``n`` saves of one size; returns the input, its gradient and the copy queue's
    limit after each save (and appends the step's report() to ``reports``)."""
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
    return x, x.grad, limits


class RisingRecord:
    """An allocator record (a fake: the CPU has none) where backward's first op, right after its
    unpack, allocates ``rise`` bytes and frees them before the next unpack."""

    def __init__(self, saves: int, rise: int):
        self.saves, self.rise, self.events, self.marks = saves, rise, [], 0

    def start(self, device: torch.device) -> None:
        self.events.clear()
        self.marks = 0

    def mark(self, device: torch.device) -> int:
        self.marks += 1
        address = 1000 + self.marks
        size = allocator_record.MARK_BYTES
        self.events += [{"action": "alloc", "addr": address, "size": size, "stream": 0},
                        {"action": "free_requested", "addr": address, "size": size, "stream": 0}]
        if self.marks == self.saves + 1:
            self.events += [{"action": "alloc", "addr": 1, "size": self.rise, "stream": 0},
                            {"action": "free_requested", "addr": 1, "size": self.rise, "stream": 0}]
        return address

    def finish(self, device: torch.device) -> list[dict]:
        return self.events


@pytest.mark.parametrize("rise", [0, 15])
def test_full_offload_profiles_one_step_then_keeps_its_queue_and_window_under_the_floor(monkeypatch, rise):
    """With the allocator read (a fake one here: the CPU has none), the first step profiles; the
    next follows its room: the queue limit is the floor less what the next save holds, and forward's
    end drains to what backward's first unpack leaves; a step of other saves profiles again. Where
    the allocator's record saw backward's first op rise above its unpack's reading, the floor is
    that rise's top."""
    session = storm.session_for("embedded", None, None)
    queue = session.copy_queue
    one = 64 * 64 * 4
    besides = [0, 0, 0, 4 * one, 10 * one, 12 * one]  # a head: the step holds more at its last saves
    at_unpack = 3 * one

    def reader(device: torch.device) -> int:
        step = current[0]
        if step.fetching:  # backward: what is held besides the queue and the window, and those
            return at_unpack - one + queue.nbytes + session.prefetch.nbytes  # the unpacked save counts
        return besides[len(step.order) - 1] + queue.nbytes  # the save just made counts as held besides

    current: list[Step] = []
    real_new_step = session.new_step

    def new_step(*args, **kwargs) -> Step:
        current[:] = [real_new_step(*args, **kwargs)]
        return current[0]

    drained: list[int] = []
    real_drain = queue.drain

    def drain(limit: int) -> None:
        drained.append(limit)
        real_drain(limit)

    monkeypatch.setattr(queue, "memory", reader)
    monkeypatch.setattr(session, "new_step", new_step)
    monkeypatch.setattr(queue, "drain", drain)
    monkeypatch.setattr(queue, "room", None)
    monkeypatch.setattr(queue, "profiling", None)
    if rise:
        monkeypatch.setattr(queue, "record", RisingRecord(6, rise * one))
    held = 64 * one

    reports: list[str] = []
    _, _, first = head_heavy_step({"max_held_bytes": held}, reports=reports)
    assert first == [held] * 6  # profiling: the user's limit
    assert reports[-1].splitlines()[-1].startswith("copy queue and prefetch window: this step read its memory")
    assert queue.room is None and queue.profiling is not None and len(queue.profiling.saves) == 6

    drained.clear()
    _, _, second = head_heavy_step({"max_held_bytes": held}, reports=reports)
    assert "within the room a profiled step found" in reports[-1].splitlines()[-1], reports[-1]
    floor = max(12, 3 + rise) * one
    assert queue.room is not None and queue.room.floor == floor
    # forward's end: what the step holds until backward's start (the last save waiting in the queue by
    # then) and what backward's first unpack leaves beside that save, which it unpacks first
    end = min(floor - (besides[-1] - one), floor - at_unpack + one)
    assert end == (one if not rise else 7 * one)
    assert second == [floor - b for b in besides[1:]] + [end]
    assert drained[-1] == end

    drained.clear()
    _, _, other = head_heavy_step({"max_held_bytes": held}, n=7)  # a seventh save: not the profile's
    assert other[-1] == held and queue.room is None


def test_a_full_offload_step_with_a_room_computes_the_same_gradients(monkeypatch):
    """The room changes when copies are waited for, never what is saved or restored."""
    session = storm.session_for("embedded", None, None)
    queue = session.copy_queue
    monkeypatch.setattr(queue, "memory", lambda device: queue.nbytes + session.prefetch.nbytes + MiB)
    monkeypatch.setattr(queue, "room", None)
    monkeypatch.setattr(queue, "profiling", None)
    grads = []
    for _ in range(3):
        torch.manual_seed(0)
        x, grad, _ = head_heavy_step({})
        grads.append(grad)
    assert queue.room is not None
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    h = x
    for _ in range(6):
        h = h.tanh()
    h.sum().backward()
    assert all(same_bits(g, x.grad) for g in grads)

