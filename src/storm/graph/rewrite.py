"""Where a graph compiled as one piece offloads: the partitioner that puts storm's ops
(storm/graph/ops.py) into AOTAutograd's forward and backward graphs.

torch's own partitioner (``min_cut_rematerialization_partition``) splits the joint graph first and
chooses what forward saves; this pass then takes the saved tensors that are large enough and:

- right after each is made, a ``storm::save`` starts its copy into the store (saves chained in
  the order they are made, which is the order the store's prefetch reverses in backward);
- after its last use in forward, and not before saves of ``held_bytes`` more have been made, a
  ``storm::released`` lets the graph free it: the compute stream waits for its copy there, so a
  copy runs behind forward by at most about ``held_bytes`` before forward waits for it;
- forward returns the released token in its place, and backward, before its first use, loads it.

The last ``held_bytes`` of saves stay on the device, as the budget's later saves do in eager mode:
backward needs them first, and their copies would not be done before forward ends. Saves of
symbolic shape (dynamic shapes) stay too: their size and strides are not known when the graph is
rewritten.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import fx
from torch._functorch.partitioners import get_default_op_list, min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..policy import DEFAULT_MIN_BYTES
from ..saved import DEFAULT_MAX_HELD_BYTES
from . import ops

log = logging.getLogger("storm")


@dataclass(frozen=True)
class GraphOptions:
    """``mode``, ``socket``, ``pool_size``: the store, as storm.offload's options say; ``min_bytes``:
    smaller saves stay; ``held_bytes``: how far copies may run behind forward (and the last saves
    that stay); ``budget``: offload at most this many bytes a forward, earliest saves first;
    ``memory_budget``: torch's activation_memory_budget for this partitioner's min-cut (None: the
    global config's)."""

    mode: str = "auto"
    socket: str | None = None
    pool_size: int | None = None
    min_bytes: int = DEFAULT_MIN_BYTES
    held_bytes: int = DEFAULT_MAX_HELD_BYTES  # storm.offload's bound on bytes waiting for their copy
    budget: int | None = None
    memory_budget: float | None = None


class Partitioner(CustomPartitionerFn):
    """torch's partitioner, then storm's offloading. Set it as inductor's ``custom_partitioner_fn``
    (storm.partitioner() makes one)."""

    def __init__(self, options: GraphOptions):
        self.options = options

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        # torch's selective recompute at this partitioner's own budget: being in the options, it is
        # in uuid(), so the compiled graph is cached under it, where a global config change is not
        # (dynamo reuses a graph compiled under another budget for a second model of the same code)
        budget = self.options.memory_budget
        within = contextlib.nullcontext() if budget is None else \
            torch._functorch.config.patch(activation_memory_budget=budget)
        with within:
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        offload_saves(fw, bw, kwargs["num_fwd_outputs"], self.options)
        return fw, bw

    def uuid(self) -> str:
        """Compiled graphs are cached under this: storm's ops and pass, and the options."""
        h = hashlib.sha256(repr(self.options).encode())
        for f in (Path(ops.__file__), Path(__file__)):
            h.update(f.read_bytes())
        return h.hexdigest()


@dataclass
class Save:
    node: fx.Node       # the saved tensor, in forward
    nbytes: int         # of its memory, counted at the first save of that memory (views share it)
    last_use: fx.Node   # after which forward no longer reads it
    release_after: fx.Node | None = None


def offload_saves(fw: fx.GraphModule, bw: fx.GraphModule, num_user_outputs: int, options: GraphOptions) -> list[str]:
    """Rewrite ``fw`` and ``bw`` in place; returns the names of the saves offloaded."""
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    position = {n: i for i, n in enumerate(fw.graph.nodes)}
    returned = {_root(o) for o in outputs[:num_user_outputs] if isinstance(o, fx.Node)}
    saves: list[Save] = []
    stored: set[fx.Node] = set()  # roots saved already: a second view of one moves no more bytes
    for n in sorted(set(outputs[num_user_outputs:]), key=position.__getitem__):
        root = _root(n)
        if root is None or root in returned:
            continue
        if not _static(n, root):
            _warn_symbolic()
            continue
        if not _offloadable(n, root, bw_inputs, options.min_bytes):
            continue
        saves.append(Save(n, 0 if root in stored else _nbytes(root), _last_use(n, position)))
        stored.add(root)
    chosen = _choose(saves, options)
    for s in chosen:
        s.release_after = max(s.last_use, s.release_after, key=position.__getitem__)
    saved: dict[fx.Node, fx.Node] = {}   # a chosen tensor -> its storm::save
    tokens: dict[fx.Node, fx.Node] = {}  # -> its storm::released, which forward returns in its place
    waiting: list[Save] = []             # saved and not yet released

    def release(s: Save) -> fx.Node:
        at = saved[s.node] if s.release_after is s.node else s.release_after  # after its save, at least
        with fw.graph.inserting_after(at):
            tokens[s.node] = _call(fw.graph, torch.ops.storm.released.default, (saved[s.node], s.node))
        return tokens[s.node]

    previous: fx.Node | None = None
    for s in chosen:
        # The saves after a release take its token: inductor moves a node whose only user is the
        # graph's output to just before the output (reorder_for_locality), which would free
        # nothing before forward's end; a later save's input is where it has to run instead.
        due = [w for w in waiting if position[w.release_after] <= position[s.node]]
        waiting = [w for w in waiting if w not in due]
        after = [release(w) for w in due]
        anchor = s.node
        while anchor.next in after:  # releases placed right after this tensor come before its save
            anchor = anchor.next
        with fw.graph.inserting_after(anchor):
            previous = saved[s.node] = _call(fw.graph, torch.ops.storm.save.default,
                                             (s.node, previous, after, options.mode, options.socket, options.pool_size,
                                              options.held_bytes))
        waiting.append(s)
    for s in waiting:  # released after the last save: where forward's end may take them
        release(s)
    outputs = [tokens.get(o, o) for o in outputs]
    bw_position = {n: i for i, n in enumerate(bw.graph.nodes)}  # the placeholders' users are all there before
    for s in chosen:
        _load_before_first_use(bw.graph, bw_position, bw_inputs[s.node.name], s.node.meta["val"])
    output.args = (tuple(outputs),)
    for g in (fw, bw):
        g.graph.lint()
        g.recompile()
    return [s.node.name for s in chosen]


def _choose(saves: list[Save], options: GraphOptions) -> list[Save]:
    """The saves to offload, in the order they are made, each with the save after which it may be
    released at the earliest (``release_after``).

    Without a budget, every save but the last ``held_bytes``; with one, the earliest saves up to it.
    A save is released once ``held_bytes`` more have been made, and not before the share of forward
    its copy needs has passed: the link copies the chosen saves one after another, and a budget is
    taken to fill forward's time on it (the bytes it carries while forward runs), so the copy of the
    saves through one ends about as far into forward, by bytes made, as they are into the budget.
    Releasing earlier would make forward wait for the link there."""
    made = list(itertools.accumulate((s.nbytes for s in saves), initial=0))  # made[i]: bytes of saves[:i]
    chosen: list[tuple[int, int]] = []  # (save, the save after which it goes at the earliest)
    offloaded = 0
    for k, s in enumerate(saves):
        end = bisect.bisect_left(made, made[k + 1] + options.held_bytes)  # saves[k + 1:end] make held_bytes
        if end == len(made):
            if options.budget is None:
                break  # this save and the later ones are the last held_bytes: they stay
            end = len(saves)
        if options.budget is not None and offloaded + s.nbytes > options.budget:
            break
        offloaded += s.nbytes
        chosen.append((k, end - 1))
    copied = 0
    for k, j in chosen:
        copied += saves[k].nbytes
        share = bisect.bisect_left(made, made[-1] * copied / offloaded) if offloaded else 0
        saves[k].release_after = saves[max(j, share - 1, k)].node
    return [saves[k] for k, _ in chosen]


def _offloadable(n: fx.Node, root: fx.Node, bw_inputs: dict[str, fx.Node], min_bytes: int) -> bool:
    """A tensor forward makes, or a view of one (not an input such as a parameter, nor a view of
    one), whose memory is at least ``min_bytes`` and not empty, that backward uses; of static shape
    (``_static``, which the caller checks first: it warns where not). Empty tensors carry nothing
    to move, and among them are storm's own tokens, which a block compiled apart
    (nested_compile_region) returns to the graph around it."""
    return (root.op == "call_function" and n.name in bw_inputs and bool(bw_inputs[n.name].users)
            and _nbytes(root) >= max(min_bytes, 1))


def _static(n: fx.Node, root: fx.Node) -> bool:
    """Whether ``n`` and the memory it is a view of are tensors of sizes known when compiling (not
    symbolic: a graph compiled for dynamic shapes)."""
    val, base = n.meta.get("val"), root.meta.get("val")
    return isinstance(val, torch.Tensor) and isinstance(base, torch.Tensor) \
        and all(type(d) is int for t in (val, base) for d in (*t.shape, *t.stride(), t.storage_offset()))


@functools.cache
def _warn_symbolic() -> None:
    """Once per process: a graph's saves of symbolic shape stay on the device."""
    log.warning("storm.partitioner: a graph compiled for dynamic shapes (torch.compile(dynamic=True), or "
                "recompiled so after a batch of another size, such as an epoch's last) keeps its saves of "
                "symbolic shape on the device: storm offloads saves of static shape alone. Mark the varying "
                "dimension static (torch._dynamo.mark_static) or compile with dynamic=False to offload them")


def _root(n: fx.Node) -> fx.Node | None:
    """The node whose memory ``n`` is: itself, or what it is a view (or detach, alias) of, through
    the outputs of a view op of several (split, chunk, unbind: each a view of its input); None
    where that is not known (a call of something other than an ATen op or getitem)."""
    while n.op == "call_function":
        if n.target is operator.getitem:  # an output of its own, or of a view op's list of views
            source = n.args[0] if n.args else None
            if not isinstance(source, fx.Node) or not _aliases(source):
                return n
            n = source
        if getattr(n.target, "_schema", None) is None:
            return None
        if not _aliases(n):
            return n
        if not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    return n


def _aliases(n: fx.Node) -> bool:
    """Whether ``n`` is an ATen call whose output is a view of its input or an alias of it
    (detach, alias): the same memory, which forward reads through it too."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    return schema is not None and (_op_types().is_view(n) or any(r.alias_info is not None for r in schema.returns))


_op_types = functools.cache(get_default_op_list)  # torch's kinds of ops (views among them), built once


def _nbytes(n: fx.Node) -> int:
    val = n.meta["val"]
    return val.numel() * val.element_size()


def _last_use(n: fx.Node, position: dict[fx.Node, int]) -> fx.Node:
    """The last node of forward that reads ``n``, through views and aliases of it too (the graph's
    output aside)."""
    last, pending = n, [n]
    while pending:
        for user in pending.pop().users:
            if user.op == "output":
                continue
            if position[user] > position[last]:
                last = user
            if _aliases(user):
                pending.append(user)
    return last


def _call(graph: fx.Graph, op: Any, args: tuple[Any, ...]) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = torch.empty(0, dtype=torch.uint8)
    return node


def _load_before_first_use(graph: fx.Graph, position: dict[fx.Node, int], placeholder: fx.Node,
                           val: torch.Tensor) -> None:
    """``placeholder`` brings a token now: load the tensor before its first use, and use that."""
    first = min(placeholder.users, key=position.__getitem__)
    with graph.inserting_before(first):
        loaded = graph.call_function(torch.ops.storm.load.default,
                                     (placeholder, list(val.shape), list(val.stride()), val.dtype, val.device))
    loaded.meta["val"] = val
    placeholder.replace_all_uses_with(loaded, delete_user_cb=lambda user: user is not loaded)
    placeholder.meta["val"] = torch.empty(0, dtype=torch.uint8)
