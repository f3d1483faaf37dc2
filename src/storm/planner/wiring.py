"""The planner's hold on the model's blocks: forward hooks, a callback as backward ends,
recomputed blocks' forwards (Recompute), and a planned step's hooks that pace copies and
prefetch as forward and backward pass each block. Everything here comes off with ``close()``.

Blocks may be compiled one by one (``block.compile()``, or ``torch.compile(block)`` in their
ModuleList). The planner's hooks record clock marks and Python state, which dynamo would trace
away or run at trace time only inside a compiled region, so each runs eagerly
(``torch.compiler.disable``: a ``.compile()``d block's region breaks around it; an
``OptimizedModule`` calls its hooks outside its region anyway). A recomputed block runs its
compiled forward (``own_forward``), built once per block so that no step compiles it again.
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..compiled import compiled, optimized, probe_compiling, warn_whole_graph
from ..hooks import Offload
from ..recompute import Recompute
from .held import fetched_inputs, holdings, shared_staying
from .model import Plan
from .records import Trace


class BlockHooks:
    """What the planner sets on ``blocks``, and takes off again."""

    def __init__(self, blocks: list[nn.Module], reentrant: bool):
        index = {id(b): i for i, b in reversed(list(enumerate(blocks)))}  # the first place of each
        for j, block in enumerate(blocks):
            for m in block.modules():  # itself first
                i = index.get(id(m), j)
                if i != j:
                    raise ValueError(f"storm.plan: block {j} {'is' if m is block else 'holds'} block {i}: blocks "
                                     "must be distinct modules, none inside another (each is planned once, and "
                                     "called once in each forward)")
        self.blocks = blocks
        self.reentrant = reentrant  # the form recompute() sets unless told
        self._hooks: list[Any] = []
        self._end_hooks: list[Any] = []  # at_backward_end's and at_each_backward's, until their step's backward
        self._recomputing: set[int] = set()
        self._own: dict[int, Callable[..., Any]] = {}  # own_forward per block, once recomputed
        self._given = False  # the blocks run forwards the planner compiled (use_forwards), set as attributes
        # A step is what runs between backwards: it may call each block more than once (two
        # forwards before one backward, as preference and contrastive training do). Each block's
        # forward calls with grad enabled since the step began (new_step), counted by a hook set
        # before any other, so that every later hook reads the call it runs in; and the shapes and
        # dtypes of block 0's inputs in each (input_signature), which a trace holds for
        self.calls = [0] * len(blocks)
        self.inputs: list[tuple] = []
        self._counting = [self._pre_hook(i, functools.partial(self._count, i), with_kwargs=True)
                          for i in range(len(blocks))]

    def _count(self, i: int, m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if torch.is_grad_enabled():  # evaluation between steps calls the blocks too
            self.calls[i] += 1
            if i == 0:
                self.inputs.append(input_signature(args, kwargs))

    def new_step(self) -> None:
        """A step begins: no block has been called in it yet."""
        self.calls = [0] * len(self.blocks)
        self.inputs = []

    def _pre_hook(self, i: int, fn: Callable, **kwargs: Any) -> Any:
        return self.blocks[i].register_forward_pre_hook(torch.compiler.disable(fn), **kwargs)

    def _post_hook(self, i: int, fn: Callable) -> Any:
        return self.blocks[i].register_forward_hook(torch.compiler.disable(fn))

    @staticmethod
    def _training(fn: Callable) -> Callable:
        """``fn`` for calls with grad enabled alone: an evaluation under no_grad between steps (of
        another batch size, say) is no call of a step's, as ``calls`` counts them."""
        @functools.wraps(fn)
        def hook(*args: Any) -> Any:
            return fn(*args) if torch.is_grad_enabled() else None
        return hook

    def hook(self, pre: Callable, post: Callable) -> None:
        """``pre(i, module, args, kwargs)`` before and ``post(i, module, args, out)`` after each
        block's forward, in place of the hooks set before."""
        self.unhook()
        if not compiled(self.blocks[0]):  # traced only where a larger compiled region holds the block
            self._hooks.append(self.blocks[0].register_forward_pre_hook(probe_compiling(warn_blocks_whole_graph)))
        for i in range(len(self.blocks)):
            self._hooks.append(self._pre_hook(i, self._training(functools.partial(pre, i)), with_kwargs=True))
            self._hooks.append(self._post_hook(i, self._training(functools.partial(post, i))))

    def unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def at_backward_end(self, fn: Callable[[], None], reached: Callable[[], None] | None = None) -> None:
        """Call ``fn`` as this step's backward ends: queued on the autograd engine from the
        gradient of the last block's output, which is ready as backward reaches the blocks (the
        loss's and the head's backward done); ``reached``, where given, is called then. Of a step
        that called the blocks more than once, the first such gradient (backward reaches the
        last forward's blocks first) counts."""
        grads: list[Any] = []  # the hooks on each call's output, until one has fired

        def at_grad(grad: torch.Tensor) -> None:
            if not grads:
                return
            for h in grads:
                h.remove()
            grads.clear()
            handle.remove()  # not again when a checkpointed last block is rebuilt in backward
            if reached is not None:
                reached()
            torch.autograd.Variable._execution_engine.queue_callback(fn)

        def at_output(m: nn.Module, args: Any, out: Any) -> None:
            t = grad_tensor(out)
            if t is not None:
                grads.append(t.register_hook(at_grad))

        handle = self._post_hook(len(self.blocks) - 1, at_output)
        self._end_hooks.append(handle)

    def at_each_backward(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(i)`` as backward reaches block i (the gradient of its output is ready: its
        backward runs next), once per block, in the order backward reaches them. Forward's calls
        alone are followed: a block recomputed in backward runs its forward again, whose output's
        gradient is no step's."""
        called: set[int] = set()
        handles: list[Any] = []

        def at_grad(i: int, grad: torch.Tensor) -> None:
            if not called:  # backward has begun: no forward call of this step is left to follow
                for h in handles:
                    h.remove()
            if i not in called:
                called.add(i)
                fn(i)

        def at_output(i: int, m: nn.Module, args: Any, out: Any) -> None:
            t = grad_tensor(out)
            if t is not None and not called:
                t.register_hook(functools.partial(at_grad, i))

        for i in range(len(self.blocks)):
            handles.append(self._post_hook(i, self._training(functools.partial(at_output, i))))
        self._end_hooks.extend(handles)

    def remove_end_hooks(self) -> None:
        """Those of at_backward_end and at_each_backward still waiting: a step begun but never run
        leaves its hooks."""
        for h in self._end_hooks:
            h.remove()
        self._end_hooks = []

    def recompute(self, which: set[int], hand_over: bool = True, reentrant: bool | None = None) -> None:
        """Make exactly the blocks in ``which`` recompute in backward (Recompute, set as their
        forward, in the planner's form unless ``reentrant`` says; ``hand_over``: see Recompute)."""
        reentrant = self.reentrant if reentrant is None else reentrant
        for i in which - self._recomputing:
            if i not in self._own:
                self._own[i] = own_forward(self.blocks[i], i)
        for i in self._recomputing - which:
            b = self.blocks[i]
            if optimized(b) or self._given:
                b.forward = self._own[i]  # its compiled call, as torch.compile or use_forwards set it
            else:
                del b.forward  # back to the class's forward
        for i in which:
            b = self.blocks[i]
            if i not in self._recomputing or (b.forward.hand_over, b.forward.reentrant) != (hand_over, reentrant):
                b.forward = Recompute(self._own[i], device_of([b]), reentrant, hand_over)
        self._recomputing = set(which)

    def use_forwards(self, forwards: Sequence[Callable[..., Any]]) -> None:
        """Run ``forwards`` (the blocks' forwards as the planner compiled them: budgets.Compiler) as
        the blocks' own from the next call: as their forward, or inside Recompute where recomputed.
        ``close()`` takes them off with the rest."""
        if any(compiled(b) or "forward" in vars(b) for b in self.blocks) and not self._given:
            raise ValueError("storm.plan: compile_blocks= compiles the blocks itself, and these are compiled already "
                             "(or have a forward attribute of their own): give the blocks uncompiled, or leave out "
                             "compile_blocks to plan them as they are")
        self._given = True
        for i, (b, forward) in enumerate(zip(self.blocks, forwards)):
            self._own[i] = forward
            b.forward = (Recompute(forward, device_of([b]), b.forward.reentrant, b.forward.hand_over)
                         if i in self._recomputing else forward)

    def compare_step(self, forwards: int, signature: tuple) -> Inputs:
        """The step that ran since new_step() against the traced one, of ``forwards`` forwards and
        block 0's inputs ``signature``: as compare_inputs says, and SMALLER too where some block
        ran fewer times than traced while another ran as many (a layer dropped for the step, as
        LayerDrop does): its saves are the traced step's less that block's. Another number of
        forwards the planner tells by ``calls`` itself."""
        inputs = compare_inputs(self.inputs, signature)
        if inputs is Inputs.AS_TRACED and forwards and max(self.calls) == forwards > min(self.calls):
            return Inputs.SMALLER
        return inputs

    def apply(self, plan: Plan, trace: Trace, grads: bool, ctx: Callable[[], Offload | None]) -> None:
        """Put ``plan`` in force from the next step: its recomputed blocks, and where it offloads,
        the hooks that pace the step ``ctx()`` returns (pace). ``grads``: whether the plan's peak
        counts parameter gradients."""
        self.unhook()
        self.recompute(set(plan.recomputed), reentrant=plan.reentrant)
        if plan.offloads and not plan.full:  # full offload's room paces its own
            self._pace(plan, trace, grads, ctx)

    def _pace(self, plan: Plan, trace: Trace, grads: bool, ctx: Callable[[], Offload | None]) -> None:
        """Past the offloaded blocks STORM's saves only mark about every 64 MiB: too coarse to
        let go of the tensors whose copy has finished in time, or to see backward make room
        at the plan's peak. So after
        each later block's forward the host waits until the copies still running fit in what
        the blocks after it will keep (the host runs ahead of the GPU, and the caching
        allocator counts memory on the host's clock), and a hook on each block's output (whose
        gradient is ready when the block's backward starts) allows prefetch what the plan's
        peak leaves free there: the peak, less the plan's prefetch window (prefetch adds it once
        it fetches), what the blocks before keep (and the shared inputs it keeps first), the block's own
        saves (with its fetched inputs, where they were offloaded) or the largest rebuild still
        to come, and (where the plan's peak counts them, with peak=) the parameter gradients
        allocated from there on; and no more than any block after it down to block 1 leaves, since
        what is fetched stays until its own block's backward. So fetches start as early as memory
        allows and never take a later block over the peak. The blocks recomputed with their
        inputs offloaded pass them through STORM's hooks as the offloaded blocks' saves do, but for
        those a block after them is called with too (a mask, rotary tables), which stay on the
        device (Offload.keep), as the plan counts them; the hooks come off after the last of them,
        unless that is the last block: then the early saves after the blocks (held.after_kept) go
        too, as the plan counts."""
        p, blocks = plan, trace.blocks
        end = p.offloaded + p.inputs_offloaded  # the blocks whose saves (or inputs) are offloaded
        grad = [b.grad_bytes * grads for b in blocks]  # in the plan's peak with peak= only
        room = [0] * len(blocks)
        # as block i runs forward, the copies may run behind by what forward holds below the plan's
        # peak there: the peak less what the plan counts in flight, the saves kept before block i
        # (and the shared inputs it keeps first), its own saves and output as it makes them, and
        # parameter gradients an earlier backward may have left (where the peak counts them). So the
        # host need not wait on each block's copy, losing its lead on the GPU where backward's start
        # is the peak. None after the last block: the loss and backward's start come next
        ahead = [0] * (len(blocks) + 1)
        before = trace.before_bytes * (end == 0) + sum(grad)
        kept, first = holdings(trace, p.offloaded, p.recomputed, p.inputs_offloaded)
        rebuild = 0  # the largest saves (and fetched inputs) of a recomputed block before i: rebuilt later in backward
        for i, b in enumerate(blocks):
            # block i's own saves (kept, rebuilt or fetched) are alive through its backward, and
            # its inputs, where they were fetched
            own = b.saved_bytes + (fetched_inputs(b) if p.offloaded <= i < end else 0)
            # and what its backward was measured to hold beyond the besides (less where negative),
            # as the plan's peak counts it (with peak= alone)
            in_use = max(own, rebuild) + b.backward_extra * grads
            # less the prefetch window, which the peak counts (in flight) and prefetch adds once it fetches
            held = sum(kept[:i]) + first[i]  # with the shared inputs it is the first block to keep
            room[i] = max(0, p.predicted_peak - p.prefetch_bytes - held - in_use - sum(grad[i:]))
            ahead[i] = max(0, p.predicted_peak - p.in_flight_bytes - before - held - b.saved_bytes - b.input_bytes)
            if i in p.recomputed:
                rebuild = max(rebuild, own)
        # what is fetched ahead at block i stays until its own block's backward, below i: through
        # every block between, which may have less room (the parameter gradients grow as backward
        # goes on; a kept block after recomputed ones holds more). So no more than the least room
        # from block i down to block 1 (block 0's fetches are its own saves, which its room counts)
        room = room[:1] + list(itertools.accumulate(room[1:], min))
        # after block i, the copies still running may use what the blocks after the next will
        # keep (they stay until the next block's end, while it allocates its own saves), plus
        # what the plan counts as still in flight when forward ends. Not the plan's slack at
        # that moment: backward's start also holds the loss's and the last block's temporaries,
        # which the model leaves out and which can take a tight plan over its cap
        limit = [p.in_flight_bytes + sum(kept[i + 2:]) for i in range(len(blocks))]

        def reached(i: int, m: nn.Module, args: Any, out: Any) -> None:
            step = ctx()
            if step is None:
                return
            step.allow_queued(ahead[i + 1])
            if i >= end - 1:  # past the offloading blocks no save of the step polls the copy queue
                step.drain(max(limit[i], ahead[i + 1]))
            if i == end - 1 and self.calls[i] >= trace.forwards:  # earlier forwards offload by the budget alone
                if end < len(blocks) or not trace.after_early_bytes:
                    step.stop_offloading()  # the later saves stay: no hooks for them to pass through
                else:  # the last block's saves or inputs went: the early saves after it go too
                    step.offload_at_most(trace.after_early_bytes)
            t = grad_tensor(out)
            if t is not None:
                t.register_hook(lambda grad: step.allow_prefetch(room[i]))

        # an offloading block's inputs that a block after the offloading ones is called with too (a
        # mask, rotary tables) stay alive for it anyway: their copies would free nothing, and cost the
        # link and the host each step. Where every block using one offloads it, it goes (stored once)
        staying = shared_staying(trace, end)
        keeps = {i: [j for j, key in blocks[i].shared_at.items() if key in staying] for i in range(p.offloaded, end)}

        def keep_shared(i: int, m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            step = ctx()
            if step is not None:
                given = call_leaves(args, kwargs)
                step.keep([given[j] for j in keeps[i] if j < len(given) and isinstance(given[j], torch.Tensor)])

        for i in range(len(self.blocks)):
            if keeps.get(i):
                self._hooks.append(self._pre_hook(i, self._training(functools.partial(keep_shared, i)),
                                                  with_kwargs=True))
            self._hooks.append(self._post_hook(i, self._training(functools.partial(reached, i))))

    def close(self) -> None:
        """Restore the blocks' own forwards and remove every hook set on them."""
        self.unhook()
        self.remove_end_hooks()
        self.recompute(set())
        if self._given:  # the blocks run their class's forward again, uncompiled, as they were given
            for b in self.blocks:
                del b.forward
            self._given = False
        for h in self._counting:
            h.remove()
        self._counting = []


def warn_blocks_whole_graph() -> None:
    """Once: the blocks run inside a region compiled as one graph, where their hooks break it at
    every block or, where it was compiled before the planner hooked them, never run."""
    warn_whole_graph("storm.plan", "the blocks' forward")


def own_forward(block: nn.Module, i: int) -> Callable[..., Any]:
    """What ``block`` runs as its forward, compiled where the block is: an ``OptimizedModule``'s
    compiled call of its module; for a ``.compile()``d block (whose compiled region is its whole
    call, hooks and ``forward`` attribute included) its class's forward compiled by the same
    compiler and options, since Recompute, set as that attribute, runs eagerly; else the class's
    forward."""
    if optimized(block):
        return vars(block)["forward"]
    if "forward" in vars(block):
        raise RuntimeError(f"storm.plan: block {i} ({type(block).__name__}) already has its own forward attribute; "
                           "storm.plan recomputes a block by setting it")
    forward = type(block).forward.__get__(block)
    if not compiled(block):
        return forward
    compiler = inspect.getclosurevars(block._compiled_call_impl).nonlocals.get("self")
    if not callable(compiler):  # torch.compile's wrapper no longer keeps its context where this torch did
        raise RuntimeError(f"storm.plan: cannot recompute block {i}, compiled with .compile(), through its own "
                           "compiler in this torch version; compile it as torch.compile(block) in its ModuleList")
    return compiler(forward)


def device_of(blocks: list[nn.Module]) -> torch.device:
    for b in blocks:
        for p in b.parameters():
            return p.device
    return torch.device("cpu")


def grad_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor of a block's output (a tensor, or the leaves of a tuple, dict, ModelOutput)
    that requires grad: backward reaches the block through it (a detached statistic returned
    first does not); None where none does."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    return next((o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad), None)


def call_leaves(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """A block's call as the planner numbers its arguments: the positional ones, then the leaves of
    the keyword ones (a Hugging Face layer takes its mask and rotary tables by name). The trace's
    positions (BlockTrace.shared_at) are places in this list, so the trace and the planned step's
    hooks both read a call through it."""
    return [*args, *tree_leaves(kwargs)]


def input_signature(args: Any, kwargs: dict[str, Any]) -> tuple:
    """The shapes and dtypes of a block's tensor arguments, keyword ones too (a Hugging Face layer
    may take its hidden states by name), and None for each argument given as None (a Hugging Face
    layer's attention mask, where no sequence of the batch is padded): a trace holds while block
    0's stay, or shrink (Inputs)."""
    return tuple(None if a is None else (tuple(a.shape), a.dtype) for a in call_leaves(args, kwargs)
                 if a is None or isinstance(a, torch.Tensor))


class Inputs(enum.Enum):
    """How a step's calls of block 0 compare with the traced step's (compare_inputs)."""

    AS_TRACED = "as traced"
    # no dimension larger and one smaller at least, or None where a tensor was (a batch padded to a
    # shorter longest sequence, one with no padding and so no mask, an epoch's last batch), or a
    # block not run (BlockHooks.compare_step): the plan holds, its saves and their peak only
    # shrink, but the step is no measure of the traced one
    SMALLER = "smaller"
    # a dimension larger, a tensor where None was, or other dtypes, ranks or arguments: the trace no
    # longer holds
    OTHER = "other"


def compare_inputs(step: Sequence[tuple], traced: tuple) -> Inputs:
    """``step``'s calls of block 0 (input_signature, per forward) against the ``traced`` step's,
    call by call: OTHER where any call is, else SMALLER where any is, else AS_TRACED (nothing traced
    yet, or no call: AS_TRACED). More calls than traced are OTHER; fewer, the steps' forwards
    differing, the planner tells by their count."""
    if not traced or not step:
        return Inputs.AS_TRACED
    if len(step) > len(traced):
        return Inputs.OTHER
    verdict = Inputs.AS_TRACED
    for call, was in zip(step, traced):
        if call == was:
            continue
        if not _within(call, was):
            return Inputs.OTHER
        verdict = Inputs.SMALLER
    return verdict


def _within(call: tuple, was: tuple) -> bool:
    """Whether a call's arguments are those of ``was``, each tensor of its dtype and rank and no
    larger in any dimension, or None."""
    return len(call) == len(was) and all(_tensor_within(a, b) for a, b in zip(call, was))


def _tensor_within(arg: tuple | None, was: tuple | None) -> bool:
    if arg is None or was is None:
        return arg is None
    (shape, dtype), (was_shape, was_dtype) = arg, was
    return dtype == was_dtype and len(shape) == len(was_shape) and all(a <= b for a, b in zip(shape, was_shape))
