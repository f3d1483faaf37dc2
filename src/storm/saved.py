"""What the session holds for each saved tensor: ``Stored`` (an offloaded storage, in the store or on
its way), ``Handle`` (what autograd holds in place of an offloaded saved view), ``Kept`` (a saved
tensor that stays where it is) and its ``Marker`` kind, and ``Step`` (one storm.offload context's saves).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .copies.base import Copy, PutRequest, Route
from .errors import StormInPlaceError
from .room import Profile, Room
from .stats import OffloadStats

IN_PLACE_FIX = ("make the op out of place (e.g. relu instead of relu_, x = x + y instead of x += y) "
        "or clone the tensor before modifying it")


# a kind of step, by its first save the policy would offload (shape, dtype, device type): what
# fraction budgets and the copy queue past a budget go by (session.py)
StepKind = tuple[tuple[int, ...], torch.dtype, str]


class State:
    HELD = "held"            # copy in flight; the tensor is still referenced
    OFFLOADED = "offloaded"  # in the store; the tensor was let go
    KEPT = "kept"            # the store had no room or failed: the tensor stays referenced
    MODIFIED = "modified"    # changed in place before the copy was checked: the saved value is lost
    FREED = "freed"



DEFAULT_PREFETCH_BYTES = 256 << 20
DEFAULT_MAX_HELD_BYTES = 512 << 20  # saving blocks on the mover beyond this much not yet copied


@dataclass(frozen=True)
class StepOptions:
    """What one ``storm.offload`` context asked for its step, read wherever the step's saves are
    served, in forward and in backward: the session is shared by every context and thread of
    the process, so it holds none of them.

    ``prefetch_bytes``: how far ahead backward fetches once it unpacks offloaded saves;
    ``max_held_bytes``: bytes that may wait for their copy before saving blocks; ``verify``: check
    fetched CPU bytes against their checksum; ``codec``: how the step's saves are encoded (None:
    the store's choice)."""

    prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
    max_held_bytes: int = DEFAULT_MAX_HELD_BYTES
    verify: bool = True
    codec: str | None = None


class Step:
    """The saves of one ``storm.offload`` context, in saving order (for prefetch)."""

    def __init__(self, number: int, budget_bytes: float, options: StepOptions = StepOptions(), *,
                 full_offload: bool):
        self.number = number
        self.options = options
        self.budget_bytes = budget_bytes  # offload the earliest saves up to this many bytes
        # every save offloaded within full offload's limits (rooms.py), until something sets a budget
        # (hooks.Offload.offload_at_most): session.new_step decides it for the steps it makes (not a
        # fraction budget's first step, whose limit is infinite only for want of a step before it, nor
        # storm.plan's steps: planner/trace.py's PlanStep)
        self.full_offload = full_offload
        self.candidate_bytes = 0          # what the policy would have offloaded with no budget
        self.fraction: float | None = None  # a fraction budget, of the last step of its kind (session.py)
        self.kind: StepKind | None = None  # known at its first save the policy would offload
        self.queue_past_budget = False    # its copy queue may hold what the last step of its kind saved past its budget
        self.fetch_allowance = 0          # memory backward has freed: prefetch may run this far past its window
        self.queue_allowance = 0          # memory forward has below the step's peak: copies may run this far
                                          # behind past max_held_bytes (a caller that knows the blocks says so)
        self.fetching = False             # backward has unpacked an offloaded save: the window is open
        self.unpacked = 0                 # unpacks of offloaded saves so far (a room's place in backward)
        self.room: Room | None = None     # full offload: the limits an earlier step's profile gives (room.py)
        self.profile: Profile | None = None  # full offload without a room: what this step reads for one
        self.changed_room = False         # full offload: it went on in another room past its first save
        self.first_size: int | None = None  # full offload: its first save's bytes (what a room begins with)
        self.paced = False                # the caller sets fetch_allowance (allow_prefetch), not the markers
                                          # (from the start where its context says: hooks.Offload.paced)
        self.budget_reached = False       # a save did not fit: the rest of forward stays on the device
        self.past_budget_bytes = 0        # saves past the budget (views counted by their own size)
        self.past_budget_before = 0       # the last completed step's past_budget_bytes, where it had a budget
        self.marked_bytes = 0             # past_budget_bytes at the last marker
        # the step's own CUDA bytes when forward ended (with saves past the budget): allocated less the copy queue
        self.level: int | None = None
        self.flush_task = -1              # the backward (autograd's graph task id) whose end has a poll queued
        self.order: list[Stored] = []
        self.by_storage: dict[int, Stored] = {}
        # storages a room keeps on the device, by _cdata, each by a weak reference (one freed, a new
        # storage made at its address is not it), and how many it kept
        self.kept_by_room: dict[int, StorageWeakRef] = {}
        self.room_kept = 0
        # storages the caller keeps on the device (Offload.keep), by _cdata
        self.kept_storages: dict[int, StorageWeakRef] = {}
        self.cursor = 1 << 62  # order[cursor:] has been considered for prefetch
        # storages saved again after other offloaded saves (a model's rotary tables, saved by every
        # layer), each with the place of that save (Handle.index): backward needs such a storage at
        # the latest of them, long before it reaches the place it was first saved at
        self.saved_again: list[tuple[int, Stored]] = []
        self.again_cursor = 1 << 62  # saved_again[again_cursor:] has been considered for prefetch
        self.stats = OffloadStats()
        self.modules: list[str] | None = None  # with named layers: the modules running now, innermost last

    @property
    def made(self) -> int:
        """The saves a room follows so far: those offloaded, and those it kept."""
        return len(self.order) + self.room_kept

    def window(self) -> int:
        """How far ahead backward may fetch now: the prefetch window, within the room where there is one."""
        limit = self.options.prefetch_bytes
        return self.room.window(self.unpacked, limit) if self.room is not None else limit

    @property
    def layer(self) -> str | None:
        """The layer saves are counted under now; None when layers are not named."""
        if self.modules is None:
            return None
        return self.modules[-1] if self.modules else "(outside modules)"



