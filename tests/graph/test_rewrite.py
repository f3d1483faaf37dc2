"""storm.graph's partitioner (storm/graph/rewrite.py) on graphs AOTAutograd traces, run as FX
code (no inductor: fast): which saves it offloads, where its ops go in forward and backward,
and that gradients stay bit for bit those of the same graphs without it."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from torch import fx
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._inductor.fx_passes.post_grad import reorder_for_locality

import storm
from storm.graph.rewrite import GraphOptions, Partitioner, Save, _choose, _last_use, _root
from storm.registry import session_for

KiB, MiB = 1 << 10, 1 << 20
SAVE, RELEASED, LOAD = torch.ops.storm.save.default, torch.ops.storm.released.default, torch.ops.storm.load.default


def chain(nbytes: list[int], **options: Any) -> list[str]:
    saves = [Save(node=f"s{i}", nbytes=n, last_use=None) for i, n in enumerate(nbytes)]  # type: ignore[arg-type]
    return [f"{s.node}<{s.release_after}" for s in _choose(saves, GraphOptions(**options))]


def test_each_save_is_released_once_held_bytes_more_are_made_and_the_last_held_bytes_stay():
    assert chain([10 * MiB] * 4, held_bytes=20 * MiB) == ["s0<s2", "s1<s3"]
    assert chain([10 * MiB] * 4, held_bytes=0) == ["s0<s0", "s1<s1", "s2<s2", "s3<s3"]
    # s1 could go after s2 by held_bytes, but the link copies s0 and s1 through forward's end
    assert chain([30 * MiB, 1 * MiB, 25 * MiB, 1 * MiB], held_bytes=20 * MiB) == ["s0<s2", "s1<s3"]
    assert chain([10 * MiB] * 4, held_bytes=40 * MiB) == []


def test_a_budget_offloads_the_earliest_saves_up_to_it_released_as_the_link_would_copy_them_in_forward():
    # the budget's 20 MiB are taken to fill forward on the link: s0's copy ends a third of the way
    # (20 of 60 MiB made), s1's at forward's end
    assert chain([10 * MiB] * 6, held_bytes=10 * MiB, budget=25 * MiB) == ["s0<s2", "s1<s5"]
    assert chain([10 * MiB] * 6, held_bytes=0, budget=60 * MiB) == [f"s{i}<s{i}" for i in range(6)]
    assert chain([10 * MiB] * 6, held_bytes=10 * MiB, budget=0) == []


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x
    for _ in range(4):
        h = torch.tanh(h @ w)
    return h.sum()


def traced(partition: Partitioner | None, dynamic: bool = False,
           fn: Any = None) -> tuple[Any, dict[str, fx.GraphModule]]:
    """``fn`` (mlp by default) through AOTAutograd with ``partition``, its graphs kept by name."""
    graphs: dict[str, fx.GraphModule] = {}

    def compiler(name: str) -> Any:
        def compile_graph(gm: fx.GraphModule, inputs: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compile_graph

    kwargs = {} if partition is None else {"partition_fn": partition}
    return aot_function(fn or mlp, compiler("fw"), compiler("bw"), dynamic=dynamic, **kwargs), graphs


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(256, 256, generator=g, requires_grad=True),
            (torch.randn(256, 256, generator=g) / 16).requires_grad_())


def grads(f: Any) -> list[torch.Tensor]:
    x, w = inputs()
    f(x, w).backward()
    return [x.grad, w.grad]


def ops_in(gm: fx.GraphModule, op: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is op]


def test_saves_go_as_made_are_released_after_their_last_use_and_load_before_their_first():
    f, graphs = traced(Partitioner(GraphOptions(mode="embedded", min_bytes=0, held_bytes=0)))
    ref, _ = traced(None)
    assert all(torch.equal(a, b) for a, b in zip(grads(f), grads(ref)))  # bit for bit
    fw, bw = graphs["fw"], graphs["bw"]
    position = {n: i for i, n in enumerate(fw.graph.nodes)}
    saves, released = ops_in(fw, SAVE), ops_in(fw, RELEASED)
    # the four tanh outputs (the last saved as a detach of it: a view, stored as its memory)
    assert len(saves) == len(released) == 4
    for i, s in enumerate(saves):
        x = s.args[0]
        between = list(fw.graph.nodes)[position[x] + 1:position[s]]
        assert all(n.target is RELEASED for n in between), "a save comes right after its tensor is made"
        assert s.args[1] is (saves[i - 1] if i else None), "each save takes the token of the one before"
        r = next(u for u in s.users if u.target is RELEASED)
        assert all(position[u] < position[r] for u in x.users if u is not r and u.op != "output")
    output = fw.graph.find_nodes(op="output")[0].args[0]
    assert not any(s.args[0] in output for s in saves), "forward returns tokens in place of offloaded tensors"
    assert all(r in output for r in released)
    bpos = {n: i for i, n in enumerate(bw.graph.nodes)}
    for load in ops_in(bw, LOAD):
        token = load.args[0]
        assert token.op == "placeholder" and list(token.users) == [load]
        assert load.users and all(bpos[u] > bpos[load] for u in load.users)
    assert len(ops_in(bw, LOAD)) == 4
    session = storm.stats("embedded")["session"]
    assert session["puts"] == 4 and session["keys"] == 0  # stored in forward, freed once backward used them


def test_a_save_read_later_through_a_detach_is_released_after_that_read():
    """A detach (or alias) of a saved tensor is its memory, as a view is: the save is stored as
    that memory, and released only after forward's last read through either."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.sin.default, (x,))
    d = g.call_function(torch.ops.aten.detach.default, (y,))
    v = g.call_function(torch.ops.aten.view.default, (y, [4]))
    z = g.call_function(torch.ops.aten.cos.default, (x,))
    w = g.call_function(torch.ops.aten.mul.Tensor, (d, z))
    g.output((w, v))
    position = {n: i for i, n in enumerate(g.nodes)}
    assert _root(d) is y and _root(v) is y and _root(z) is z
    assert _last_use(y, position) is w


