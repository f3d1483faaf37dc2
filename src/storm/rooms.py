"""Full offload's rooms: which room (room.py) each step follows, the profiled steps that make
them, and the trial of a room that keeps saves.

A full-offload step takes its copy queue's and prefetch window's limits from room.py: one step
profiles what the allocator holds besides the copy queue (and, in backward, besides the prefetch
window), and the steps after it, while their saves come in the profile's sizes, follow the Room
it gives; that Room paces the step's prefetch window too (Step.window). Steps of several kinds
(two models trained in turn, batches of a few shapes) each follow their own: a room is kept per
profile (the last MAX_ROOMS followed), and a step whose first save matches none of them profiles
from there. Kinds alike in their first saves (two heads on one trunk) part later: a step goes on
in the room that began as its saves did, and where none did, the steps that begin so profile
until one of its kind has (KIND_TRIES at most). Each profiled step runs under the allocator's
record, so a process profiles at most MAX_PROFILES steps that read the allocator, whether they
gave a room or not (a step whose backward comes after the next step's forward gives none); past
them, steps of a new kind keep the user's limits.

A room that keeps forward's last saves on the device says they fit under the floor; the room is
a model of the step, and a model can be wrong on a model it was never tried on (T5's kept saves
raised its peak on the lent H200, for a reason not yet found). So it is tried (``Trial``): the
step after the profile follows it, the next one follows the same profile keeping none, each
under the allocator's record from its first save, and the steps after them follow the one whose
step peaked lower (the keeping one where they are even). A trial step that made no save, never
unpacked one (an evaluation's forward, a step abandoned before backward) or went on in another
room (a step of another kind: two kinds in turn) is no measure of the room: the next step tries
the same room, up to MAX_TRIAL_STEPS steps. Where no peak could be read (no record, or too many
such steps), the room's own choice holds.
A profile is made only of a step whose backward ran: a profile without unpacks gives no room.

The session (storm/session.py, and restore.py for ``unpacked``) calls ``follow_room``, ``keeps``,
``unpacked`` and ``start_step`` under its lock (threads that run forwards at once share it), and
``close`` as it closes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import allocator_record
from .allocator_record import AllocatorRecord, Record, replay
from .copy_queue import CopyQueue
from .room import Profile, Room
from .saved import State, Step, Stored

MAX_ROOMS = 8  # rooms kept, one per kind of step, the least recently followed dropped first
MAX_PROFILES = 32  # profiled steps that read the allocator, each under its record, a room made or not
MAX_TRIAL_STEPS = 8  # steps a trial runs, each under the allocator's record, before it gives up
# steps profiled for a kind of step that left a room past its first save, before that kind is given up:
# steps that begin alike are told apart only later, so a profile may land on the other kind; two kinds
# in turn are told apart at the second, and a step of one more save, once, costs no more than two
KIND_TRIES = 2

log = logging.getLogger("storm")


@dataclasses.dataclass
class Trial:
    """A room that keeps saves (``keeping``) against the same profile keeping none (``bare``): one
    step follows each, in that order, and ``peaks`` are theirs (None: not read)."""

    keeping: Room
    bare: Room
    peaks: list[int | None] = dataclasses.field(default_factory=list)
    steps: int = 0  # steps that tried a room, measured or not

    def next(self) -> Room | None:
        """The room the next step tries, or None once the trial is over (``choice``)."""
        if None in self.peaks or len(self.peaks) == 2:
            return None
        return self.bare if self.peaks else self.keeping

    def choice(self) -> Room:
        """The room whose step peaked lower, the keeping one where even or not read."""
        kept, bare = (self.peaks + [None, None])[:2]
        return self.bare if kept is not None and bare is not None and kept > bare else self.keeping


@dataclasses.dataclass
class Measure:
    """A trial step's peak being read: the step, the room it tries, and at its first save the
    device, what the allocator held and the mark left in its record."""

    step: Step
    room: Room
    device: torch.device | None = None
    start: int = 0
    mark: int | None = None


class Rooms:
    """The rooms of one session's full-offload steps; ``queue``: its copy queue, whose bytes a
    reading leaves out."""

    def __init__(self, queue: CopyQueue):
        self.queue = queue
        # the room a step follows now (room.py), the others that profiled steps found, the least
        # recently followed first, and the step profiling now
        self.room: Room | None = None
        self._rooms: collections.OrderedDict[tuple[int, ...], Room] = collections.OrderedDict()
        self._profiled = 0  # profiles that read the allocator
        self._profile_next = False  # a step left its room at backward, none known for it: the next profiles
        # kinds of step known by their first saves alone (a step left its room past its first save and no
        # room begins as it did), each with the profiles started for it: steps that begin as it did
        # profile until one gives its room (resolved) or KIND_TRIES were started
        self._unknown: dict[tuple[int, ...], int] = {}
        self._given_up: set[tuple[int, ...]] = set()  # such kinds profiled KIND_TRIES times in vain
        self._probing = False  # the step profiling now does so for such a kind (_profile_kind)
        self.profiling: Profile | None = None
        # the step whose saves and unpacks ``profiling`` reads (weak: a finished step is freed at once)
        self._profiled_step: weakref.ref[Step] | None = None
        self.trial: Trial | None = None  # a room that keeps saves, tried against keeping none
        self._measure: Measure | None = None  # the trial step being measured
        self.record: Record = AllocatorRecord()  # the allocator's history while a step profiles

    def start_step(self, step: Step) -> None:
        """A full-offload step follows the room it followed last (one a profiled step found); with
        none yet, it is the one profiled (the step after a profile with saves makes its room)."""
        if self.profiling is not None and not self.profiling.rises:  # read once: past budget steps it waits
            self._read_record(self.profiling)
        profiled = self._profiled_step() if self._profiled_step is not None else None
        if profiled is not None:  # what it does from now on is not the profile's
            profiled.profile = None
        self._profiled_step = None
        if self._measure is not None:
            self._read_peak(self._measure)
        if not step.full_offload:
            return
        if self.profiling is not None and self.profiling.saves:
            # it read the allocator under its record: counted, room or not (steps whose backward
            # comes after the next one's forward, as a model split by graph breaks makes, give none)
            self._profiled += 1
            sizes = tuple(self.profiling.sizes)
            if self.profiling.unpacks and not (self._probing and sizes in self._rooms):
                # (a step profiled for an unknown kind that was of a known one: its room, and its trial, stand)
                room = Room(self.profiling)
                self._unknown = {k: n for k, n in self._unknown.items() if sizes[:len(k)] != k}
                self._given_up = {k for k in self._given_up if sizes[:len(k)] != k}  # its last try found it
                self.trial = Trial(room, Room(room.profile, keep=False)) if room.kept else None
                if self.trial is None:
                    self.follow(room)
        self.profiling, self._probing = None, False
        if self.trial is not None:
            self._try(step, self.trial)
        if (self.room is None or self._profile_next) and self._profile(step):
            self.room = self._measure = None
        step.room = self.room

    def _try(self, step: Step, trial: Trial) -> None:
        """``step`` follows the trial's next room, its peak measured from its first save; once both
        are measured, the steps follow the one that peaked lower."""
        room = trial.next()
        if room is not None:
            self.follow(room)
            self._measure = Measure(step, room)
            return
        chosen = trial.choice()
        kept, bare = (trial.peaks + [None, None])[:2]
        if chosen is trial.bare and kept is not None and bare is not None:
            mib = 1 << 20
            log.info("full offload: keeping forward's last %d saves on the device peaked at %.1f MiB, keeping "
                     "none at %.1f MiB: the steps keep none", trial.keeping.kept, kept / mib, bare / mib)
        self.follow(chosen)
        self.trial = None

    def _read_peak(self, measure: Measure) -> None:
        """A trial step has ended: its peak, where its record has it and it followed the room it
        tried; a step that made no save, unpacked none of those it offloaded or went on in another
        room measured nothing of the room, and the next step tries it again (up to MAX_TRIAL_STEPS)."""
        self._measure = None
        peak = None
        if measure.device is not None and measure.mark is not None:
            events = self.record.finish(measure.device)
            high = allocator_record.peak(events, measure.mark) if events is not None else None
            if high is not None and measure.step.room is measure.room:
                peak = measure.start + high
        trial, step = self.trial, measure.step
        if trial is None:
            return
        trial.steps += 1
        # a room keeping all: backward unseen. A compiled graph's step follows the profile keeping none
        ran = (step.made > 0 and (step.unpacked > 0 or not step.order) and step.room is not None
               and step.room.profile is measure.room.profile)
        if ran or trial.steps >= MAX_TRIAL_STEPS:
            trial.peaks.append(peak if ran else None)

    def settled(self, step: Step) -> bool:
        """Whether ``step``, ended, ran as the full-offload steps after it will, so that its peak is
        theirs: it followed to its end the room the steps follow, with no trial of rooms pending,
        or no room can be made for it (its profile read nothing, as off CUDA, or this process has
        profiled its share). Not a step that profiled, tried a room, or left its room part-way."""
        if self.trial is not None or self._profile_next or any(k[0] == step.first_size for k in self._unknown):
            return False
        if step.profile is not None:
            return not step.profile.saves
        return step.room is None or step.room is self.room and not step.changed_room

    def follow(self, room: Room) -> None:
        """Steps follow ``room`` from now (a profiled step's), kept with the others as the most
        recently followed."""
        key = tuple(room.profile.sizes)
        self._rooms[key] = self.room = room
        self._rooms.move_to_end(key)
        while len(self._rooms) > MAX_ROOMS:
            self._rooms.popitem(last=False)

    def _profile(self, step: Step) -> bool:
        """Whether ``step`` profiles from its next save: unless this process has profiled its share."""
        self._profile_next = False
        if self._profiled >= MAX_PROFILES:
            if self._profiled == MAX_PROFILES:
                self._profiled += 1  # said once
                log.info("full offload: %d kinds of step profiled, and their saves' sizes still change; steps "
                         "of a new kind keep max_held_bytes and prefetch_bytes as given", MAX_PROFILES)
            return False
        step.profile = self.profiling = Profile()
        self._profiled_step = weakref.ref(step)
        return True

    def _leave(self, step: Step, nbytes: int) -> None:
        """A step's save of ``nbytes`` is not its room's (or the step has none): it follows another
        room whose first saves are the step's so far; else, at its first save, it profiles from
        there, and past it goes on without a room, its kind known by its saves so far
        (``_unknown``: the steps that begin so profile, ``_profile_kind``). Saves its room kept
        stay kept: a step that changed rooms past its first save is not settled."""
        left, step.room = step.room, None
        made = step.made
        sizes = (left.profile.sizes[:made - 1] if left is not None else []) + [nbytes]
        for room in reversed(self._rooms.values()):
            if room.profile.sizes[:made] == sizes:
                self.follow(room)
                step.room, step.changed_room = room, made > 1
                return
        if made == 1:
            self._profile(step)
            return
        kind = tuple(sizes)
        if kind in self._given_up or self._profiled >= MAX_PROFILES:  # its steps go on without a room
            return
        self._unknown.setdefault(kind, 0)
        while len(self._unknown) > MAX_ROOMS:
            del self._unknown[next(iter(self._unknown))]

    def _profile_kind(self, step: Step, nbytes: int) -> None:
        """At a step's first save, of ``nbytes``, while it follows a room: where a kind of step not
        yet profiled begins with a save of that size, the step profiles from here instead; it may
        be of that kind (a trial running measures nothing of it, and tries its room again; a
        profile of another kind, which would keep saves, starts its own trial in its place)."""
        kind = next((k for k in self._unknown if k[0] == nbytes), None)
        if kind is None:
            return
        self._unknown[kind] += 1
        if self._unknown[kind] >= KIND_TRIES:  # its steps are rare, or always after another kind's
            del self._unknown[kind]
            self._given_up.add(kind)  # bounded: added while the process may profile, and each try profiles
        if self._profile(step):
            step.room, self._probing = None, True

    def keeps(self, step: Step, storage: torch.UntypedStorage, nbytes: int, compiled: bool = False) -> bool:
        """Whether a full-offload step's save of ``storage`` (``nbytes``) stays on the device: its
        room keeps forward's last saves, and every save of a storage it kept (a kept storage is the
        step's from then on, counted in ``Step.made``). A compiled graph's
        save never does (``compiled``): the graph reuses its memory once it lets go of it, so a
        kept save would be a copy beside what the profile measured; its step follows a room that
        keeps none."""
        if step.room is None:
            return False
        if compiled:
            if step.room.kept:
                self.follow(Room(step.room.profile, keep=False))
                step.room = self.room
            return False
        kept = step.kept_by_room.get(storage._cdata)
        if kept is not None and not kept.expired():
            return True
        if not step.room.keeps(step.made + 1, nbytes) or self._goes_on(step.room, step.made + 1):
            return False
        if step.made == 0:  # a room that keeps every save: its trial is measured from its first
            self._measure_from(step, storage)
        step.kept_by_room[storage._cdata] = StorageWeakRef(storage)
        step.room_kept += 1
        return True

    def _measure_from(self, step: Step, storage: torch.UntypedStorage) -> None:
        """``step`` makes its first save (offloaded or kept): where it is a trial step on the room it
        tries, the allocator's record runs from here with a mark, and what is held now."""
        measure = self._measure
        if measure is not None and measure.step is step and step.room is measure.room:
            held = self.queue.memory(storage.device)
            if held is not None:
                self.record.start(storage.device)
                measure.device, measure.start, measure.mark = storage.device, held, self.record.mark(storage.device)

    def _goes_on(self, room: Room, made: int) -> bool:
        """Whether another kind of step makes the first ``made`` saves of ``room``'s and more (two
        forwards before a backward, after steps of one): a step following ``room`` may be one of
        those, whose saves after these would sit beside the ones kept."""
        n, sizes = len(room.profile.sizes), room.profile.sizes[:made]
        return any(len(other.profile.sizes) > n and other.profile.sizes[:made] == sizes
                   for other in self._rooms.values())

    def follow_room(self, step: Step, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A full-offload step's save of ``nbytes`` was just made, before its put: where a room leads
        the step, the save must be the profile's (else ``_leave``: another room, or a profile); where
        the step profiles, read what is held besides the queue."""
        if step.room is not None and not step.room.matches(step.made, nbytes) \
                or step.room is None and step.profile is None and step.made == 1 and self._rooms \
                and step.full_offload:
            self._leave(step, nbytes)  # not its room's save, or a step that neither follows nor profiles
        if step.made == 1:
            step.first_size = nbytes
            if step.room is not None and self._unknown:
                self._profile_kind(step, nbytes)
            self._measure_from(step, storage)
        if step.profile is not None:
            held = self.queue.step_memory(storage.device)
            if held is not None:
                address = storage.data_ptr()
                step.profile.sizes.append(nbytes)
                step.profile.addresses.append(address)
                step.profile.saves.append(held)
                self._mark(step.profile, storage.device, [address])

    def frame_fits(self, step: Step, frame: int) -> bool:
        """Whether a frame of ``frame`` bytes, which the put of the step's last save makes on the
        device while the save is still there, fits under its room's floor beside what the step holds
        at that save and the copy queue. Once the put has returned the queue counts the frame, but
        as it is made nothing has made room for it. No room, or no frame: True (a profiling step's
        frames are not in its readings either: allocator_record.py leaves out the encode's stream)."""
        return not frame or step.room is None or step.room.fits(step.made, self.queue.nbytes + frame)

    def unpacked(self, stored: Stored, prefetched: int, restored: bool = False) -> None:
        """Backward unpacks an offloaded save (its copy done or not), with ``prefetched`` bytes
        fetched ahead: a profiling step reads what is held besides the queue and the prefetch
        window, and this save, which is needed now (held, fetched ahead or about to be fetched).
        ``restored``: an earlier unpack brought its storage back and it is still alive, so what
        is held counts it already (a storage two ops saved, unpacked by each)."""
        step = stored.step
        if step is None:  # freed with its graph: nothing to count
            return
        if not step.unpacked and step.room is not None and not step.room.complete(step.made):
            # backward begins on fewer saves than the room's: it goes on in the room of exactly its
            # saves, where one is known, else lets the room go (the next step profiles again). Not as
            # a forward ends: a step resumed for another forward goes on
            own = self._rooms.get(tuple(step.room.profile.sizes[:step.made]))
            if own is not None:
                self.follow(own)
                step.room, step.changed_room = own, True
            else:
                step.room, self._profile_next = None, True
        step.unpacked += 1  # the room's place in backward (Step.window)
        if step.profile is not None and step.profile.saves:
            held = self.queue.step_memory(stored.device)
            if held is not None:
                # the bytes this unpack brings back: none where the storage is still on the device
                # (its copy not yet let go of) or an earlier unpack brought it and it is still alive
                brought = stored.nbytes if stored.tensor is None and not restored else 0
                step.profile.unpack_sizes.append(brought)
                # the unpacked storage added, unless the allocator counts it already: brought back by
                # an earlier unpack, or refused by the store and kept by the step all along
                counted = restored or stored.state == State.KEPT
                step.profile.unpacks.append(held - prefetched
                                            + (0 if counted else stored.nbytes))
                step.profile.unpack_saves.append(stored.index)
                if self._mark(step.profile, stored.device) and stored.state not in (State.HELD, State.KEPT):
                    step.profile.landing[stored.key] = step.profile.fetched[-1]  # its storage's address, once known

    def landed(self, stored: Stored, base: torch.Tensor) -> None:
        """The storage ``stored``'s unpack counted is on the device, in ``base``'s block (fetched
        now, or earlier and still alive): a profiled step's record counts that block's free."""
        profile = stored.step.profile if stored.step is not None else None  # None once its step was read
        fetched = profile.landing.pop(stored.key, None) if profile is not None else None
        if fetched is not None:
            fetched.append(base.untyped_storage().data_ptr())

    def close(self) -> None:
        """The session closes: a profile's or a trial step's record, if one runs, stops."""
        if self.profiling is not None:
            self._read_record(self.profiling)
        if self._measure is not None:
            self._read_peak(self._measure)

    def _mark(self, profile: Profile, device: torch.device, saving: list[int] | None = None) -> bool:
        """A reading was just made, leaving out the queue's saves (and the one ``saving``, the
        address of a save about to join it): leave its mark in the allocator's record (started at
        the first), with what the reading left out. False: no mark (no record)."""
        if profile.device is None:
            profile.device = device
            self.record.start(device)
        mark = self.record.mark(device)
        if mark is None:
            return False
        profile.marks.append(mark)
        profile.left_out.append(self.queue.addresses() + (saving or []))
        profile.fetched.append([])
        return True

    def _read_record(self, profile: Profile) -> None:
        """The profiled step has ended: how far its memory rose after each reading, where the record
        kept a mark of each."""
        profile.landing.clear()  # unpacks that never landed (a save modified in place, or freed)
        events = self.record.finish(profile.device) if profile.device is not None else None
        if events is not None and len(profile.marks) == len(profile.saves) + len(profile.unpacks):
            found = replay(events, profile.marks, profile.left_out, profile.addresses, profile.fetched)
            if found is not None:
                profile.rises, profile.frees, profile.counted = found.rises, found.frees, found.counted
