"""``storm.offload``: autograd's saved tensors go to the store during forward and
come back, prefetched, during backward.

    with storm.offload():
        loss = model(x).sum()
    loss.backward()

Built on ``torch.autograd.graph.saved_tensors_hooks``: pack (at save time)
hands the tensor's storage to the mover and returns a small handle without
waiting for the store; unpack (in backward) rebuilds the exact view (dtype,
shape, strides, storage offset) from the fetched bytes.

Semantics worth knowing:

* What stays where it is, and why: see ``policy.Keep`` (parameters, leaves
  that require grad, tensors under ``min_bytes``, subclasses, non-strided
  layouts, lazy conj/neg views, and anything the store has no room for).
* In-place modification of a saved tensor. Autograd's own version check does
  not run while saved-tensor hooks are active. STORM compares the tensor's
  version when its copy has finished (checked at the next save, unpack or
  context exit, or at ``synchronize()``): if it changed, unpack raises
  ``StormInPlaceError``; a modification after that point cannot reach the
  stored copy, and backward uses the value as it was at save time. So a
  gradient is never computed from a value other than the saved one; which of
  the two outcomes a given program gets depends on when the copy finished.
* retain_graph: unpack may run twice; the bytes stay in the store until
  autograd drops the graph (the last handle), then they are freed.
* Nested hooks: torch applies the innermost ``saved_tensors_hooks`` only. A
  ``storm.offload`` (or ``save_on_cpu``, or non-reentrant checkpointing)
  inside another one takes over the tensors saved in its scope; the outer one
  sees none of them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from stormd.wire.protocol import CODECS
from stormd.wire.sizes import parse_size

from .compiled import LateSaves
from .options import bytes_option, mode_option, pool_size_option, socket_option
from .policy import DEFAULT_MIN_BYTES, Policy
from .registry import session_for
from .saved import DEFAULT_MAX_HELD_BYTES, DEFAULT_PREFETCH_BYTES, Step, StepOptions, Stored
from .session import ClientSession
from .stats import OffloadStats


class Offload(contextlib.ContextDecorator):
    """One offload scope (a step). Use through ``storm.offload(...)``."""

    # Without a budget, a step is a full offload, whose copy queue and prefetch window follow the
    # rooms of full offload (storm/rooms.py), and a room may keep forward's last saves on the device.
    # storm.plan's contexts that offload every save (its offload trace, a plan offloading or
    # recomputing every block) follow their plan instead: a room an earlier full offload left in the
    # session kept the trace's last saves out of its count (planner/trace.py's PlanStep).
    full_offload = True
    # Past a budget, backward's markers measure what it has freed and prefetch within that
    # (prefetch.py), unless the caller paces prefetch itself from the step's start (allow_prefetch):
    # storm.plan's steps, whose figures count no fetch before backward reaches the blocks
    paced = False

    def __init__(self, *, mode: str = "auto", socket: str | None = None, min_bytes: int | str = DEFAULT_MIN_BYTES,
                 prefetch_bytes: int | str = DEFAULT_PREFETCH_BYTES, pool_size: str | int | None = None,
                 modules: nn.Module | Iterable[nn.Module] | None = None, budget: int | float | str | None = None,
                 max_held_bytes: int | str = DEFAULT_MAX_HELD_BYTES, verify: bool = True, codec: str | None = None):
        mode = mode_option(mode)
        socket = socket_option(mode, socket)
        pool_size = pool_size_option(pool_size)
        min_bytes, prefetch_bytes, max_held_bytes = (
            bytes_option(name, value) for name, value in
            (("min_bytes", min_bytes), ("prefetch_bytes", prefetch_bytes), ("max_held_bytes", max_held_bytes)))
        if codec is not None and codec not in ("auto", *CODECS):
            raise ValueError(f"codec must be None (the store's choice), 'auto' or one of {', '.join(CODECS)}; "
                             f"got {codec!r}")
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False; got {verify!r}")
        modules = modules_option(modules)
        self._budget = parse_budget(budget)
        self._options = dict(mode=mode, socket=socket, min_bytes=min_bytes, prefetch_bytes=prefetch_bytes,
                             pool_size=pool_size, modules=modules, budget=self._budget,
                             max_held_bytes=max_held_bytes, verify=verify, codec=codec)
        self._step_options = StepOptions(prefetch_bytes, max_held_bytes, verify, codec)
        self._policy = Policy.protecting(modules, min_bytes)
        self._names = _module_names(modules)
        self._session: ClientSession | None = None
        self._step: Step | None = None
        self._completed = True  # the last forward it covered ran to its end
        self._hooks: Any = None
        self._pack: Callable | None = None  # ours, to tell our hooks from others' on autograd's stack
        self._late: LateSaves | None = None  # the once-a-process check for a model compiled as one graph
        self._module_hooks: list[Any] = []
        self._thread: int | None = None  # the entering thread's: torch keeps saved-tensor hooks per thread
        self._resuming = False  # resume(): the next entry goes on with this context's step
        self._last_call: Offload | None = None  # used as a decorator: the latest call's own context

    def _recreate_cm(self) -> "Offload":
        self._last_call = Offload(**self._options)  # each decorated call is its own step
        return self._last_call

    def __enter__(self) -> "Offload":
        if self._hooks is not None:
            raise RuntimeError("this storm.offload context is already active; create a new one per step")
        if self._resuming:
            self._resuming = False
        else:
            o = self._options
            self._session = session_for(o["mode"], o["socket"], o["pool_size"])
            self._step = self._session.new_step(self._budget, self._step_options, self.full_offload)
            self._step.paced = self.paced
        self._thread = threading.get_ident()
        if self._budget == 0:  # nothing may go: no hooks, so saves cost nothing (storm.plan's recompute-only plans)
            self._hooks = contextlib.nullcontext()
            return self
        session, step, policy = self._session, self._step, self._policy
        late = self._late = LateSaves() if not LateSaves.judged and torch.cuda.is_initialized() else None
        if late is not None:
            late.enter(torch.device("cuda", torch.cuda.current_device()))

        def pack(t: torch.Tensor) -> Any:
            if late is not None:
                late.saved(t)
            if step.budget_reached:  # the rest of forward stays on the device
                return session.save_past_budget(t, step)
            return session.save(t, step, policy)

        self._pack = pack
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, session.load)
        self._hooks.__enter__()
        names = self._names
        if names:  # name layers in the report; global module hooks cost every module call, so only on request
            step.modules = []

            def enter_module(m: nn.Module, args: Any) -> None:
                step.modules.append(names.get(id(m)) or type(m).__name__)

            def leave_module(m: nn.Module, args: Any, out: Any) -> None:
                if step.modules:
                    step.modules.pop()

            self._module_hooks = [nn.modules.module.register_module_forward_pre_hook(enter_module),
                                  nn.modules.module.register_module_forward_hook(leave_module, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        # checked before anything is undone: torch pops the hooks off the exiting thread's own stack
        # (an internal assert where that stack is empty), and the entering thread's would keep ours
        if self._hooks is None:
            raise RuntimeError("this storm.offload context was not entered (or has been exited already): "
                               "use it as `with storm.offload(...):`")
        if self._thread != threading.get_ident():
            raise RuntimeError("this storm.offload context was entered in another thread: a context covers the "
                               "thread that entered it (torch keeps saved-tensor hooks per thread), so enter and "
                               "exit it in the same thread, with a context of its own in each thread that runs "
                               "a forward")
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        hooks, self._hooks, self._pack = self._hooks, None, None
        hooks.__exit__(*exc)
        if self._late is not None:
            self._late.exit()
            self._late = None
        self._completed = exc[0] is None
        if self._budget != 0:  # a step without hooks leaves the session as it found it
            self._session.end_step(self._step, completed=self._completed)

    def resume(self) -> "Offload":
        """This context, to be entered again for another forward of the same step: one that runs
        before the backward of the forward this context covered (chosen and rejected forwards in
        preference training, the two towers of a contrastive model). Its saves join the step's:
        one budget, one set of counters, one backward. ``with ctx.resume(): ...``"""
        if self._step is None:
            raise RuntimeError("storm.offload's resume() goes on with a step that has run: enter the context first")
        if self._hooks is not None:
            raise RuntimeError("this storm.offload context is active: resume() is for entering it again after "
                               "its exit")
        self._resuming = True
        return self

    @property
    def stats(self) -> OffloadStats:
        """Counters of this step (fetch counters grow as its backward runs); of a context used as a
        decorator, those of its latest call's step."""
        if self._step is None and self._last_call is not None:
            return self._last_call.stats
        if self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        return self._step.stats

    @property
    def options(self) -> dict[str, Any]:
        """The options as checked, by name, sizes read as bytes ("512MiB" -> 536870912): a copy."""
        return dict(self._options)

    @property
    def completed(self) -> bool:
        """Whether the forward this context last covered ran to its end (False: it raised part-way)."""
        return self._completed

    @property
    def room_settled(self) -> bool:
        """Whether this step, ended, ran as the full-offload steps after it will (its copy queue and
        prefetch window under the room they follow: rooms.Rooms.settled); storm.plan measures
        full offload by such a step."""
        if self._session is None or self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        return self._session.rooms.settled(self._step)

    @property
    def saves(self) -> tuple[Stored, ...]:
        """This step's offloaded storages so far, in saving order (each with its ``device``,
        ``dtype`` and ``nbytes``): storm.plan reads which block saved what from them."""
        if self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        return tuple(self._step.order)

    @property
    def backend_name(self) -> str:
        if self._session is None:
            raise RuntimeError("storm.offload has not been entered yet")
        return self._session.backend.name

    def report(self) -> str:
        """A table per layer (layers are named with ``modules=``): tensors and bytes offloaded,
        compression ratio, what stayed, fetch wait; and the total. A full-offload step adds how its
        copy queue and prefetch window were bounded (room.py)."""
        st = self.stats
        rows = [(name, c) for name, c in st.layers.items()] + [("total", st)]
        width = max(len(n) for n, _ in rows)
        lines = [f"{'layer':<{width}}  {'saved':>6} {'offloaded':>9} {'MiB':>9} {'ratio':>6} {'kept':>5} "
                 f"{'fetch wait ms':>13}"]
        for name, c in rows:
            ratio = c.offloaded_bytes / c.stored_bytes if c.stored_bytes else float("nan")
            lines.append(f"{name:<{width}}  {c.saved:>6} {c.offloaded:>9} {c.offloaded_bytes / 2**20:>9.2f} "
                         f"{ratio:>6.2f} {sum(c.kept.values()):>5} {c.fetch_wait_s * 1e3:>13.2f}")
        step = self._step
        if step is not None and step.room is not None:
            lines.append(step.room.describe(step.options.max_held_bytes, step.options.prefetch_bytes))
        elif step is not None and step.profile is not None and step.profile.saves:  # readings made: a GPU's
            lines.append("copy queue and prefetch window: this step read its memory (the allocator's record), "
                         "so the steps after it hold them under the highest it reached")
        return "\n".join(lines)

    def stop_offloading(self) -> bool:
        """The rest of this forward saves as it would without STORM: the saved-tensor hooks come
        off now, so later saves cost nothing on the training thread (a save past the budget still
        costs a hook call in and out, which on a model of many small ops adds up to a visible share
        of the step) and autograd
        checks them for in-place changes itself. What was offloaded comes back as before. Only
        where this context's hooks are the innermost (between blocks, not inside a checkpointed
        one or another saved_tensors_hooks): elsewhere it changes nothing and returns False.
        storm.plan calls it after the last block it offloads, and paces prefetch itself."""
        if self._pack is None:  # not entered, exited, stopped, or a budget-0 step (no hooks)
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] is not self._pack:
            return False
        self._hooks.__exit__(None, None, None)
        self._hooks, self._pack = contextlib.nullcontext(), None
        self._step.budget_reached = True  # nothing more goes: end_step treats it as a reached budget
        return True

    def offload_at_most(self, nbytes: int | str) -> None:
        """The rest of this forward offloads at most ``nbytes`` more (bytes, or a size such as
        '128MiB'): the first save past them and every later one stay on the device, as past a
        budget. storm.plan calls it after the last block where the step offloads only the early
        saves after the blocks."""
        limit = bytes_option("offload_at_most's nbytes", nbytes)
        if self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        step = self._step
        step.budget_bytes = min(step.budget_bytes, step.stats.offloaded_bytes + limit)
        step.full_offload = False  # a budget from here on: the copy queue's limit is a budget's

    def drain(self, limit: int | str) -> None:
        """Let go of saved tensors whose copy has finished, waiting (oldest first) until at most
        ``limit`` bytes still wait for theirs. Each offloaded save polls; past the budget only
        markers do (about one save in 64 MiB), and after ``stop_offloading`` none, so storm.plan
        calls it after each block:
        the host, usually ahead of the GPU, must not hold on to bytes the plan counted as gone."""
        limit = bytes_option("drain's limit", limit)
        if self._session is not None:
            self._session.copy_queue.drain(limit)

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """The storages of ``tensors`` stay on the device for the rest of this step: a save of one
        of them (or of a view of one) is kept where it is, not offloaded. For tensors that stay
        alive anyway while backward needs them, whose copy would cost the link and the host and
        free nothing: storm.plan calls it before a block whose inputs it offloads, with those of
        its inputs that later blocks are called with too (a mask, rotary tables)."""
        if self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"storm.offload's keep() takes tensors; got {type(t).__name__}")
            storage = t.untyped_storage()
            # by a weak reference, not the address alone: one freed, a new storage could be made there
            self._step.kept_storages[storage._cdata] = StorageWeakRef(storage)

    def allow_queued(self, nbytes: int | str) -> None:
        """Forward has ``nbytes`` below the step's peak now (bytes, or a size such as '128MiB'): as
        many more saved bytes may wait for their copy, on top of ``max_held_bytes``, until the next
        call (storm.plan calls it before each block's forward, and with 0 after the last)."""
        nbytes = bytes_option("allow_queued's nbytes", nbytes)
        if self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        self._step.queue_allowance = nbytes

    def allow_prefetch(self, nbytes: int | str) -> None:
        """Backward has freed ``nbytes`` now (bytes, or a size such as '128MiB'): as many
        offloaded bytes may be fetched ahead, on top of the prefetch window (storm.plan calls it as
        backward reaches each block)."""
        # checked first: the step keeps the allowance (Step.fetch_allowance), and backward's prefetch reads it
        nbytes = bytes_option("allow_prefetch's nbytes", nbytes)
        if self._session is None or self._step is None:
            raise RuntimeError("storm.offload has not been entered yet")
        self._session.restorer.allow_prefetch(self._step, nbytes)

    def synchronize(self) -> None:
        """Wait for this session's copies in flight; after it, saved tensors may be modified in place."""
        if self._session is not None:
            self._session.synchronize()