@dataclass(frozen=True)
class Facts:
    """What an offloaded storage is, fixed when it is saved: its place in the step's saving order
    (``index``) and layer, its bytes, device, the saved view's shape and dtype, the op that made
    its bytes (producer_of), a weak reference to the storage (also the step's dedup key while the
    step lasts), and whether a compiled graph saved it (storm/graph: stored raw, its version not
    checked)."""

    index: int
    layer: str | None
    nbytes: int
    device: torch.device
    shape: tuple[int, ...]
    dtype: torch.dtype
    producer: str
    weak: StorageWeakRef
    compiled: bool

    @property
    def kind(self) -> tuple[Any, ...]:
        """What tensors saved by the same op at the same place in the model share."""
        return self.producer, self.shape, self.dtype


class Stored:
    """An offloaded storage, in the store or on its way. ``facts`` are set once, when it is saved;
    every other field is the session's (storm/session.py, restore.py) alone to write, under its lock
    but ``read``, which only the thread unpacking it writes:

    ``key`` (a new one where it is stored again: its frame overflowed, or its store's daemon
    stopped), ``route`` (the route its copies take, mover.Mover.route's: set at its put, and at a
    put again), ``step`` (None once
    freed), ``tensor`` (held until its copy is in: ``detach()``-ed, see Kept), ``version`` (at save;
    None: not checked, a compiled graph's save), ``state``, ``copy_in`` (the put, until it lands),
    ``request`` (while held: to store it again raw), ``frame_bytes`` (once in the store: the bytes of
    the frame a get brings it back in, on the device beside the tensor it decodes into; 0: none),
    ``refs`` (live handles), ``handles`` (handles
    ever made: one per save of this storage), ``unpacks``, ``in_store``, ``read`` (the CUDA event of
    the last copy out of the store; CPU copies are done on return), ``let_go`` (a compiled graph's
    save: the graph may have reused its memory since)."""

    __slots__ = ("facts", "key", "route", "step", "tensor", "version", "state", "copy_in", "request", "frame_bytes",
                 "refs", "handles", "unpacks", "in_store", "read", "let_go", "__weakref__")

    def __init__(self, key: int, step: Step, t: torch.Tensor, weak: StorageWeakRef, nbytes: int,
                 compiled: bool = False):
        self.facts = Facts(len(step.order), step.layer, nbytes, t.device, tuple(t.shape), t.dtype, producer_of(t),
                           weak, compiled)
        self.key = key
        self.route = Route.HOST  # until its put is routed
        self.step: Step | None = step
        self.tensor: torch.Tensor | None = t.detach()
        self.version: int | None = None if compiled else t._version
        self.state = State.HELD
        self.copy_in: Copy | None = None
        self.request: PutRequest | None = None
        self.frame_bytes = 0
        self.refs = 0
        self.handles = 0
        self.unpacks = 0
        self.in_store = False
        self.read: Any = None
        self.let_go = False

    # the facts the rest of the client reads, by their names
    index = property(lambda self: self.facts.index)
    layer = property(lambda self: self.facts.layer)
    nbytes = property(lambda self: self.facts.nbytes)
    device = property(lambda self: self.facts.device)
    shape = property(lambda self: self.facts.shape)
    dtype = property(lambda self: self.facts.dtype)
    weak = property(lambda self: self.facts.weak)
    compiled = property(lambda self: self.facts.compiled)
    kind = property(lambda self: self.facts.kind)

    def describe(self) -> str:
        """For error messages (built only then: the tensor may be gone by now)."""
        return _description(self.facts.shape, self.facts.dtype, self.facts.producer)


