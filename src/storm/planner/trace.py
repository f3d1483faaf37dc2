"""The traced steps that fill a ``Trace``: the offload trace (everything offloaded, raw: bytes,
tensors, frames and host time per block) and the compute trace (every block recomputed, nothing
offloaded: what recomputing each costs, and how far the host runs ahead of the compute stream).
Each is the least-memory step of its kind, and calls no block beyond the step's own calls and
their recomputes. docs/planner.md ("What is traced") explains what each measures and why.
"""

from __future__ import annotations

import logging
import statistics
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..hooks import Offload
from ..policy import Keep
from ..recompute import Recompute
from .measure import frame_costs, link_bandwidth
from .model import BlockTrace, Trace
from .trial import Clock
from .wiring import BlockHooks, device_of, input_signature, warn_blocks_whole_graph

log = logging.getLogger("storm")

MiB = 1 << 20
# A compute trace whose forward took this many times the blocks' own recomputes (and FIRST_CALL_MS more)
# paid first calls: traced again, once
FIRST_CALL_RATIO = 2.0
FIRST_CALL_MS = 1.0

Frames = Callable[[Iterable[Any]], tuple[int, int, int]]  # measure.frames_of's signature


class OffloadTrace:
    """Everything offloaded, raw: bytes, tensors and those a frame codec would frame per block,
    host time per tensor (raw: what frames add is measured apart). ``ctx`` is the step's
    storm.offload; ``collect()`` after it reads the Trace."""

    def __init__(self, hooks: BlockHooks, options: dict[str, Any], frames_of: Frames):
        hooks.recompute(set())
        self.hooks, self.frames_of = hooks, frames_of
        self.ctx = ctx = Offload(**{**options, "codec": "raw"})
        self.signature: tuple | None = None  # block 0's inputs' shapes, which the trace holds for
        n = len(hooks.blocks)
        # (pack s, storages offloaded) when each block started and ended. The step's storages, in
        # saving order, give each block's bytes and which a frame codec would frame: not the
        # offloaded-bytes counter, which a store's refusal (a full pool) takes back later
        self.marks: list[tuple[float, int]] = []
        self.inputs, self.grads = [0] * n, [0] * n
        self.arg_storages: list[dict[int, int]] = [{} for _ in range(n)]  # per block: its tensors' storages' bytes
        self.shared = Shared()

        def mark() -> None:
            self.marks.append((ctx.stats.pack_s, len(ctx.saves)))

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            mark()
            given = [*args, *tree_leaves(kwargs)]  # keyword arguments' tensors too: Recompute saves them
            self.inputs[i] = sum(a.untyped_storage().nbytes() for a in given if isinstance(a, torch.Tensor))
            self.arg_storages[i] = self.shared.called_with(given)
            # gradients already there (not set to None between steps) are not allocated by the step
            self.grads[i] = sum(q.numel() * q.element_size() for q in m.parameters()
                                if q.requires_grad and q.grad is None)
            if i == 0:
                self.signature = input_signature(args)

        hooks.hook(pre, lambda i, m, args, out: mark())

    def collect(self) -> Trace | None:
        """The Trace; None where the step did not run every block once (trace again)."""
        self.hooks.unhook()
        ctx, marks, n = self.ctx, self.marks, len(self.hooks.blocks)
        st = ctx.stats
        if not marks and ctx.saves:  # the blocks ran without their hooks, inside a graph compiled before them
            warn_blocks_whole_graph()
        if len(marks) != 2 * n:
            log.warning("storm.plan: the traced step did not run every block once; tracing again")
            return None
        ctx.synchronize()  # every copy settled: the store's refusals are counted
        order = ctx.saves
        offset = [0]  # bytes saved before each storage of the step
        for stored in order:
            offset.append(offset[-1] + stored.nbytes)
        blocks = []
        for i in range(n):
            s0, s1 = marks[2 * i][1], marks[2 * i + 1][1]
            framed, framed_bytes, frame_bytes = self.frames_of(order[s0:s1])
            storages = self.arg_storages[i]
            shared = [ptr for ptr in storages if ptr in self.shared]
            blocks.append(BlockTrace(offset[s1] - offset[s0], s1 - s0, self.inputs[i], grad_bytes=self.grads[i],
                                     framed=framed, framed_bytes=framed_bytes, frame_bytes=frame_bytes,
                                     input_tensors=len(storages) - len(shared),
                                     shared_input_bytes=sum(storages[ptr] for ptr in shared)))
        device = device_of(self.hooks.blocks)
        d2h, h2d = link_bandwidth(device)
        # frames are timed only where some tensor would be framed: their kernels compile at first use
        frame_ms, frame_device_ms = frame_costs(device) if any(b.framed for b in blocks) else (0.0, 0.0)
        # the median block's: the first offload of a process also sets up the pinned pool
        per_tensor = [(marks[2 * i + 1][0] - marks[2 * i][0]) / b.tensors for i, b in enumerate(blocks) if b.tensors]
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
        early = sum(after[:after.index(max(after))]) if after else 0  # before the largest (model.after_kept)
        return Trace(blocks, offset[marks[0][1]], offset[-1] - offset[marks[-1][1]],
                     [offset[marks[2 * i][1]] for i in range(n)], 2e3 * host_s, frame_ms, frame_device_ms,
                     d2h_GBps=d2h, h2d_GBps=h2d, store_bytes=store_bytes, after_early_bytes=early)


