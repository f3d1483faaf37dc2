"""storm.partitioner on a model compiled as one graph by inductor on the CPU, where the compiled
code frees and reuses buffers as it goes: gradients stay bit for bit those of the same model
compiled without it, through several steps, a second backward (retain_graph), a store without
room, and a forward whose graph is dropped unused, which leaves nothing in the store."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import storm
from storm.examples.models import GPT
from storm.registry import session_for

pytestmark = pytest.mark.slow  # inductor compiles the model's graphs at the first step


@pytest.fixture(autouse=True)
def uncached_and_deterministic():
    """Each test compiles afresh: a graph cached by an earlier test would skip the partitioner. And
    deterministically: inductor's CPU embedding backward adds in a thread-dependent order otherwise,
    so two compiles of the same model differ in the last bits from run to run."""
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()


def models(**options: Any) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A small GPT compiled with storm's partitioner, a copy compiled without, and its tokens."""
    torch.manual_seed(0)
    model = GPT(seq_len=32, d_model=64, n_heads=2, n_layers=3, dropout=0.0)
    ref = copy.deepcopy(model)
    part = storm.partitioner(mode="embedded", min_bytes=0, **options)
    return (torch.compile(model, options={"custom_partitioner_fn": part}), torch.compile(ref),
            torch.randint(0, 256, (4, 33)))


def loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def grads(model: torch.nn.Module, tokens: torch.Tensor, backwards: int = 1) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = loss(model, tokens)
    for i in range(backwards):
        out.backward(retain_graph=i + 1 < backwards)
    return [p.grad.clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def store(pool_size: int | None = None) -> dict:
    return session_for("embedded", None, pool_size).mover.request("STATS").result(10)


def test_gradients_equal_compiled_without_offload_bit_for_bit_step_after_step():
    model, ref, tokens = models(held_bytes=64 << 10)
    for _ in range(3):
        assert same(grads(model, tokens), grads(ref, tokens))
    s = store()
    assert s["session"]["puts"] >= 3 * 6 and s["session"]["gets"] == s["session"]["puts"]
    assert s["node"]["keys"] == 0


def test_a_graph_compiled_with_storm_runs_inside_storm_offload_bit_for_bit():
    """storm.enable warns a model compiled as one graph to compile it with storm.partitioner, and
    keeps its hooks on around it: the compiled graph's tokens are saved through them (kept), and
    a kept token was a copy without what it carries (backward raised)."""
    model, ref, tokens = models(held_bytes=0)  # every save offloaded: each a token in the graph
    grads(model, tokens)  # compiled outside the hooks, as storm.enable's first step finds it
    model.zero_grad(set_to_none=True)
    with storm.offload(mode="embedded", min_bytes=0):
        got = loss(model, tokens)
    got.backward()
    assert same([p.grad for p in model.parameters()], grads(ref, tokens))


def test_a_second_backward_fetches_again_what_the_first_overwrote():
    model, ref, tokens = models(held_bytes=0)
    assert same(grads(model, tokens, backwards=2), grads(ref, tokens, backwards=2))
    assert store()["node"]["keys"] == 0


def test_a_forward_dropped_without_backward_leaves_nothing_in_the_store():
    model, _, tokens = models(held_bytes=0)
    out = loss(model, tokens)
    assert store()["node"]["keys"] > 0
    del out
    grads(model, tokens)  # the next step's saves poll: what the dropped graph held is freed by then
    assert store()["node"]["keys"] == 0


def test_saves_the_store_has_no_room_for_stay_on_their_device_unchanged():
    model, ref, tokens = models(held_bytes=0, pool_size=4096)
    assert same(grads(model, tokens), grads(ref, tokens))
    assert store(4096)["node"]["errors"].get("TOO_LARGE", 0) > 0


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x))).mean()


def test_a_save_inductor_lays_out_otherwise_than_the_graph_comes_back_in_the_graphs_layout():
    """Inductor chooses a conv output's layout (channels-last) after the partitioner has run, so a
    save reaches the store in other strides than the graph recorded: backward refused it."""
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, options={"custom_partitioner_fn": storm.partitioner(mode="embedded",
                                                                                     held_bytes=0)})
    x = torch.randn(8, 3, 32, 32)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        compiled(x).backward()
        torch.compile(ref)(x).backward()
        assert same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    assert store()["session"]["puts"] >= 2


class Region(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.b(torch.nn.functional.gelu(self.a(x))))


def test_blocks_compiled_apart_hand_their_tokens_to_the_graph_around_them_unoffloaded():
    """Inductor runs the partitioner on each nested_compile_region's graph too, whose storm tokens
    (empty tensors) the graph around it saves: with min_bytes=0 it offloaded them as saves, and the
    token came back without what it carries."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Region(), Region(), Region())
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, options={"custom_partitioner_fn": storm.partitioner(mode="embedded",
                                                                                     min_bytes=0, held_bytes=0)})
    compiled_ref = torch.compile(ref)
    for step in range(2):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
        compiled_ref(x).square().mean().backward()
        assert same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    assert store()["node"]["keys"] == 0