class Handle:
    """What autograd holds in place of a saved tensor (the session counts it in its Stored's refs).
    ``index``: where this save came in its step's saving order (the offloaded saves before it), which
    a storage saved again later (a model's rotary tables, saved by every layer) does not share with
    its Stored: backward unpacks it there, and prefetch goes on from there."""

    __slots__ = ("stored", "index", "dtype", "shape", "strides", "storage_offset", "_dropped", "__weakref__")

    def __init__(self, dropped: collections.deque[Stored], stored: Stored, t: torch.Tensor, index: int):
        self._dropped = dropped  # the session's: where a dropped handle's Stored goes, to be freed at its next poll
        self.stored = stored
        self.index = index
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self.strides = t.stride()
        self.storage_offset = t.storage_offset()

    @property
    def device(self) -> torch.device:
        return self.stored.device

    def view_of(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.storage_offset, self.shape, self.strides)

    def __del__(self) -> None:
        # Only a Handle the session made is counted in its Stored's refs. Dynamo, tracing a pack hook
        # inside a compiled region, makes Handles with object.__new__ and drops them unfinished.
        dropped = getattr(self, "_dropped", None)
        if dropped is not None:
            dropped.append(self.stored)  # deque.append is atomic: safe from any thread


class Kept:
    """A saved tensor that stays where it is, with its version, so unpack can still
    detect in-place changes (autograd's own check is off under saved_tensors_hooks).

    It holds the tensor detached (the same storage and version counter, no grad_fn): a
    tensor saved by the op that made it (tanh, exp, softmax) holds that op's node, which
    holds what pack returned, a cycle through C++ that no garbage collector sees. A graph
    dropped without a backward (a skipped step, an evaluation under grad) then held such
    saves for the life of the process. Autograd restores the grad_fn at unpack itself. A tensor
    with no grad_fn that requires no grad is held as it is: nothing to break, and a copy would lose
    what its Python object carries (a compiled graph's storm token, under these hooks)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor, checked: bool = True):
        self.tensor = t if t.grad_fn is None and not t.requires_grad else t.detach()
        self.version = t._version if checked else None  # None: nothing else writes it (a compiled graph's copy)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def unpack(self) -> torch.Tensor:
        if self.version is not None and self.tensor._version != self.version:
            t, node = self.tensor, torch._C._current_autograd_node()
            user = f"saved for {type(node).__name__}" if node is not None else "read outside backward"
            raise StormInPlaceError(f"a saved {_description(tuple(t.shape), t.dtype, user)} was "
                                    f"modified in place after autograd saved it; {IN_PLACE_FIX}")
        return self.tensor


class Marker(Kept):
    """A Kept that also tells prefetch how far backward has come (the first save over the budget,
    then about one in session.MARKER_SPACING past it): at its unpack, the saves offloaded before it
    (``index`` of them) may come back as far as the allowance backward has made."""

    __slots__ = ("step", "index", "nbytes")

    def __init__(self, t: torch.Tensor, step: Step, nbytes: int):
        super().__init__(t)
        self.step = step
        self.index = len(step.order)  # offloaded saves before this one
        self.nbytes = nbytes          # saved since the marker before


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """The same view of a copy of ``t``'s storage (strides and offset kept)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def producer_of(t: torch.Tensor) -> str:
    """The name of the op that made the bytes a save of ``t`` stores, its storage's: ``t``'s grad_fn,
    or for a view its base's (a reshape of a ``.float()`` stores the conversion's output)."""
    made = t._base if t._base is not None else t
    return type(made.grad_fn).__name__ if made.grad_fn is not None else "no grad_fn"


def _description(shape: tuple[int, ...], dtype: torch.dtype, producer: str) -> str:
    return f"{shape} {str(dtype).removeprefix('torch.')} tensor ({producer})"

