"""``storm.enable``: STORM on for every training forward of a model, in one line.

    handle = storm.enable(model)                  # storm.offload around each forward
    handle = storm.enable(model, budget=0.5)      # or storm.plan on the model's repeated blocks (blocks.py)
    ...                                           # train as before: loss = model(x); loss.backward()
    handle.disable()                              # hooks off, blocks' own forwards back

How frameworks switch their memory savers on without a change to the training
loop: transformers' ``gradient_checkpointing_enable`` rewires the model's
layers, torchtune's ``OffloadActivations`` is a context the recipe enters around
forward. ``enable`` does the second from the model itself: a forward pre-hook
enters a ``storm.offload`` context (or the planner's next step) and a forward
hook, always called, exits it, so saves made inside the model's forward go to
the store and come back in backward, which ``storm.offload`` serves after its
``with`` has ended. A step is what runs between backwards: a forward that begins
before backward has reached the last one's output goes on with that step
(``Offload.resume()``), so two forwards before one backward are planned as one step.

A model compiled as one graph (``torch.compile(model)``, ``model.compile()``) hands its saved
tensors over only once its whole forward has run, after the peak: a warning says so
once, at enable or where the first forward is compiled, naming per-block compile. The hooks run
eagerly (``torch.compiler.disable``): inside a compiled region dynamo would run them at trace
time only.

Forwards under ``torch.no_grad()`` or ``torch.inference_mode()`` (evaluation,
generation) save nothing for backward: they get no context, and a planner does
not count them as steps. Wrappers whose ``.module`` holds all their parameters
(DistributedDataParallel, which accelerate's prepare also puts around a model)
are unwrapped first, so the hooks sit on the model that the wrapper calls.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import weakref
from types import FrameType
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .blocks import CallOrder, Found, find_blocks, unwrap
from .compiled import compiled, probe_compiling, warn_whole_graph
from .hooks import Offload
from .planner import Planner, plan
from .planner.budgets import LADDER, compile_options, ladder_option
from .planner.options import plan_options

log = logging.getLogger("storm")

# id(model) -> its handle, while enabled. Weak: a handle lives as long as its model's hooks or its
# caller hold it, and it holds its model, so an id here is never a dead model's.
_enabled: "weakref.WeakValueDictionary[int, Enabled]" = weakref.WeakValueDictionary()
_LEFT_SHOWN = 4  # lists left out that explain() names, the largest first


class Enabled:
    """STORM on one model, from ``storm.enable``. ``model`` is the unwrapped model that carries
    the hooks; ``found`` the block lists a plan covers (blocks.Found: found by find_blocks, or
    given as blocks=; None without a plan), ``blocks`` and ``where`` its blocks and the lists'
    names; ``planner`` the storm.plan (None: every step offloads as ``storm.offload(**options)``
    does). Where the first forward runs the lists found otherwise than planned (in another order,
    or one between another's blocks), ``found`` and ``planner`` are replaced once, before the
    next step, by those of the lists as they ran. ``last`` is the context of the last step that
    ran (``.stats``, ``.report()``)."""

    def __init__(self, model: nn.Module, found: Found | None, planning: Callable[[list[nn.Module]], Planner] | None,
                 options: dict[str, Any], on_forward: bool):
        self.model = model
        self.found = found
        self._planning = planning  # a planner of the blocks it is given, on the plan's options
        self.planner = planning(found.blocks) if planning is not None and found is not None else None
        # Lists found come in registration order, which forward need not follow, and a plan needs each
        # block run once, in order, in every forward: the first forward says how they run (_check_order)
        self._order = CallOrder(found) if found is not None and self.planner is not None and len(found.lists) > 1 \
            else None
        self.last: Offload | None = None
        self._options = options
        self._on_forward = on_forward  # steps begin at the model's forward, else where begin() is called
        # Each thread's steps: threads may run the model's forward at once, each in a context of its own
        # (a storm.offload context covers its thread), so one thread's end never exits another's context.
        self._threads = threading.local()
        self._open = 0  # begin()s not yet ended, all threads together
        self._open_lock = threading.Lock()
        # the forward hook, always called, gets no output where the forward raised
        ended = torch.compiler.disable(lambda m, args, out: self._end(out, out is not None))
        self._hooks = [model.register_forward_pre_hook(torch.compiler.disable(lambda m, args: self.begin())),
                       model.register_forward_hook(ended, always_call=True)] if on_forward else []
        self._told_joined = False  # a forward joined the step before it: said once
        if self.planner is None:  # a plan probes its blocks itself (planner/wiring.py)
            if compiled(model):
                _warn_offload_whole_graph()
            self._hooks.append(model.register_forward_pre_hook(probe_compiling(_warn_offload_whole_graph)))

    @property
    def blocks(self) -> list[nn.Module] | None:
        """What a plan decides for, in the order forward runs them (None without a plan)."""
        return self.found.blocks if self.found is not None else None

    @property
    def where(self) -> str:
        """The planned lists' qualified names in the model, joined by " + " in the order forward runs
        them ("encoder.block + decoder.block"); "" for the model itself or without a plan;
        "blocks=" for blocks given."""
        return self.found.where if self.found is not None else ""

    def begin(self) -> None:
        """A step begins: the next storm.offload context (the plan's, with a planner) is entered,
        unless grad is off or a step of this model is already open (its forward called inside
        itself), which the open one covers. Called by the forward pre-hook, or by a framework's
        callback that marks steps itself (``on_forward=False``)."""
        scopes = self._scopes()
        if self._on_forward:
            depth = _depth()
            if scopes and depth <= self._threads.depth:
                self._end_interrupted()  # empties scopes: this call opens the next step, at its own depth
            if not scopes:
                self._threads.depth = depth
        with self._open_lock:
            self._open += 1
        if not torch.is_grad_enabled() or any(scopes):
            scopes.append(None)
            return
        try:
            ctx = self._awaiting_backward()
            if ctx is not None:
                ctx.resume().__enter__()
            else:
                if self._order is not None:
                    self._check_order()
                ctx = self.planner.step() if self.planner is not None else self._full_offload()
                ctx.__enter__()
            if self._order is not None:
                self._order.started()
        except BaseException:
            with self._open_lock:
                self._open -= 1
            raise
        scopes.append(ctx)
        self.last = ctx

    def _check_order(self) -> None:
        """Before a step, once a forward has ended normally: the lists found as it ran them
        (Found.as_ran: CLIP registers its text model first and runs its vision model first). Where
        that differs from the plan's, the plan has traced nothing (the planner traces again until
        its blocks run once each, in order), so it is made again on the lists as they ran."""
        assert self._order is not None and self.found is not None and self._planning is not None
        assert self.planner is not None
        if self._order.first is None:
            return
        ran = self.found.as_ran(self._order.first)
        self._order.remove()
        self._order = None
        if ran.lists != self.found.lists:
            planned = self.found.where
            self.planner.close()
            self.found = ran
            self.planner = self._planning(ran.blocks)
            log.warning("storm.enable: the first forward of %s ran its block lists otherwise than planned (%s): the "
                        "plan starts again on %s, as they ran (explain() says why a list is left out)",
                        type(self.model).__name__, planned, ran.where)

    def end(self) -> None:
        """The step's forward has ended: this thread's context is exited (saved tensors stay in the
        store until backward). Without an open step in this thread, nothing."""
        self._end(None, True)

    def _end(self, out: Any, normally: bool) -> None:
        """end(); ``out``, the forward's output (from the forward hook), is watched: a forward that
        begins before backward reaches it goes on with this step (_awaiting_backward). ``normally``:
        the forward did not raise (the forward hook gets no output where it did)."""
        scopes = self._scopes()
        if not scopes:
            return
        with self._open_lock:
            self._open -= 1
        if (ctx := scopes.pop()) is not None:
            ctx.__exit__(*((None, None, None) if normally else _RAISED))
            if out is not None and not scopes:
                self._threads.awaiting = _Awaiting(ctx, out)
            if self._order is not None and not scopes:
                self._order.ended(normally)

    def _end_interrupted(self) -> None:
        """This thread's steps, open though no forward of the model runs: one was interrupted
        (KeyboardInterrupt, Ctrl-C in a notebook), for which torch runs no always_call forward
        hook. Ended as a forward that raised is; a forward called within the model's own (a
        deeper stack than its begin's) is not taken for one."""
        log.warning("storm.enable: a forward of %s stopped without its forward hooks (KeyboardInterrupt): "
                    "its step is ended now", type(self.model).__name__)
        while self._scopes():
            self._end(None, False)

    def _full_offload(self) -> Offload:
        """A step without a plan: storm.offload(**options), framing the CUDA saves (codec "auto")
        where the model is on CUDA and no codec was given (codec=None gives none, as storm.plan
        takes it). Offloading every save, a step waits on the link, and frames put fewer bytes on
        it (docs/results.md, "Full offload's codec")."""
        if self._options.get("codec") is not None or not on_cuda(self.model):
            return Offload(**self._options)
        return Offload(**{**self._options, "codec": "auto"})

    def _awaiting_backward(self) -> Offload | None:
        """This thread's last step, where its forward's output is alive and no backward has reached
        it: a step is what runs between backwards, so a second forward before one backward (chosen
        and rejected sequences, a siamese model's two towers) is more of the same step."""
        awaiting, self._threads.awaiting = getattr(self._threads, "awaiting", None), None
        if awaiting is None or not awaiting.waiting:
            return None
        if not self._told_joined:
            self._told_joined = True
            log.info("storm.enable: a forward of %s began before the backward of the forward before it: both are "
                     "one step%s. Where a step should end elsewhere, enable with on_forward=False and mark each "
                     "step with the handle's begin() and end()", type(self.model).__name__,
                     ", planned as a whole" if self.planner is not None else "")
        return awaiting.ctx

    def _scopes(self) -> list[Offload | None]:
        """This thread's open steps: one per begin() not yet ended, None where none was entered."""
        try:
            return self._threads.scopes
        except AttributeError:
            self._threads.scopes = []
            return self._threads.scopes

    def explain(self) -> str:
        """What was enabled and how its steps are marked, and the plan's explanation or the last
        step's report; after ``disable()`` too, as they were then."""
        what, found = "storm.offload", ""
        if self.planner is not None:
            assert self.found is not None  # a plan is made on blocks (__init__)
            classes = ", ".join(dict.fromkeys(type(b).__name__ for b in self.found.blocks))
            what = f"storm.plan on {len(self.found.blocks)} blocks at {self.where or '(the model)'} ({classes})"
            found = self._found_lines()
        model = type(self.model).__name__
        steps = (f"on every forward of {model} with grad enabled (those before one backward: one step)"
                 if self._on_forward else
                 f"in {model}, on the steps that begin() and end() mark (a framework's callback: Lightning's "
                 f"batch hooks), with grad enabled")
        state = "" if _enabled.get(id(self.model)) is self else " (disabled; as it was then)"
        head = f"storm.enable{state}: {what} {steps}{found}"
        if self.planner is not None:
            return f"{head}\n{self.planner.explain()}"
        return f"{head}\n{self.last.report()}" if self.last is not None else f"{head}; no step yet"

    def _found_lines(self) -> str:
        """Lines on the lists found, where there is more to say than the head's names: several lists
        planned as one, and the lists left out and why (the largest few: a model may have dozens)."""
        assert self.found is not None
        lines = ""
        if len(self.found.lists) > 1:
            order = "registration order, until the first forward shows how it runs them" \
                if self._order is not None else "the order forward runs them"
            lists = " + ".join(f"{name} ({n})" for name, n in self.found.lists)
            lines += f"\nblocks: {lists}, planned as one sequence in {order}"
        for name, n, why in self.found.left[:_LEFT_SHOWN]:
            lines += f"\nleft out: {name or '(the model)'} ({n} modules): {why}"
        if len(self.found.left) > _LEFT_SHOWN:
            lines += f"\nleft out: {len(self.found.left) - _LEFT_SHOWN} more lists (handle.found.left names each)"
        return lines

    def disable(self) -> None:
        """Remove every hook STORM put on the model, close the planner (the blocks' own forwards
        come back); a second call does nothing. Not inside the model's forward."""
        if self._scopes() and self._on_forward and _depth() < self._threads.depth:
            self._end_interrupted()  # called from outside the forward whose step is open: it was interrupted
        if self._open:
            raise RuntimeError("storm.enable's disable() was called inside a step of the model (between its "
                               "forward's start and end, in this thread or another); call it between steps")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._order is not None:
            self._order.remove()
            self._order = None
        try:
            if self.planner is not None:
                self.planner.close()
        finally:  # the model is STORM's no longer, whatever reading the planner's last step raised
            if _enabled.get(id(self.model)) is self:
                del _enabled[id(self.model)]


# what a step's context is told at its exit where the model's forward raised (the forward hook gets
# no exception, only that there is no output)
_RAISED = (Exception, None, None)


def _depth() -> int:
    """Frames on this thread's stack below the caller's."""
    frame: FrameType | None = sys._getframe(1)
    n = 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


class _Awaiting:
    """A step whose forward has ended, until backward reaches its output or its graph is dropped
    unused. Each output's hook (_Reached) is held by the output's graph alone, which outlives the
    output's tensor object (a loss computed from the logits drops them): while one of the hooks
    lives, so does a graph that a later backward may still run."""

    def __init__(self, ctx: Offload, out: Any):
        self.ctx = ctx
        self.reached = False
        self._hooks: list[weakref.ref] = []
        for t in tree_leaves(out):
            # made by this forward: a leaf returned as it is (a learned temperature) is in no graph of
            # it, and a hook there would stay for good, one more each step, holding its step
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                hook = _Reached(self)
                t.register_hook(hook)
                self._hooks.append(weakref.ref(hook))

    @property
    def waiting(self) -> bool:
        """Backward has not reached the output, and a graph it is in may still run."""
        return not self.reached and any(r() is not None for r in self._hooks)


class _Reached:
    """A gradient hook on a step's output: backward reached it."""

    __slots__ = ("awaiting", "__weakref__")

    def __init__(self, awaiting: _Awaiting):
        self.awaiting = awaiting

    def __call__(self, grad: torch.Tensor) -> None:
        self.awaiting.reached = True


def handle_of(model: nn.Module) -> Enabled | None:
    """The handle of ``storm.enable`` on ``model`` (unwrapped as enable does), None where it is off."""
    return _enabled.get(id(unwrap(model)))


def check_options(*, blocks: Iterable[nn.Module] | None = None, budget: int | float | str | None = None,
                  peak: int | str | None = None, **options: Any) -> None:
    """Raise what ``storm.enable(model, **these)`` would raise for its options, without a model:
    the integrations' callbacks are made before the Trainer hands them one, and check theirs then."""
    if budget is None and peak is None:
        _offload_options(blocks, options)
    else:  # the planner's own keywords (reentrant, clock, and what tests give) are not storm.offload's
        planner = set(inspect.signature(Planner).parameters) - {"model"}  # enable passes its own model
        plan_options(budget, peak, options.get("reentrant", True), options.get("clock"),
                     {k: v for k, v in options.items() if k not in planner})
        compile_options(options.get("compile_blocks", False))
        ladder_option(options.get("block_budgets", LADDER))


def on_cuda(model: nn.Module) -> bool:
    """Whether ``model``'s first parameter (or buffer) is on a CUDA device: where a step is moved."""
    first: torch.Tensor | None = next(model.parameters(), None)
    if first is None:
        first = next(model.buffers(), None)
    return first is not None and first.device.type == "cuda"


def _offload_options(blocks: Iterable[nn.Module] | None, options: dict[str, Any]) -> dict[str, Any]:
    """storm.offload's options for a model enabled without a plan, as checked: refused now, not at
    the first forward, and read once (a generator given as modules= would be used up by the first
    step's context)."""
    planners = ["blocks"] * (blocks is not None) + [k for k in ("compile_blocks", "block_budgets") if k in options]
    if planners:
        raise TypeError(f"storm.enable's {planners[0]}= is for a plan: give budget= or peak= with it")
    checked = Offload(**options).options
    return {k: checked[k] for k in options}


def _warn_offload_whole_graph() -> None:
    warn_whole_graph("storm.enable", "the model's forward, offloaded as a whole,")


def enable(model: nn.Module, *, blocks: Iterable[nn.Module] | None = None, budget: int | float | str | None = None,
           peak: int | str | None = None, on_forward: bool = True, **options: Any) -> Enabled:
    """Turn STORM on for every forward of ``model`` that runs with grad enabled; returns the
    handle whose ``disable()`` turns it off.

    Without ``budget`` and ``peak`` each forward runs in ``storm.offload(**options)``, with
    ``codec="auto"`` on a CUDA model unless a codec is given (frames for its CUDA saves;
    ``codec=None`` is none given). With one of them (``storm.plan``'s: the GPU memory a step's
    saves may take, bytes or a fraction of a step's; or the step's peak above its start, CUDA),
    each forward is a step of
    ``storm.plan(blocks, budget= or peak=, **options)``, where ``blocks`` are the model's
    repeated layers: those of every block list ``find_blocks`` finds (blocks.py), as one
    sequence in the order forward runs them, unless given. ``options``: storm.offload's
    (``budget`` excepted, which is the plan's here), and with a plan ``reentrant`` and
    ``clock``. ``on_forward=False`` puts no step hooks on the model: the caller marks each step with
    ``begin()`` (before forward) and ``end()`` (before backward), as the Lightning callback does.
    A model (or a module of it, or a model it is part of) already enabled is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"storm.enable takes an nn.Module instance (the model); got {model!r}")
    model = unwrap(model)
    for other in [h.model for h in _enabled.values()]:
        if other is model:
            relation = ""
        elif any(m is model for m in other.modules()):
            relation = f", which holds this {type(model).__name__}"
        elif any(m is other for m in model.modules()):
            relation = f", a module of this {type(model).__name__}"
        else:
            continue
        raise RuntimeError(f"storm.enable is already on for {type(other).__name__}{relation}: call disable() on its "
                           f"handle first (nested STORM hooks would take each other's saves): the one storm.enable "
                           f"returned, a StormCallback's .handle, or storm.enabled.handle_of(the "
                           f"{type(other).__name__})")
    found, planning = None, None
    if budget is None and peak is None:
        options = _offload_options(blocks, options)
    else:
        if blocks is not None:
            given = list(blocks)
            found = Found((("blocks=", len(given)),), given)
        else:
            found = find_blocks(model)
        planning = functools.partial(plan, budget=budget, peak=peak, model=model, **options)
    handle = Enabled(model, found, planning, options, on_forward)
    _enabled[id(model)] = handle
    return handle
