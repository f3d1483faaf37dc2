"""What the device holds as backward reaches each block under a plan (``moments``), and its
worst moment (``predicted_peak``): the cost model's arithmetic of memory, on a recorded Trace
(model.py), which choose() runs for every plan it weighs. docs/planner.md ("How a plan is
chosen") explains the terms.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

from .records import BlockTrace, Trace


def kept_bytes(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int],
               inputs_offloaded: int = 0) -> list[int]:
    """Per block, what it keeps on the device from forward to its backward: nothing offloaded,
    of a block recomputed with its inputs offloaded the inputs other blocks were called with too,
    a recomputed block's inputs, a kept block's saves. A storage that several blocks keep (a
    position bias every layer is called with) counts once, at the first of them: it stays until
    backward, which reaches the blocks last to first, is done with that one."""
    return holdings(trace, offloaded, recomputed, inputs_offloaded)[0]


def holdings(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int],
              inputs_offloaded: int) -> tuple[list[int], list[int]]:
    """Per block, kept_bytes, and of that the shared inputs it is the first block to keep (there
    through its own backward too)."""
    return _holdings(Figures.of(trace), offloaded, recomputed, inputs_offloaded)


@dataclasses.dataclass(frozen=True)
class Figures:
    """The blocks' figures that moments() adds up, read off a trace once: choose() takes the
    moments of thousands of plans of one trace (a plan per blocks offloaded and inputs offloaded,
    each recomputing blocks until it fits), and reading them off the blocks each time was most
    of its time."""

    saved: tuple[int, ...]
    fetched: tuple[int, ...]  # fetched_inputs
    # per storage several blocks were called with (shared_inputs' keys), those blocks in order, each
    # with its bytes
    sharing: dict[int, tuple[tuple[int, int], ...]]
    grad: tuple[int, ...]
    backward_extra: tuple[int, ...]

    @staticmethod
    def of(trace: Trace) -> "Figures":
        blocks, sharing = trace.blocks, {}
        for i, b in enumerate(blocks):
            for key, n in b.shared_inputs.items():
                sharing[key] = sharing.get(key, ()) + ((i, n),)
        return Figures(tuple(b.saved_bytes for b in blocks), tuple(fetched_inputs(b) for b in blocks), sharing,
                       tuple(b.grad_bytes for b in blocks), tuple(b.backward_extra for b in blocks))

    def offloaded_once(self, offloaded: int, end: int) -> list[tuple[int, int, int]]:
        """The storages several blocks are called with that only blocks recomputed with their inputs
        offloaded (blocks[offloaded:end]) are: the step offloads each once (shared_staying), and
        fetches it as backward reaches the last of those blocks, there until the first is done.
        (first block, last block, bytes) of each. One an offloaded block is called with too is
        among that block's saves, and sent there."""
        return [(having[0][0], having[-1][0], having[0][1]) for having in self.sharing.values()
                if offloaded <= having[0][0] and having[-1][0] < end]


def _holdings(f: Figures, offloaded: int, recomputed: set[int] | frozenset[int],
              inputs_offloaded: int) -> tuple[list[int], list[int]]:
    """holdings() of the trace ``f`` was read off."""
    n, end = len(f.saved), offloaded + inputs_offloaded
    holds = [offloaded <= i and (i < end or i in recomputed) for i in range(n)]  # it keeps (some of) its inputs
    first = [0] * n
    for having in f.sharing.values():
        if having[-1][0] < end:  # used by offloading blocks alone: offloaded once (shared_staying), not kept
            continue
        i, nbytes = next(((i, nbytes) for i, nbytes in having if holds[i]), (None, 0))
        if i is not None:
            first[i] += nbytes
    kept = [0 if i < offloaded else f.fetched[i] * (i >= end) + first[i] if holds[i] else f.saved[i]
            for i in range(n)]
    return kept, first


def without_backward_extras(trace: Trace) -> Trace:
    """``trace`` as the offload trace made it, before the compute trace measured each block's
    backward_extra: what the model predicts from the saves and one figure of besides alone."""
    return dataclasses.replace(trace, blocks=[dataclasses.replace(b, backward_extra=0) for b in trace.blocks])


def fetched_inputs(b: BlockTrace) -> int:
    """What offloading a recomputed block's inputs sends and fetches back: those no other block
    was called with."""
    return b.input_bytes - b.shared_input_bytes


def shared_staying(trace: Trace, end: int) -> set[int]:
    """Of the storages several blocks are called with (shared_inputs' keys), those a block from
    ``end`` on is called with too: the blocks before ``end`` that offload their inputs keep them on
    the device, since that block keeps them alive anyway (wiring.py). The others, used by
    offloading blocks alone, are offloaded once."""
    last = {key: i for i, b in enumerate(trace.blocks) for key in b.shared_inputs}
    return {key for key, i in last.items() if i >= end}


