"""storm.enable's block lists (storm/blocks.py): a hybrid list of two block classes, several lists
planned as one sequence in the order forward runs them (checked at the first forward: another
order, or one list run between another's blocks), small lists left out, and explain() saying
what was planned and what was left."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import storm
from storm.blocks import Found, block_lists, find_blocks
from storm.examples.models import same_bits

D, VOCAB = 32, 64
STORM = {"mode": "embedded", "min_bytes": 0, "pool_size": "64MiB"}
STEPS = 8  # an offload trace, a compute trace, planned steps; one more where the first forward replans


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-2, -1) / D ** 0.5, dim=-1) @ v)


class GatedConv(nn.Module):
    """The other kind of a hybrid: a gated depthwise convolution along the sequence (as a Mamba
    layer mixes tokens without attention)."""

    def __init__(self):
        super().__init__()
        self.norm, self.inp, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(D, D)
        self.conv = nn.Conv1d(D, D, 3, padding=1, groups=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.inp(self.norm(x)).chunk(2, dim=-1)
        return x + self.out(self.conv(h.transpose(1, 2)).transpose(1, 2) * torch.sigmoid(gate))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    """Tokens in, logits out; ``body`` runs between the embedding and the head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


class Hybrid(Toy):
    """One list of two classes, as Jamba's attention and Mamba layers."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Attention() if i % 2 else GatedConv() for i in range(8))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TwoTowers(Toy):
    """Two lists registered in one order and run in the other, as CLIP's text and vision models."""

    def __init__(self):
        super().__init__()
        self.text = nn.ModuleList(Attention() for _ in range(3))
        self.vision = nn.ModuleList(GatedConv() for _ in range(3))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.vision, *self.text]:
            x = block(x)
        return x


class Interleaved(Toy):
    """Two lists run in turn, layer by layer, as XLM's attentions and ffns: no one sequence of both."""

    def __init__(self):
        super().__init__()
        self.attentions = nn.ModuleList(Attention() for _ in range(3))
        self.ffns = nn.ModuleList(MLP() for _ in range(3))  # the larger

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for attention, ffn in zip(self.attentions, self.ffns):
            x = ffn(attention(x))
        return x


class WithHeads(Toy):
    """The layers, and beside them a small list of two task heads, both run."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(4))
        self.heads = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return sum(head(x) for head in self.heads)


def train(make: type[Toy], enable: bool) -> tuple[list[tuple[torch.Tensor, list[torch.Tensor]]], object]:
    """STEPS SGD steps of a fresh ``make()`` from seed 0 on one batch, through storm.enable(model,
    budget=0.5) where ``enable``: each step's loss and gradients, and the handle."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    handle = storm.enable(model, budget=0.5, **STORM) if enable else None
    steps = []
    for _ in range(STEPS):
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        steps.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps, handle


def assert_bit_exact(make: type[Toy]) -> storm.Enabled:
    """``make``'s model trains bit for bit as without STORM, through a plan that did something;
    the handle, disabled."""
    plain, _ = train(make, enable=False)
    planned, handle = train(make, enable=True)
    handle.disable()
    for i, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(zip(plain, planned)):
        assert same_bits(loss_a, loss_b), f"loss of step {i}"
        assert all(same_bits(a, b) for a, b in zip(grads_a, grads_b)), f"gradients of step {i}"
    plan = handle.planner.plan
    assert plan is not None and (plan.recomputed or plan.offloaded), handle.explain()
    return handle


def test_a_hybrid_list_of_two_block_classes_is_found_and_trains_bit_exact():
    model = Hybrid()
    found = find_blocks(model)
    assert found.lists == (("layers", 8),) and found.blocks == list(model.layers) and found.left == ()
    handle = assert_bit_exact(Hybrid)
    assert handle.where == "layers"
    assert "storm.plan on 8 blocks at layers (GatedConv, Attention) on every forward of Hybrid" in handle.explain()


def test_a_small_list_beside_the_layers_is_left_out_and_explain_says_why():
    model = WithHeads()
    found = find_blocks(model)
    assert found.lists == (("layers", 4),) and found.blocks == list(model.layers)
    assert found.left == (("heads", 2, "6% of the parameters of layers: a list under 1/4 of the largest's is not "
                                       "planned"),)
    handle = assert_bit_exact(WithHeads)
    assert "\nleft out: heads (2 modules): 6% of the parameters of layers" in handle.explain()