def test_releases_stay_in_forward_where_inductor_moves_nodes_toward_their_users():
    """Inductor's reorder_for_locality moves a node whose users all come later to just before the
    first of them: a release whose only user were forward's output would free nothing before
    forward's end. Each release is an input of the next save instead."""
    f, graphs = traced(Partitioner(GraphOptions(mode="embedded", min_bytes=0, held_bytes=256 * KiB)))
    grads(f)
    fw = graphs["fw"]
    reorder_for_locality(fw.graph)
    nodes = list(fw.graph.nodes)
    saves, released = ops_in(fw, SAVE), ops_in(fw, RELEASED)
    assert len(saves) == 3  # the last 256 KiB stay
    early = [r for r in released if nodes.index(r) < nodes.index(saves[-1])]
    assert early == released[:2] and released[1] in saves[-1].args[2]


def test_without_room_in_the_store_the_saves_stay_as_copies_and_gradients_are_unchanged():
    f, graphs = traced(Partitioner(GraphOptions(mode="embedded", pool_size=4096, min_bytes=0, held_bytes=0)))
    ref, _ = traced(None)
    assert all(torch.equal(a, b) for a, b in zip(grads(f), grads(ref)))
    assert len(ops_in(graphs["fw"], SAVE)) == 4
    store = session_for("embedded", None, 4096).mover.request("STATS").result(10)["node"]
    assert store["errors"] == {"TOO_LARGE": 4} and store["keys"] == 0


@pytest.mark.parametrize("options, named", [({"mode": "local"}, "mode"), ({"socket": "ftp://host"}, "socket"),
                                            ({"held_bytes": -1}, "held_bytes"),
                                            ({"budget": "lots"}, "budget"), ({"min_bytes": 1.5}, "min_bytes"),
                                            ({"memory_budget": 0}, "memory_budget"),
                                            ({"memory_budget": 1.5}, "memory_budget"),
                                            ({"memory_budget": "half"}, "memory_budget"),
                                            ({"memory_budget": True}, "memory_budget")])
