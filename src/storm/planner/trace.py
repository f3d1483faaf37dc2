"""The traced steps that fill a ``Trace``: the offload trace (everything offloaded, raw: bytes,
tensors, frames and host time per block) and the compute trace (every block recomputed, nothing
offloaded: what recomputing each costs, and how far the host runs ahead of the compute stream).
Each is the least-memory step of its kind, and calls no block beyond the step's own calls and
their recomputes; the offload trace also names which modules outside the blocks saved what
(OutsideSaves). docs/planner.md ("What is traced") explains what each measures and why.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import threading
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..frames import FRAME_CODECS
from ..hooks import Offload
from ..policy import Keep
from ..recompute import Recompute
from .measure import frame_costs, link_bandwidth
from .records import BlockTrace, Trace
from .trial import Clock
from .wiring import BlockHooks, call_leaves, device_of, grad_tensor, warn_blocks_whole_graph

log = logging.getLogger("storm")

MiB = 1 << 20
# A compute trace whose forward took this many times the blocks' own recomputes, or one of whose
# blocks' recompute took this many times the blocks' median (and FIRST_CALL_MS more), paid first
# calls: traced again, once
FIRST_CALL_RATIO = 2.0
FIRST_CALL_MS = 1.0

Frames = Callable[[Iterable[Any], str], tuple[int, int, int]]  # measure.frames_of's signature


class OffloadTrace:
    """Everything offloaded, raw: bytes, tensors and those a frame codec would frame per block,
    host time per tensor (raw: what frames add is measured apart). ``ctx`` is the step's
    storm.offload; ``collect()`` after it reads the Trace."""

    def __init__(self, hooks: BlockHooks, options: dict[str, Any], frames_of: Frames, model: nn.Module | None = None):
        hooks.recompute(set())
        self.hooks, self.frames_of = hooks, frames_of
        # the frame codec a compressed plan's steps take: the user's, else auto (phases.plan_context)
        self.frame_setting = options["codec"] if options.get("codec") in FRAME_CODECS else "auto"
        self.outside = OutsideSaves(hooks.blocks, model)
        self.ctx = ctx = TracedStep(self.outside, **{**options, "codec": "raw"})
        n = len(hooks.blocks)
        # (pack s, storages offloaded) when each block call started and ended, and which block each
        # call was: a step may run the blocks in more than one forward before its backward. The
        # step's storages, in saving order, give each block's bytes and which a frame codec would
        # frame: not the offloaded-bytes counter, which a store's refusal (a full pool) takes back later
        self.marks: list[tuple[float, int]] = []
        self.called: list[int] = []
        self.inputs, self.grads = [0] * n, [0] * n
        self.arg_storages: list[dict[int, int]] = [{} for _ in range(n)]  # per block: its tensors' storages (Shared)
        self.arg_keys: list[list[int | None]] = [[] for _ in range(n)]  # per block: its first call's, by position
        self.shared = Shared()

        def mark() -> None:
            self.marks.append((ctx.stats.pack_s, len(ctx.saves)))

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            mark()
            self.called.append(i)
            self.outside.block_starts()
            given = call_leaves(args, kwargs)  # keyword arguments' tensors too: Recompute saves them
            # each forward's call keeps its own inputs where the block is recomputed
            self.inputs[i] += sum(a.untyped_storage().nbytes() for a in given if isinstance(a, torch.Tensor))
            storages, keys = self.shared.called_with(given)
            self.arg_storages[i].update(storages)
            if not self.arg_keys[i]:
                self.arg_keys[i] = keys
            # gradients already there (not set to None between steps) are not allocated by the step,
            # and a second forward's call allocates none of its own
            if hooks.calls[i] <= 1:
                self.grads[i] = sum(q.numel() * q.element_size() for q in m.parameters()
                                    if q.requires_grad and q.grad is None)

        def post(i: int, m: nn.Module, args: Any, out: Any) -> None:
            mark()
            self.outside.block_ends()

        hooks.hook(pre, post)

    def release(self) -> None:
        """Take the trace's hooks off the blocks and the code around them."""
        self.hooks.unhook()
        self.outside.stop()  # where the step's context was never exited

    def collect(self) -> Trace | None:
        """The Trace; None where the step did not run every block once in each of its forwards,
        in order, or its forward raised (a batch skipped after an error past the blocks saved
        less than a step does): trace again. Of a step of more forwards, each block's figures are
        its calls' together: the plan decides per block, for all of them."""
        self.release()
        ctx, marks, n = self.ctx, self.marks, len(self.hooks.blocks)
        if not ctx.completed:
            log.warning("storm.plan: the traced step's forward raised; tracing again")
            return None
        st = ctx.stats
        if not marks and ctx.saves:  # the blocks ran without their hooks, inside a graph compiled before them
            warn_blocks_whole_graph()
        forwards = len(self.called) // n
        if not forwards or self.called != list(range(n)) * forwards:
            log.warning("storm.plan: the traced step did not run every block once in each forward, in the order "
                        "given (%s); a plan needs each of them called so, with grad enabled; tracing again",
                        _how_ran(self.called, n))
            return None
        ctx.synchronize()  # every copy settled: the store's refusals are counted
        order = ctx.saves
        offset = [0]  # bytes saved before each storage of the step
        for stored in order:
            offset.append(offset[-1] + stored.nbytes)
        calls = list(zip(marks[::2], marks[1::2]))  # call c * n + i: block i in forward c
        blocks = []
        for i in range(n):
            spans = [(calls[c * n + i][0][1], calls[c * n + i][1][1]) for c in range(forwards)]
            framed, framed_bytes, frame_bytes = (sum(f) for f in zip(*(self.frames_of(order[s0:s1], self.frame_setting)
                                                                      for s0, s1 in spans)))
            storages = self.arg_storages[i]
            blocks.append(BlockTrace(sum(offset[s1] - offset[s0] for s0, s1 in spans), sum(s1 - s0 for s0, s1 in spans),
                                     self.inputs[i], grad_bytes=self.grads[i], framed=framed,
                                     framed_bytes=framed_bytes, frame_bytes=frame_bytes,
                                     input_tensors=sum(key not in self.shared for key in storages),
                                     shared_inputs={key: n for key, n in storages.items() if key in self.shared},
                                     shared_at={j: key for j, key in enumerate(self.arg_keys[i])
                                                if key is not None and key in self.shared}))
        device = device_of(self.hooks.blocks)
        d2h, h2d = link_bandwidth(device)
        # frames are timed only where some tensor would be framed: their kernels compile at first use
        frame_ms, frame_device_ms = frame_costs(device) if any(b.framed for b in blocks) else (0.0, 0.0)
        # the median block's: the first offload of a process also sets up the pinned pool
        per_tensor = [(end[0] - start[0]) / (end[1] - start[1]) for start, end in calls if end[1] > start[1]]
        host_s = statistics.median(per_tensor) if per_tensor else st.pack_s / max(1, st.offloaded)
        store_bytes = None
        if st.offloaded_bytes < offset[-1]:  # the store refused some (pool full, quota): plans stay within
            store_bytes = st.offloaded_bytes
            log.warning("storm.plan: the store took %.1f of the %.1f MiB the traced step offloaded (%s); plans "
                        "offload at most that. A larger pool_size (or stormd pool) lets them offload more",
                        store_bytes / MiB, offset[-1] / MiB, ", ".join(f"{v} {k}" for k, v in st.kept.items()
                                                                       if k in (Keep.POOL_FULL, Keep.QUOTA,
                                                                                Keep.STORE_ERROR)))
        after = [stored.nbytes for stored in order[marks[-1][1]:]]
        early = sum(after[:after.index(max(after))]) if after else 0  # before the largest (held.after_kept)
        # between the first block's start and the last one's end, outside the blocks
        inside = sum(offset[end[1]] - offset[start[1]] for start, end in calls)
        between = offset[marks[-1][1]] - offset[marks[0][1]] - inside
        before_modules, between_modules, after_modules = self.outside.by_module()
        # what a budget offloads up to block i: the step's saves before it, and in each later forward
        # those of the blocks before it (the budget takes the step's first bytes, forward after forward)
        offloaded_before = [offset[calls[i][0][1]] + sum(offset[calls[c * n + i][0][1]] - offset[calls[c * n][0][1]]
                                                         for c in range(1, forwards)) for i in range(n)]
        return Trace(blocks, offset[marks[0][1]], offset[-1] - offset[marks[-1][1]], offloaded_before,
                     2e3 * host_s, frame_ms, frame_device_ms, d2h_GBps=d2h, h2d_GBps=h2d, store_bytes=store_bytes,
                     below_min_bytes=st.kept.get(Keep.SMALL, 0),
                     after_early_bytes=early, between_bytes=between, before_modules=before_modules,
                     between_modules=between_modules, after_modules=after_modules, forwards=forwards)


