"""``storm.enable``: STORM on for every training forward of a model, in one line.

    handle = storm.enable(model)                  # storm.offload around each forward
    handle = storm.enable(model, budget=0.5)      # or storm.plan on the model's repeated blocks
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

import inspect
import logging
import threading
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .compiled import compiled, probe_compiling, warn_whole_graph
from .hooks import Offload
from .planner import Planner, plan
from .planner.options import plan_options

log = logging.getLogger("storm")

# Containers of a model's layers: HF and GPT-style models keep them in a ModuleList,
# torchtitan in a ModuleDict (keys for pipeline stages), small GPTs in an nn.Sequential.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# id(model) -> its handle, while enabled. Weak: a handle lives as long as its model's hooks or its
# caller hold it, and it holds its model, so an id here is never a dead model's.
_enabled: "weakref.WeakValueDictionary[int, Enabled]" = weakref.WeakValueDictionary()


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP-style wrappers: while ``.module`` is a module that holds every
    parameter of its wrapper, that module."""
    while isinstance(inner := getattr(model, "module", None), nn.Module) and inner is not model:
        if {id(p) for p in model.parameters()} != {id(p) for p in inner.parameters()}:
            break  # a model with a submodule called "module", not a wrapper
        model = inner
    return model


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The model's repeated blocks and where they are: of the ModuleLists, ModuleDicts and
    Sequentials that hold two or more modules of one class, the one with the most parameters
    (then the most modules; then the outermost). Raises ValueError naming what it looked for."""
    best: tuple[tuple[int, int], str, list[nn.Module]] | None = None
    for name, m in unwrap(model).named_modules():
        if not isinstance(m, _CONTAINERS):
            continue
        children = list(m.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = (sum(p.numel() for p in m.parameters()), len(children))
        if best is None or size > best[0]:
            best = (size, name, children)
    if best is None:
        raise ValueError(
            f"storm.enable found no repeated blocks in {type(model).__name__}: it looks for an nn.ModuleList, "
            f"nn.ModuleDict or nn.Sequential of two or more modules of one class (model.model.layers in a Hugging "
            f"Face model, model.layers or model.transformer.h in GPT-style ones) and found none; pass blocks= "
            f"(the model's repeated layers, in the order its forward runs them)")
    return best[1], best[2]


class Enabled:
    """STORM on one model, from ``storm.enable``. ``model`` is the unwrapped model that carries
    the hooks, ``blocks`` what a plan decides for (None without one), ``planner`` the
    storm.plan (None: every step offloads as ``storm.offload(**options)`` does), ``last`` the
    context of the last step that ran (``.stats``, ``.report()``)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module] | None, where: str, planner: Planner | None,
                 options: dict[str, Any], on_forward: bool):
        self.model = model
        self.blocks = blocks
        self.where = where  # the blocks' qualified name in the model ("": the model itself; "blocks=": given)
        self.planner = planner
        self.last: Offload | None = None
        self._options = options
        self._on_forward = on_forward  # steps begin at the model's forward, else where begin() is called
        # Each thread's steps: threads may run the model's forward at once, each in a context of its own
        # (a storm.offload context covers its thread), so one thread's end never exits another's context.
        self._threads = threading.local()
        self._open = 0  # begin()s not yet ended, all threads together
        self._open_lock = threading.Lock()
        self._hooks = [model.register_forward_pre_hook(torch.compiler.disable(lambda m, args: self.begin())),
                       model.register_forward_hook(torch.compiler.disable(lambda m, args, out: self._end(out)),
                                                   always_call=True)
                       ] if on_forward else []
        self._told_joined = False  # a forward joined the step before it: said once
        if planner is None:  # a plan probes its blocks itself (planner/wiring.py)
            if compiled(model):
                _warn_offload_whole_graph()
            self._hooks.append(model.register_forward_pre_hook(probe_compiling(_warn_offload_whole_graph)))

    def begin(self) -> None:
        """A step begins: the next storm.offload context (the plan's, with a planner) is entered,
        unless grad is off or a step of this model is already open (its forward called inside
        itself), which the open one covers. Called by the forward pre-hook, or by a framework's
        callback that marks steps itself (``on_forward=False``)."""
        scopes = self._scopes()
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
                ctx = self.planner.step() if self.planner is not None else Offload(**self._options)
                ctx.__enter__()
        except BaseException:
            with self._open_lock:
                self._open -= 1
            raise
        scopes.append(ctx)
        self.last = ctx

    def end(self) -> None:
        """The step's forward has ended: this thread's context is exited (saved tensors stay in the
        store until backward). Without an open step in this thread, nothing."""
        self._end(None)

    def _end(self, out: Any) -> None:
        """end(); ``out``, the forward's output (from the forward hook), is watched: a forward that
        begins before backward reaches it goes on with this step (_awaiting_backward)."""
        scopes = self._scopes()
        if not scopes:
            return
        with self._open_lock:
            self._open -= 1
        if (ctx := scopes.pop()) is not None:
            ctx.__exit__(None, None, None)
            if out is not None and not scopes:
                self._threads.awaiting = _Awaiting(ctx, out)

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
        what = "storm.offload"
        if self.planner is not None:
            assert self.blocks is not None  # a plan is made on blocks (__init__)
            what = (f"storm.plan on {len(self.blocks)} blocks at {self.where or '(the model)'} "
                    f"({type(self.blocks[0]).__name__})")
        model = type(self.model).__name__
        steps = (f"on every forward of {model} with grad enabled (those before one backward: one step)"
                 if self._on_forward else
                 f"in {model}, on the steps that begin() and end() mark (a framework's callback: Lightning's "
                 f"batch hooks), with grad enabled")
        state = "" if _enabled.get(id(self.model)) is self else " (disabled; as it was then)"
        head = f"storm.enable{state}: {what} {steps}"
        if self.planner is not None:
            return f"{head}\n{self.planner.explain()}"
        return f"{head}\n{self.last.report()}" if self.last is not None else f"{head}; no step yet"

    def disable(self) -> None:
        """Remove every hook STORM put on the model, close the planner (the blocks' own forwards
        come back); a second call does nothing. Not inside the model's forward."""
        if self._open:
            raise RuntimeError("storm.enable's disable() was called inside a step of the model (between its "
                               "forward's start and end, in this thread or another); call it between steps")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.planner is not None:
            self.planner.close()
        if _enabled.get(id(self.model)) is self:
            del _enabled[id(self.model)]


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
            if isinstance(t, torch.Tensor) and t.requires_grad:
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