def test_bad_options_are_named_with_what_is_accepted(options, named):
    with pytest.raises(ValueError, match=named):
        storm.partitioner(**options)



def ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (torch.relu(x @ w1) @ w2).sin().sum()


def test_memory_budget_is_torch_s_selective_recompute_for_these_graphs_alone_then_storm_offloads_what_it_saves():
    """memory_budget runs torch's min-cut at that activation_memory_budget for this partitioner's
    graphs only (the global config untouched), and is in its cache key; storm offloads what that
    min-cut saves. Gradients bit for bit those of the graphs without storm."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(64, 64, generator=g), torch.randn(64, 512, generator=g), torch.randn(512, 64, generator=g)]

    def run(partition: Partitioner | None) -> tuple[list[torch.Tensor], fx.GraphModule]:
        f, graphs = traced(partition, fn=ffn)
        leaves = [a.clone().requires_grad_() for a in args]
        f(*leaves).backward()
        return [a.grad for a in leaves], graphs["fw"]

    def saved(fw: fx.GraphModule) -> int:
        return len(fw.graph.find_nodes(op="output")[0].args[0]) - 1  # less the loss

    default = torch._functorch.config.activation_memory_budget
    ref, plain = run(None)
    got, low = run(storm.partitioner(mode="embedded", min_bytes=0, budget=0, memory_budget=0.1))
    assert torch._functorch.config.activation_memory_budget == default
    assert saved(low) < saved(plain) and not ops_in(low, SAVE)  # recomputed more, offloaded nothing
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # at 0.1 it saves the inputs alone; at 0.5 also what it made, each memory of which storm offloads
    got, both = run(storm.partitioner(mode="embedded", min_bytes=0, held_bytes=0, memory_budget=0.5))
    made = {_root(n) for n in both.graph.find_nodes(op="output")[0].args[0][1:]} - set(both.graph.find_nodes(
        op="placeholder"))
    assert saved(low) < saved(both) < saved(plain) and len(ops_in(both, SAVE)) == len(made) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    uuids = {storm.partitioner(memory_budget=m).uuid() for m in (None, 0.1, 0.5)}
    assert len(uuids) == 3


def test_a_graph_of_symbolic_shapes_keeps_its_saves_and_says_so_once(caplog):
    """A graph compiled for dynamic shapes (dynamic=True, or recompiled so after an epoch's last,
    smaller batch) has saves of symbolic size, which storm does not offload: it said nothing, and
    offloading stopped for good."""
    import logging

    from storm.graph.rewrite import _warn_symbolic
    _warn_symbolic.cache_clear()
    f, graphs = traced(Partitioner(GraphOptions(mode="embedded", min_bytes=0, held_bytes=0)), dynamic=True)
    with caplog.at_level(logging.WARNING, logger="storm"):
        grads(f)
    assert ops_in(graphs["fw"], SAVE) == []
    assert caplog.text.count("symbolic shape") == 1


def test_the_outputs_of_a_split_are_views_of_its_input_memory():
    """q, k and v of one projection by split: each is a view of the projection's memory, stored once
    (as one storage, of its whole size); read as memories of their own, each was sized as a third
    and the storage copied whole for each, past the budget."""
    def attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w).split(64, dim=-1)
        return ((q @ k.transpose(-1, -2)).softmax(-1) @ v).sum()

    graphs: dict[str, fx.GraphModule] = {}

    def keep(gm: fx.GraphModule, inputs: Any) -> Any:
        graphs.setdefault("fw", gm)
        return make_boxed_func(gm.forward)

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(64, 192, generator=g, requires_grad=True)
    aot_function(attention, keep, keep)(x, w).backward()
    fw = graphs["fw"]
    pieces = [n for n in fw.graph.nodes if n.target is operator.getitem]
    projection = next(n for n in fw.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert pieces and all(_root(n) is projection for n in pieces)