class PlanStep(Offload):
    """The storm.offload context of a step storm.plan runs other than a full offload's: one that offloads
    every save (its budget None) does so within the limits the plan gives it, not following a room of
    full offload's (hooks.Offload.full_offload), and prefetches what the plan's hooks allow as backward
    reaches each block, not what the markers past its budget measure before (hooks.Offload.paced):
    a language model's loss unpacks its first marker at the step's peak, after the model's output
    was let go of, and the marker read that as room backward had made."""

    full_offload = False
    paced = True


class TracedStep(PlanStep):
    """The offload trace's storm.offload context: while it is entered, ``outside`` watches the
    modules outside the blocks, so that their hooks come off with the step (and a planner closed
    before the trace is read leaves none on the model)."""

    def __init__(self, outside: "OutsideSaves", **options: Any):
        super().__init__(**options)
        self.outside = outside

    def __enter__(self) -> "TracedStep":
        super().__enter__()
        self.outside.start(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.outside.stop()
        super().__exit__(*exc)


@dataclasses.dataclass
class _Call:
    """A call of a module outside the blocks, in progress: what its own code saved (before the
    first block, between blocks, after the last) and what the modules called inside it did."""

    module: nn.Module
    blocks_started: int  # blocks started before it: it holds blocks where more have started by its end
    own: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    within: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)