def test_lists_run_in_another_order_than_registered_are_planned_as_they_ran(caplog):
    model = TwoTowers()
    found = find_blocks(model)
    assert found.lists == (("text", 3), ("vision", 3))  # registration order, until a forward runs them
    handle = storm.enable(model, budget=0.5, **STORM)
    assert "\nblocks: text (3) + vision (3), planned as one sequence in registration order, until the first " \
           "forward shows how it runs them" in handle.explain()
    handle.disable()
    with caplog.at_level(logging.WARNING, logger="storm"):
        handle = assert_bit_exact(TwoTowers)
    assert handle.where == "vision + text" and handle.found.lists == (("vision", 3), ("text", 3))
    assert "\nblocks: vision (3) + text (3), planned as one sequence in the order forward runs them\n" in \
        handle.explain()
    assert "the first forward of TwoTowers ran its block lists otherwise than planned (text + vision): the plan " \
           "starts again on vision + text" in caplog.text


def test_a_list_run_between_the_blocks_of_another_is_left_out():
    handle = assert_bit_exact(Interleaved)
    assert handle.found.lists == (("ffns", 3),) and handle.found.left[0][:2] == ("attentions", 3)
    assert "\nleft out: attentions (3 modules): it ran interleaved with ffns, which is planned: lists are planned " \
           "one after the other" in handle.explain()


class FailingFirst(TwoTowers):
    """Its first forward raises once the vision list has run, as an OOM would."""

    failed = False

    def body(self, x: torch.Tensor) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            for block in self.vision:
                x = block(x)
            raise MemoryError("as an OOM would")
        return super().body(x)


def test_a_first_forward_that_raises_decides_nothing():
    """An OOM in the first step (a batch-size search retries smaller) may cut a forward off before
    its last list: the next forward that ends decides (counted, the cut one would leave text out)."""
    model = FailingFirst()
    idx = torch.randint(0, VOCAB, (2, 16))
    handle = storm.enable(model, budget=0.5, **STORM)
    with pytest.raises(MemoryError):
        model(idx)
    for _ in range(2):
        model(idx).sum().backward()
    assert handle.found.lists == (("vision", 3), ("text", 3)) and handle.found.left == ()
    handle.disable()


def test_t5_like_lists_registered_in_forward_order_keep_their_planner():
    model = TwoTowers()
    model.body = lambda x: model.vision[2](model.vision[1](model.vision[0](  # text, then vision, as registered
        model.text[2](model.text[1](model.text[0](x))))))
    handle = storm.enable(model, budget=0.5, **STORM)
    planner = handle.planner
    idx = torch.randint(0, VOCAB, (2, 16))
    for _ in range(3):
        model(idx).sum().backward()
    assert handle.planner is planner and handle.where == "text + vision" and planner.trace is not None
    handle.disable()


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(MLP() for _ in range(4))


class Layout(nn.Module):
    """nanoGPT's layout: a ModuleDict of the embeddings, dropout, layers and final norm."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, D), "wpe": nn.Embedding(16, D),
                                          "drop": nn.Dropout(0.0), "h": nn.ModuleList(MLP() for _ in range(2)),
                                          "ln_f": nn.LayerNorm(D)})


def test_which_containers_qualify_and_which_are_left_out():
    # a class that appears once is a stem or a head, or the container a model's layout
    assert find_blocks(Layout()).lists == (("transformer.h", 2),)
    staged = nn.Sequential(nn.Embedding(VOCAB, D), MLP(), MLP(), nn.Linear(D, VOCAB))
    with pytest.raises(ValueError, match="in which every class appears at least twice"):
        find_blocks(staged)
    lone = nn.ModuleList([GatedConv(), GatedConv(), Attention(), GatedConv()])  # a hybrid with one attention layer
    assert block_lists(nn.Sequential(lone)) == {}
    # a list inside a planned one is part of its blocks (an MoE layer's experts), and not named
    model = nn.Module()
    model.layers = nn.ModuleList(MoE() for _ in range(2))
    assert find_blocks(model) == Found((("layers", 2),), list(model.layers))
    # the same blocks in a second list: one plan of them
    model = WithHeads()
    model.alias = nn.ModuleList(model.layers)
    found = find_blocks(model)
    assert found.lists == (("layers", 4),) and found.left[0] == ("alias", 4, "shares modules with layers, which "
                                                                             "is planned")


def test_found_as_ran_reads_one_forward_of_a_step_and_what_did_not_run():
    a, b = [MLP(), MLP()], [Attention(), Attention()]
    found = Found((("a", 2), ("b", 2)), [*a, *b])
    forward = [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert found.as_ran(forward * 2).lists == (("b", 2), ("a", 2))  # two forwards of one step (Lightning's)
    alone = found.as_ran([(0, 0), (0, 1)])
    assert alone.lists == (("a", 2),) and alone.left == (("b", 2, "it did not run in the first forward"),)
    twice = found.as_ran([(0, 0), (0, 1), (1, 0), (1, 1), (1, 0)])
    assert twice.left == (("b", 2, "its blocks did not run once each, in order, in the first forward"),)
    assert found.as_ran([(1, 0), (1, 0)]) is found  # no list ran as a plan needs: left to the planner to say