def parse_budget(budget: int | float | str | None) -> int | float | None:
    """None, bytes (int or '8GiB'), or a fraction in (0, 1] of the step's offloadable bytes."""
    if budget is None:
        return None
    if budget == 1 and type(budget) is int:  # 0.5 is half the step's bytes, so 1 reads as all of them
        raise ValueError("budget=1 is one byte; give 1.0 for every offloadable byte of the step (a fraction), "
                         "or bytes as a size such as '1GiB'")
    if isinstance(budget, float):
        valid = 0.0 < budget <= 1.0
    else:
        try:
            return parse_size(budget)  # True/False are refused there: bytes as a bool is surely a mistake
        except ValueError:
            valid = False
    if not valid:
        raise ValueError(f"budget must be bytes (an int >= 0 or a size such as '8GiB') or a fraction in (0, 1], "
                         f"got {budget!r}")
    return budget


def modules_option(modules: object) -> tuple[nn.Module, ...] | None:
    """``modules=`` read once into a tuple of modules (None: not given). Read once because the
    protected storages, the report's layer names and each decorated call's own context all need
    it: a generator such as ``model.modules()`` would be used up by the first."""
    if modules is None:
        return None
    if isinstance(modules, nn.Module):
        return (modules,)
    accepted = "an nn.Module instance or an iterable of them (model, [model.encoder], model.modules())"
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise ValueError(f"modules must be {accepted}; got {modules!r}")
    mods = tuple(modules)
    for m in mods:
        if not isinstance(m, nn.Module):
            raise ValueError(f"modules must be {accepted}; got {m!r} among them")
    return mods