def _offload_options(blocks: Iterable[nn.Module] | None, options: dict[str, Any]) -> dict[str, Any]:
    """storm.offload's options for a model enabled without a plan, as checked: refused now, not at
    the first forward, and read once (a generator given as modules= would be used up by the first
    step's context)."""
    if blocks is not None:
        raise TypeError("storm.enable's blocks= is for a plan: give budget= or peak= with it")
    checked = Offload(**options).options
    return {k: checked[k] for k in options}


def _warn_offload_whole_graph() -> None:
    warn_whole_graph("storm.enable", "the model's forward, offloaded as a whole,")


def enable(model: nn.Module, *, blocks: Iterable[nn.Module] | None = None, budget: int | float | str | None = None,
           peak: int | str | None = None, on_forward: bool = True, **options: Any) -> Enabled:
    """Turn STORM on for every forward of ``model`` that runs with grad enabled; returns the
    handle whose ``disable()`` turns it off.

    Without ``budget`` and ``peak`` each forward runs in ``storm.offload(**options)``. With
    one of them (``storm.plan``'s: the GPU memory a step's saves may take, bytes or a fraction
    of a step's; or the step's peak above its start, CUDA), each forward is a step of
    ``storm.plan(blocks, budget= or peak=, **options)``, where ``blocks`` are the model's
    repeated layers, found by ``find_blocks`` unless given. ``options``: storm.offload's
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
    planner = None
    if budget is None and peak is None:
        options = _offload_options(blocks, options)
        where, found = "", None
    else:
        where, found = ("blocks=", list(blocks)) if blocks is not None else find_blocks(model)
        planner = plan(found, budget, peak=peak, model=model, **options)
    handle = Enabled(model, found, where, planner, options, on_forward)
    _enabled[id(model)] = handle
    return handle