class OutsideSaves:
    """Which modules outside the blocks saved what in the offload trace, by the model's own
    qualified names (``conv1``, ``decoder.up1``, ``lm_head``), so that explain() tells a CNN's
    stem or a UNet's decoder by name. Each save counts for the outermost module that holds no
    block (``decoder.up1``, not its conv); a module that holds blocks keeps only what its own
    code saved (``decoder (own code)``: a concatenation in its forward), and so does the model,
    for what it saved outside any submodule (the loss in its forward or, under a framework's
    step, in its training step). Without the model nothing is named: only its modules are
    hooked, and torch's global module hooks instead would warn at every ``torch.compile``d
    block's call while they are on and recompile it after. The hooks are on only while the
    step's context is entered (TracedStep)."""

    def __init__(self, blocks: list[nn.Module], model: nn.Module | None):
        inside = {id(m) for b in blocks for m in b.modules()}
        # the model itself is left out: storm.enable enters the step from its pre-hook, too late
        # for a hook put on it then, and what it saves itself counts apart anyway
        named = [] if model is None else [(name, m) for name, m in model.named_modules()
                                          if name and id(m) not in inside]
        self._modules = [m for _, m in named]
        self._names = {id(m): name for name, m in named}
        self._model = "" if model is None else type(model).__name__
        self._blocks = len(blocks)
        self._hooks: list[Any] = []
        self._ctx: Offload | None = None
        self._thread: int | None = None  # the step's: a module called by another thread is not its
        self._seen = 0                   # the step's saves read so far
        self._started = self._ended = 0  # blocks started and ended
        self._calls: list[_Call] = []
        self._own = [0, 0, 0]  # saved outside every hooked module: the model's own code
        self._done: list[tuple[str, list[int]]] = []

    def start(self, ctx: Offload) -> None:
        """Watch the step ``ctx`` runs, entered now in this thread."""
        self._ctx, self._thread = ctx, threading.get_ident()
        for m in self._modules:
            self._hooks.append(m.register_forward_pre_hook(self._enter))
            self._hooks.append(m.register_forward_hook(self._leave, always_call=True))

    def stop(self) -> None:
        """The step's forward has ended (or never ran): the hooks come off, what is open is closed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._ctx is not None:
            self._settle()
            while self._calls:
                self._close(self._calls.pop())
            self._ctx = None

    def block_starts(self) -> None:
        self._settle()
        if self._ended and not self._ended % self._blocks:  # another forward of the step: not after the blocks
            for saved in self._sizes():
                saved[1], saved[2] = saved[1] + saved[2], 0
        self._started += 1

    def block_ends(self) -> None:
        self._settle()  # the block's saves, which are its own: the trace counts them
        self._ended += 1

    def by_module(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[str, int]]]:
        """(name, bytes) saved before the first block, between blocks and after the last, largest first."""
        done = [*self._done, (f"{self._model} (own code)", self._own)] if self._model else []
        sides: list[dict[str, int]] = [{}, {}, {}]
        for name, saved in done:
            for side, nbytes in zip(sides, saved):
                if nbytes:
                    side[name] = side.get(name, 0) + nbytes
        before, between, after = (sorted(side.items(), key=lambda item: -item[1]) for side in sides)
        return before, between, after

    def _sizes(self) -> list[list[int]]:
        """Every [before, between, after] kept so far."""
        calls = [(c.own, *(saved for _, saved in c.within)) for c in self._calls]
        return [self._own, *(saved for _, saved in self._done), *(saved for call in calls for saved in call)]

    def _settle(self) -> None:
        """The bytes saved since the last call of this: the open module's own, or the model's,
        outside the blocks (a block's are its own)."""
        if self._ctx is None:
            return
        saves = self._ctx.saves
        nbytes = sum(s.nbytes for s in saves[self._seen:])
        self._seen = len(saves)
        if self._started > self._ended:
            return
        side = 0 if not self._started else 1 if self._ended % self._blocks else 2
        (self._calls[-1].own if self._calls else self._own)[side] += nbytes

    def _enter(self, m: nn.Module, args: Any) -> None:
        # inside a compiled region this runs at trace time only: nothing to count there
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread or self._started > self._ended:
            return
        self._settle()
        self._calls.append(_Call(m, self._started))

    def _leave(self, m: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling() or threading.get_ident() != self._thread:
            return
        if not self._calls or self._calls[-1].module is not m:  # entered inside a block, or before the step
            return
        self._settle()
        self._close(self._calls.pop())

    def _close(self, call: _Call) -> None:
        into = self._calls[-1].within if self._calls else self._done
        name = self._names[id(call.module)]
        if call.blocks_started == self._started:  # it holds no block: it and what ran inside it are one
            into.append((name, [sum(saved) for saved in zip(call.own, *(s for _, s in call.within))]))
        else:
            into += [*call.within, (f"{name} (own code)", call.own)]


class Shared:
    """The storages of the blocks' tensor arguments that more than one block was called with (a
    model passing every layer its position embeddings or mask): offloading a recomputed block's
    inputs frees none of them. Each storage gets an identity of its own, as the cost model counts
    a storage several blocks keep once: a storage counts as the same where a tensor over it (the
    base of the view passed) is still alive, as a freed one's address may be reused by another
    (T5's decoder's position bias where the encoder's was), which gets a new identity."""

    def __init__(self) -> None:
        # storage address: the first tensor called with it, and the storage's identity
        self._seen: dict[int, tuple[weakref.ref, int]] = {}
        self._shared: set[int] = set()
        self._ids = itertools.count()

    def called_with(self, args: Any) -> tuple[dict[int, int], list[int | None]]:
        """A block's call, noted: its arguments' storages (identity: bytes), and each argument's
        storage identity by position (None: not a tensor, or one without bytes)."""
        bases: dict[int, tuple[torch.Tensor, int]] = {}
        for a in args:
            if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes():
                base = a if a._base is None else a._base
                bases[a.untyped_storage().data_ptr()] = (base, a.untyped_storage().nbytes())
        storages: dict[int, int] = {}
        keys: dict[int, int] = {}  # storage address: identity
        for ptr, (base, nbytes) in bases.items():
            seen = self._seen.get(ptr)
            earlier = seen[0]() if seen is not None else None
            if seen is not None and earlier is not None and earlier.untyped_storage().data_ptr() == ptr:
                key = seen[1]
                self._shared.add(key)
            else:
                key = next(self._ids)
                self._seen[ptr] = (weakref.ref(base), key)
            storages[key] = nbytes
            keys[ptr] = key
        return storages, [keys[a.untyped_storage().data_ptr()]
                          if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes() else None for a in args]

    def __contains__(self, key: int) -> bool:
        return key in self._shared


class ComputeTrace:
    """Every block recomputed in the planner's form, nothing offloaded: forward time per block
    (``hand_over``) or, without Recompute's hand-over of saved tensors, a step whose blocks'
    backward holds their saves as a kept block's does (what it holds besides them gives the
    planner's ``kept_extra``). ``ctx`` is the step's storm.offload; ``collect()`` after it
    writes the times into the Trace."""

    def __init__(self, hooks: BlockHooks, clock: Clock, options: dict[str, Any], hand_over: bool):
        device = device_of(hooks.blocks)
        # each recompute form's first call in a process sets up its machinery (torch's checkpoint, the
        # non-reentrant form, imports torch._dynamo): paid now on a function of STORM's own, or the
        # traced forward, or the form trial's first non-reentrant step, would look that much slower
        if hand_over:  # the first compute trace: the second times nothing
            warm = torch.zeros(1, device=device, requires_grad=True)
            for reentrant in {hooks.reentrant, False}:
                Recompute(lambda t: t * 2, device, reentrant)(warm).sum().backward()
        hooks.recompute(set(range(len(hooks.blocks))), hand_over)
        self.hooks, self.clock, self.hand_over = hooks, clock, hand_over
        self.first_calls = False  # collect() found the traced forward, or a recompute, paid first calls
        n = len(hooks.blocks)
        self.starts: list[Any] = [None] * n  # as each block's first call starts
        self.ends: list[Any] = [None] * n    # and its last one ends
        self.host = [0.0] * (n + 1)  # as each block first starts, and as the last ends
        # each block's calls; the last of a step, one per forward, are its recomputes in backward:
        # what recomputing it costs (see _timing)
        self.recomputes: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
        self.untimed = [b.forward.forward for b in hooks.blocks]
        # marks as backward reaches the blocks, as it gives block 0's input its gradient (per forward:
        # the blocks' backward is done; what is before them, an embedding or a stem, is not theirs),
        # and as backward ends (where block 0's input takes no gradient)
        self.reached: list[Any] = []
        self.first_done: list[Any] = []
        self.ended: list[Any] = []
        if hand_over:
            for i, b in enumerate(hooks.blocks):
                b.forward.forward = _timing(self.untimed[i], clock, self.recomputes, i)
            hooks.at_backward_end(lambda: self.ended.append(clock.mark()), lambda: self.reached.append(clock.mark()))

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            if i == 0 and hand_over and torch.is_grad_enabled():
                given = grad_tensor((args, kwargs))
                if given is not None:
                    given.register_hook(lambda grad: self.first_done.append(clock.mark()))
            if self.starts[i] is None:  # the first forward's call: the lead is the host's within a forward
                self.host[i] = clock.host()
                self.starts[i] = clock.mark()

        def post(i: int, m: nn.Module, args: Any, out: Any) -> None:
            self.ends[i] = clock.mark()
            if i == n - 1:
                self.host[n] = clock.host()

        hooks.hook(pre, post)
        self.ctx = Offload(**options, budget=0)

    def release(self) -> None:
        """Take the trace's hooks off the blocks, and its timing off their recomputes."""
        self.hooks.unhook()
        for b, forward in zip(self.hooks.blocks, self.untimed):
            b.forward.forward = forward

    def collect(self, trace: Trace, may_repeat: bool) -> bool:
        """Write the traced times into ``trace``; False where this step is to be traced again: it
        did not run every block once, its backward did not reach them, or (``may_repeat``, on a
        clock where first calls load) its forward or a block's recompute paid the process's first
        calls (``first_calls``)."""
        self.release()
        starts, ends, host, clock, n = self.starts, self.ends, self.host, self.clock, len(self.starts)
        if any(s is None for s in starts + ends):
            log.warning("storm.plan: the traced step did not run every block once (%s); a plan needs each of them "
                        "called in every forward, with grad enabled; tracing again",
                        _never_ran([i for i in range(n) if starts[i] is None or ends[i] is None]))
            return False
        if not self.hand_over:
            return True
        if not self.reached:  # a forward alone (a batch skipped after it): its last calls are no recomputes
            log.warning("storm.plan: the traced step's backward did not reach the blocks; tracing again")
            return False
        for b, calls in zip(trace.blocks, self.recomputes):  # the times of the form plans take
            b.forward_ms = sum(clock.elapsed_ms(*marks) for marks in calls[-trace.forwards:])
        trace.forward_host_ms = (host[n] - host[0]) * 1e3
        trace.forward_device_ms = clock.elapsed_ms(starts[0], ends[-1])
        recomputing_ms = trace.blocks_forward_ms
        done = self.first_done[-1:] or self.ended  # the last to fire: the first forward's block 0
        if self.reached and done:  # from the last block's backward to the first's end, recomputes left out
            trace.backward_device_ms = max(0.0, clock.elapsed_ms(self.reached[0], done[0]) - recomputing_ms)
            if trace.forwards == 1:  # backward runs each block's recompute, then its backward, last to first
                calls = [c[-1] for c in self.recomputes]
                for i, b in enumerate(trace.blocks):
                    b.backward_ms = max(0.0, clock.elapsed_ms(calls[i][1], calls[i - 1][0] if i else done[0]))
        times = sorted(b.forward_ms for b in trace.blocks)
        typical, dearest = times[len(times) // 2], times[-1]
        first_forward = trace.forward_device_ms > FIRST_CALL_RATIO * recomputing_ms + FIRST_CALL_MS
        first_recompute = dearest > FIRST_CALL_RATIO * typical + FIRST_CALL_MS
        if clock.first_calls_load and may_repeat and (first_forward or first_recompute):
            # The traced forward was the blocks' first calls in the recompute form (no autograd in
            # the reentrant one), or backward's first recompute (the last block's) was the process's
            # first such call in backward: kernels loaded then, not in later steps. The forward's
            # would make the host look as slow as the stream and hide its lead; the recompute's
            # would charge that block many times its like blocks' cost, and plans weighed by it
            # offload where recomputing is cheaper. The planner calls no block of its own to warm
            # them (a block may have side effects), so the next step traces again.
            self.first_calls = True
            log.info("storm.plan: the traced forward took %.2f ms against %.2f ms of recomputes, the dearest "
                     "recompute %.2f ms against a median of %.2f (first calls); tracing again",
                     trace.forward_device_ms, recomputing_ms, dearest, typical)
            return False
        # the stream's time from block 0 to block i less the host's: how far ahead the host
        # is (at least: the stream may start block 0 after the host reached it)
        trace.lead_ms = [clock.elapsed_ms(starts[0], starts[i]) - (host[i] - host[0]) * 1e3 for i in range(n)]
        trace.lead_ms.append(trace.forward_device_ms - trace.forward_host_ms)
        return True


def _never_ran(missing: list[int]) -> str:
    return f"block{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} never ran"


def _how_ran(called: list[int], n: int) -> str:
    """How a traced step's calls of the ``n`` blocks (``called``, in order) differ from each
    block once per forward, in order: the blocks never called, else the first call out of place,
    else the forward left unfinished."""
    missing = [i for i in range(n) if i not in called]
    if missing:
        return _never_ran(missing)
    at = next((c for c, i in enumerate(called) if i != c % n), None)
    if at is not None:
        return f"call {at} of the step: block {called[at]} ran where block {at % n} was due"
    return f"its last forward ended after block {called[-1]}"


def _timing(forward: Callable[..., Any], clock: Clock, marks: list[list[Any]], i: int) -> Callable[..., Any]:
    """``forward`` (a recomputed block's own), each call's start and end on ``clock`` added to
    ``marks[i]``: the last call of a step (one per forward, where it ran more) is the block's
    recompute in backward (the non-reentrant form's stops early, by raising, where the block's
    last saved tensor is rebuilt), which is what recomputing it costs. Timing the recompute
    rather than forward's call, which runs without autograd, leaves out what a process's first
    such call loads (kernels that grad-mode steps never used) and needs no extra call of the block
    to pay that beforehand: a block with a side effect (a KV cache, running statistics) must run
    exactly as training runs it."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock.mark()
        try:
            return forward(*args, **kwargs)
        finally:
            marks[i].append((start, clock.mark()))

    return timed
