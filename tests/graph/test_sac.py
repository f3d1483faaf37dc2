"""storm.checkpoint_policy: a plan's choice per block as a selective-checkpoint policy, and
storm.sac.offload_pass, which hands the saves it tags CPU_OFFLOAD to torch's activation offloading.

Compiled by inductor on the CPU, the offloads are in the graphs (a device_put to the host after a
save's last use in forward, one back before its first use in backward) and gradients are bit for
bit those of the model compiled without checkpointing. On the CPU inductor then drops the copies
as no-ops (host to host): what the graphs say is what a CUDA device runs (test_offload_on_cuda)."""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint

import storm
import storm.sac
from storm.planner import Plan

aten = torch.ops.aten
OPS = [aten.mm.default, aten.addmm.default, aten.gelu.default, aten.bmm.default,
       aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default]


def plan(**fields: Any) -> Plan:
    return Plan(**{"offloaded": 0, "recomputed": frozenset(), "offload_budget": None, "max_held_bytes": 0,
                   "prefetch_bytes": 0, "predicted_peak": 0, "predicted_cost_ms": 0.0, "fits": True, **fields})


def policies(context_fn: Any) -> set[CheckpointPolicy]:
    """What the context's policy answers for matmul-like and pointwise ops."""
    caching, _ = context_fn()
    return {caching.policy_fn(SelectiveCheckpointContext(is_recompute=False), op) for op in OPS}


@pytest.fixture(autouse=True)
def eager_warning_again():
    storm.sac._warned_eager = False


def test_each_choice_is_its_policy_for_every_op():
    offload, recompute, keep = storm.checkpoint_policy(["offload", "recompute", "keep"])
    assert policies(offload) == {CheckpointPolicy.PREFER_CPU_OFFLOAD}
    assert policies(recompute) == {CheckpointPolicy.PREFER_RECOMPUTE}
    assert keep is None


def test_a_plan_is_its_blocks_choices():
    p = plan(offloaded=2, recomputed=frozenset({2, 4}), inputs_offloaded=1)
    got = storm.checkpoint_policy(p, blocks=6)
    want = storm.checkpoint_policy(["offload", "offload", "recompute", "keep", "recompute", "keep"])
    assert got == want


def test_what_a_policy_cannot_say_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="storm"):
        storm.checkpoint_policy(plan(offloaded=1, recomputed=frozenset({1, 2}), inputs_offloaded=1), blocks=3)
        assert not caplog.records  # the first recomputed block's input is the last offloaded block's output
        storm.checkpoint_policy(plan(offloaded=1, recomputed=frozenset({1, 2}), inputs_offloaded=2), blocks=3)
    assert "inputs of 2 recomputed blocks" in caplog.text
    with pytest.raises(TypeError, match="blocks="):
        storm.checkpoint_policy(plan(offloaded=1))
    with pytest.raises(ValueError, match="beyond the 2"):
        storm.checkpoint_policy(plan(recomputed=frozenset({2})), blocks=2)
    with pytest.raises(ValueError, match="'save'"):
        storm.checkpoint_policy(["offload", "save"])
    with pytest.raises(ValueError, match="2 choices for 3 blocks"):
        storm.checkpoint_policy(["keep", "keep"], blocks=3)


@pytest.mark.parametrize("args, says", [
    (("offload",), "a list of per-block choices"),  # a string is a sequence of one-letter choices
    (({"offload": 1},), "a list of per-block choices"),
    ((None,), "a list of per-block choices"),
    ((["keep"], "1"), "an int >= 0; got '1'"),
    ((["keep"], True), "an int >= 0; got True"),
])
def test_a_policy_of_what_is_not_a_plan_or_a_count_is_refused_saying_what_is_accepted(args, says):
    with pytest.raises(TypeError, match=re.escape(says)):
        storm.checkpoint_policy(*args)
    with pytest.raises(ValueError, match="beyond the 2"):  # a negative index was passed over
        storm.checkpoint_policy(plan(recomputed=frozenset({-1})), blocks=2)


def test_a_torch_without_cpu_offload_is_named(monkeypatch):
    class Old:  # CheckpointPolicy as torch 2.4 to 2.10 have it
        MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, PREFER_RECOMPUTE = 0, 1, 2, 3

    monkeypatch.setattr(storm.sac, "CheckpointPolicy", Old)
    assert storm.checkpoint_policy(["recompute", "keep"])[1] is None  # offloading nothing works anywhere
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} lacks")):
        storm.checkpoint_policy(["offload", "keep"])
    with pytest.raises(RuntimeError, match="offload_pass needs"):
        storm.sac.offload_pass()


def graph(*nodes: tuple[CheckpointPolicy | None, torch.Tensor | None]) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for policy, val in nodes:
        n = g.call_function(torch.relu, (x,))
        n.meta.update({} if policy is None else {"recompute": policy}, **({} if val is None else {"val": val}))
    g.output(x)
    return torch.fx.GraphModule({}, g)


def test_the_pass_marks_tagged_saves_of_min_bytes():
    P, meta = CheckpointPolicy, functools.partial(torch.empty, device="meta")  # float32: 4 bytes an element
    gm = graph((P.PREFER_CPU_OFFLOAD, meta(256)), (P.PREFER_CPU_OFFLOAD, meta(255)), (P.MUST_CPU_OFFLOAD, meta(4, 64)),
               (P.MUST_CPU_OFFLOAD, meta(2)), (P.MUST_SAVE, meta(1024)), (None, meta(1024)),
               (P.PREFER_CPU_OFFLOAD, None))
    storm.sac.offload_pass(min_bytes="1KiB")(gm, None)
    got = [(n.meta.get("recompute"), n.meta.get("should_offload", False)) for n in gm.graph.nodes
           if n.op == "call_function"]
    assert got == [(P.PREFER_CPU_OFFLOAD, True), (P.PREFER_CPU_OFFLOAD, False), (P.MUST_SAVE, True),
                   (P.MUST_SAVE, False), (P.MUST_SAVE, False), (None, False), (P.PREFER_CPU_OFFLOAD, False)]
    with pytest.raises(ValueError, match="min_bytes"):
        storm.sac.offload_pass(min_bytes=-1)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.gelu = torch.nn.Linear(64, 64), torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gelu(self.linear(x))