def offloaded_per_block(trace: Trace, offloaded: int, inputs_offloaded: int = 0) -> list[int]:
    """What each offloading block sends: the saves of blocks[:offloaded], the fetched inputs of the
    next ``inputs_offloaded`` (recomputed); one block's worth of these is the plans' smaller copy
    queue (Offloading.of) and their prefetch window where one is given (_plans)."""
    blocks = trace.blocks
    return ([b.saved_bytes for b in blocks[:offloaded]]
            + [fetched_inputs(b) for b in blocks[offloaded:offloaded + inputs_offloaded]])


def after_kept(trace: Trace, offloaded: int, inputs_offloaded: int = 0) -> int:
    """What of the saves after the blocks, and between them, stays on the device: of those after,
    all but the early ones where every block offloads its saves or inputs, else all; those between
    (in a step of more forwards, the earlier forwards' heads and losses, the later ones' embeddings)
    are counted as kept, which a plan that offloads them only lowers."""
    return (trace.between_bytes + trace.after_bytes
            - trace.after_early_bytes * (offloaded + inputs_offloaded == len(trace.blocks)))


def predicted_peak(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int, *,
                   grads: bool = True, kept_extra: int = 0, inputs_offloaded: int = 0, start_extra: int = 0,
                   prefetch: int = 0) -> int:
    """Saved bytes (and with ``grads`` parameter gradients) on the device at the worst moment of
    backward when blocks[:offloaded] are offloaded, the next ``inputs_offloaded`` recomputed with
    their inputs offloaded and ``recomputed`` recomputed; a kept block's backward also holds
    ``kept_extra``, and backward's start ``start_extra`` (moments)."""
    return max(moments(trace, offloaded, recomputed, in_flight_bytes, grads=grads, kept_extra=kept_extra,
                       inputs_offloaded=inputs_offloaded, start_extra=start_extra, prefetch=prefetch))


def moments(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int, *,
            grads: bool, kept_extra: int = 0, inputs_offloaded: int = 0, start_extra: int = 0,
            prefetch: int = 0) -> list[int]:
    """What the device holds as backward reaches each block i (what the blocks before i keep,
    block i's own saves, kept, rebuilt or fetched, and the gradients of blocks i.. by then,
    plus ``kept_extra`` where block i is kept: autograd holds a kept block's saves until each
    node that saved them ends, beside the node's temporaries, where a recomputed or offloaded
    block's are handed over and dropped as the node takes them; a block recomputed with its
    inputs offloaded also holds its fetched inputs, and with ``grads`` (peak=, which counts the
    step's temporaries too; a budget counts saves alone) each block its ``backward_extra``), and
    last at backward's start, forward's end
    included (every kept save, offloaded bytes still in flight, and ``start_extra``: what the
    loss's and the head's backward hold beyond what a block's backward holds besides its saves,
    which may be less: the logits' gradients of a language model are larger than any block's
    temporaries). ``prefetch``, the prefetch window's part of ``in_flight_bytes``, is not there
    at backward's start: prefetch waits for backward's first unpack of an offloaded save, and
    backward's start peaks before it, also where the head's early saves went (measured on every
    zoo cell whose plans offload every block's saves or inputs; docs/planner.md)."""
    return moments_of(trace, Figures.of(trace), offloaded, recomputed, in_flight_bytes, grads=grads,
                    kept_extra=kept_extra, inputs_offloaded=inputs_offloaded, start_extra=start_extra,
                    prefetch=prefetch)


def moments_of(trace: Trace, f: Figures, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int,
             *, grads: bool, kept_extra: int, inputs_offloaded: int, start_extra: int, prefetch: int) -> list[int]:
    """moments() of ``trace``, whose figures ``f`` are (Figures.of: a Scenario reads them once)."""
    n, end = len(f.saved), offloaded + inputs_offloaded
    kept, first = _holdings(f, offloaded, recomputed, inputs_offloaded)
    before = trace.before_bytes * (end == 0) + in_flight_bytes
    start = (before - prefetch + sum(kept) + after_kept(trace, offloaded, inputs_offloaded)
             + f.grad[-1] * grads + start_extra)
    # as backward reaches block i: what the blocks before it keep, and the gradients of blocks i..
    held_before = itertools.accumulate(kept[:-1], initial=before)
    allocated = itertools.accumulate(f.grad[:-1], operator.sub, initial=sum(f.grad)) if grads else itertools.repeat(0)
    # a kept block's kept_extra; a block recomputed with its inputs offloaded, its fetched inputs
    extra = [0] * offloaded + list(f.fetched[offloaded:end]) + [
        0 if i in recomputed else kept_extra for i in range(max(offloaded, end), n)]
    for first_block, last_block, nbytes in f.offloaded_once(offloaded, end):  # fetched once, for them all
        for i in range(first_block, last_block + 1):
            extra[i] += nbytes
    backward_extra = f.backward_extra if grads else itertools.repeat(0)
    # the shared inputs it is the first to keep are there through its own backward too
    held = [b + fi + sv + a + e + x
            for b, fi, sv, a, e, x in zip(held_before, first, f.saved, allocated, extra, backward_extra)]
    return held + [start]