class Shared:
    """The storages of the blocks' tensor arguments that more than one block was called with (a
    model passing every layer its position embeddings or mask): offloading a recomputed block's
    inputs frees none of them. A storage counts as the same where a tensor over it (the base of
    the view passed) is still alive: a freed one's address may be reused by another."""

    def __init__(self) -> None:
        self._seen: dict[int, weakref.ref] = {}  # storage address: the first tensor called with it
        self._shared: set[int] = set()

    def called_with(self, args: Any) -> dict[int, int]:
        """A block's call: its arguments' storages (address: bytes), noted."""
        storages: dict[int, int] = {}
        bases: dict[int, torch.Tensor] = {}
        for a in args:
            if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes():
                ptr = a.untyped_storage().data_ptr()
                storages[ptr] = a.untyped_storage().nbytes()
                bases[ptr] = a if a._base is None else a._base
        for ptr, base in bases.items():
            seen = self._seen.get(ptr)
            earlier = seen() if seen is not None else None
            if earlier is not None and earlier.untyped_storage().data_ptr() == ptr:
                self._shared.add(ptr)
            else:
                self._seen[ptr] = weakref.ref(base)
        return storages

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._shared


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
        self.first_calls = False  # collect() found the traced forward paid the blocks' first calls
        n = len(hooks.blocks)
        self.starts: list[Any] = [None] * n
        self.ends: list[Any] = [None] * n
        self.host = [0.0] * (n + 1)  # as each block starts, and as the last ends
        # each block's last call, its recompute in backward: what recomputing it costs (see _timing)
        self.recomputes: list[tuple[Any, Any] | None] = [None] * n
        self.untimed = [b.forward.forward for b in hooks.blocks]
        if hand_over:
            for i, b in enumerate(hooks.blocks):
                b.forward.forward = _timing(self.untimed[i], clock, self.recomputes, i)

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            self.host[i] = clock.host()
            self.starts[i] = clock.mark()

        def post(i: int, m: nn.Module, args: Any, out: Any) -> None:
            self.ends[i] = clock.mark()
            if i == n - 1:
                self.host[n] = clock.host()

        hooks.hook(pre, post)
        self.ctx = Offload(**options, budget=0)

    def collect(self, trace: Trace, may_repeat: bool) -> bool:
        """Write the traced times into ``trace``; False where this step is to be traced again: it
        did not run every block once, or (``may_repeat``, on a clock where first calls load) its
        forward paid the blocks' first calls (``first_calls``)."""
        self.hooks.unhook()
        for b, forward in zip(self.hooks.blocks, self.untimed):
            b.forward.forward = forward
        starts, ends, host, clock, n = self.starts, self.ends, self.host, self.clock, len(self.starts)
        if any(s is None for s in starts + ends):
            log.warning("storm.plan: the traced step did not run every block once; tracing again")
            return False
        if not self.hand_over:
            return True
        for b, marks in zip(trace.blocks, self.recomputes):  # the times of the form plans take
            b.forward_ms = clock.elapsed_ms(*marks)
        trace.forward_host_ms = (host[n] - host[0]) * 1e3
        trace.forward_device_ms = clock.elapsed_ms(starts[0], ends[-1])
        recomputing_ms = sum(b.forward_ms for b in trace.blocks)
        if (clock.first_calls_load and may_repeat
                and trace.forward_device_ms > FIRST_CALL_RATIO * recomputing_ms + FIRST_CALL_MS):
            # The traced forward was the blocks' first calls in the recompute form (no autograd in
            # the reentrant one): kernels loaded then, not in later steps, which would make the host
            # look as slow as the stream and hide its lead. The planner calls no block of its own
            # to warm them (a block may have side effects), so the next step traces again.
            self.first_calls = True
            log.info("storm.plan: the traced forward took %.2f ms against %.2f ms of recomputes "
                     "(first calls); tracing again", trace.forward_device_ms, recomputing_ms)
            return False
        # the stream's time from block 0 to block i less the host's: how far ahead the host
        # is (at least: the stream may start block 0 after the host reached it)
        trace.lead_ms = [clock.elapsed_ms(starts[0], starts[i]) - (host[i] - host[0]) * 1e3 for i in range(n)]
        trace.lead_ms.append(trace.forward_device_ms - trace.forward_host_ms)
        return True


def _timing(forward: Callable[..., Any], clock: Clock, marks: list[Any], i: int) -> Callable[..., Any]:
    """``forward`` (a recomputed block's own), each call's start and end on ``clock`` kept in
    ``marks[i]``: the last call of a step is the block's recompute in backward (the non-reentrant
    form's stops early, by raising, where the block's last saved tensor is rebuilt), which is what
    recomputing it costs. Timing the recompute rather than forward's call, which runs without
    autograd, leaves out what a process's first such call loads (kernels that grad-mode steps
    never used) and needs no extra call of the block to pay that beforehand: a block with a side
    effect (a KV cache, running statistics) must run exactly as training runs it."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock.mark()
        try:
            return forward(*args, **kwargs)
        finally:
            marks[i] = (start, clock.mark())

    return timed