class Model(torch.nn.Module):
    def __init__(self, choices: list[str]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in choices)
        self.contexts = storm.checkpoint_policy(choices)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, context_fn in zip(self.blocks, self.contexts):
            x = block(x) if context_fn is None else checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        return x


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[Any] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("choice, replays", [("offload", 1), ("recompute", 1), ("keep", 0)])
def test_eager_sac_replays_what_it_does_not_save(choice, replays, caplog):
    """torch's eager SAC saves only MUST_/PREFER_SAVE outputs: an offloaded block runs again in
    backward (its addmm), as a recomputed one does, and storm says so once."""
    model, x = Model([choice]), torch.randn(8, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(2):
            out = model(x).sum()
            with Ops() as ops:
                out.backward()
            assert ops.count[aten.addmm.default] == replays
    assert len([r for r in caplog.records if "recomputed, not offloaded" in r.message]) == (choice == "offload")


def compiled_step(choices: list[str], offloading: bool = True,
                  joint_pass: Any = None) -> tuple[list[torch.Tensor], list[list[tuple[str, Any]]]]:
    """One step of the model compiled by inductor: each parameter's gradient, and the forward and
    backward graphs as the partitioner left them (name and target of each node, taken before
    inductor's later passes drop the host-to-host copies)."""
    torch.manual_seed(0)
    model = Model(choices)
    graphs: list[list[tuple[str, Any]]] = []
    with torch._inductor.config.patch(post_grad_custom_pre_pass=lambda g: graphs.append(
            [(n.name, n.target) for n in g.nodes])), torch._functorch.config.patch(
            enable_activation_offloading=offloading, joint_custom_pass=joint_pass):
        torch.compile(model)(torch.randn(32, 64, generator=torch.Generator().manual_seed(1))).sum().backward()
    torch._dynamo.reset()
    return [p.grad for p in model.parameters()], graphs


def offloads(nodes: list[tuple[str, Any]]) -> list[str]:
    """The copies torch's activation offloading put in a graph: device_put (ao.offload/ao.reload on
    a separate stream, torch 2.12 and later), by the names it gives them."""
    return [name for name, target in nodes if "device_put" in str(target) or str(target).startswith("ao.")]


@pytest.fixture
def uncached():
    """Each compile afresh (a cached graph would skip the passes)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.slow
def test_compiled_offload_and_recompute_bit_exact(uncached, caplog):
    """Blocks offload, offload, recompute, keep: forward copies out the offloaded blocks' saves (the
    first block's input is the model's, a graph input: never offloaded), backward copies them back
    and recomputes the third block (its addmm), and every gradient equals no checkpointing's."""
    want, _ = compiled_step(["keep"] * 4, offloading=False)
    with caplog.at_level(logging.WARNING, logger="storm"):
        got, (forward, backward) = compiled_step(["offload", "offload", "recompute", "keep"],
                                                 joint_pass=storm.sac.offload_pass(min_bytes=0))
    assert "not offloaded" not in caplog.text  # the eager warning: not where the policy runs compiled
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert offloads(forward) == ["cpu_offload_addmm", "cpu_offload_mul_2", "cpu_offload_addmm_1", "cpu_offload_mul_5"]
    assert sorted(offloads(backward)) == sorted(n.replace("cpu_offload", "gpu_reload") for n in offloads(forward))
    assert [t for _, t in backward].count(aten.addmm.default) == 1


@pytest.mark.slow
def test_compiled_offload_takes_the_pass(uncached):
    """torch alone (its offloading on, the policy tagging every op) offloads nothing; with the pass,
    saves under min_bytes (each here: 8 KiB) stay too."""
    for joint_pass in (None, storm.sac.offload_pass(min_bytes="9KiB")):
        _, (forward, backward) = compiled_step(["offload"] * 2, joint_pass=joint_pass)
        assert offloads(forward) == offloads(backward) == []


@pytest.mark.gpu
@pytest.mark.slow
def test_offload_on_cuda(uncached):
    """On CUDA, torch's offloading on its default path (device_put, on the compute stream: the one
    torch's own inductor test covers) copies the saves out and back; gradients equal those of the
    same policy compiled without offloading."""
    def step(offloading: bool) -> tuple[list[torch.Tensor], list[list[tuple[str, Any]]]]:
        torch.manual_seed(0)
        model = Model(["offload", "offload", "recompute", "keep"]).cuda()
        graphs: list[list[tuple[str, Any]]] = []
        with torch._inductor.config.patch(post_grad_custom_pre_pass=lambda g: graphs.append(
                [(n.name, n.target) for n in g.nodes])), torch._functorch.config.patch(
                enable_activation_offloading=offloading, joint_custom_pass=storm.sac.offload_pass(min_bytes=0)):
            torch.compile(model)(torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
                                 ).sum().backward()
        torch._dynamo.reset()
        return [p.grad for p in model.parameters()], graphs

    want, _ = step(offloading=False)
    got, (forward, backward) = step(offloading=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(offloads(forward)) >= 4 and len(offloads(backward)) >= 4