def _module_names(modules: tuple[nn.Module, ...] | None) -> dict[int, str]:
    """id(module) -> its qualified name, for the per-layer report; empty without modules=."""
    if modules is None:
        return {}
    return {id(m): name or type(root).__name__ for root in modules for name, m in root.named_modules()}


def offload(fn: Callable | None = None, /, **options: Any) -> Any:
    """Offload the tensors autograd saves inside this scope.

    Context manager (``with storm.offload(...):``) or decorator (``@storm.offload``
    or ``@storm.offload(...)``). Options: ``mode`` ("auto": the daemon if one
    answers, else the embedded store; "daemon": fail without one;
    "embedded"), ``socket`` (path or endpoint; default $STORMD_SOCKET, else the
    per-user runtime directory), ``min_bytes`` (smaller tensors stay; default
    64 KiB), ``prefetch_bytes`` (how far ahead backward fetches), ``pool_size``
    (the embedded store's, fixed; default $STORM_POOL_SIZE, else a pool that starts at 256 MiB
    and grows on demand), ``modules`` (whose
    parameters and buffers are never offloaded; also names the layers in
    ``report()``: without it the report has the total only, since tracking
    layers hooks every module call), ``budget`` (offload only the earliest saves, which backward
    needs last, up to this many bytes or this fraction of the previous full
    step's offloadable bytes; past it, the rest of the step stays on the device, about one
    save in 64 MiB a marker that paces prefetch), ``max_held_bytes`` (how many bytes may wait for their
    copy before saving blocks: bounds the memory a step holds beyond what it
    keeps), ``codec`` (how tensors are encoded before they are stored:
    "auto", a codec of storm.kernels, or "raw"; default: the daemon's
    ``codec`` setting, "raw" for the embedded store; for CUDA tensors "auto"
    and "ancf_exp" put bf16 tensors of at least 4 MiB in frames encoded on the
    GPU (storm.kernels.frame), "auto" bool ones in frames of a bit an element
    (storm.kernels.bits_frame) and float32 ones at their high halves where a conversion
    widened them (storm.kernels.upcast_frame), else with those halves compressed
    (storm.kernels.float32_frame), the rest is stored raw). Options in bytes take an int or a
    size such as "256MiB".
    """
    if fn is None:
        return Offload(**options)
    if not callable(fn):
        raise TypeError(f"storm.offload takes keyword options, or decorates a function; got {type(fn).__name__}")
    return Offload(**options)(fn)
