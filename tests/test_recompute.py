"""storm.recompute.Recompute, the forward storm.plan sets on a recomputed block: gradients
bit-identical to the block run plainly in both forms, what the reentrant form holds, and its
saved tensors handed over once."""

from __future__ import annotations

import collections
import weakref
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from storm.examples.models import GPTBlock, same_bits
from storm.recompute import Recompute, _warn_cache_off


class Scaled(torch.nn.Module):
    """A block that takes a keyword argument and draws dropout masks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.nn.functional.gelu(self.lin(x)), 0.2) * scale


def recomputing(blocks: list[torch.nn.Module], reentrant: bool = True) -> list[torch.nn.Module]:
    """``blocks``, each recomputed in backward (as storm.plan sets them)."""
    for b in blocks:
        b.forward = Recompute(type(b).forward.__get__(b), torch.device("cpu"), reentrant)
    return blocks


def recompute_grads(reentrant: bool | None, kwargs: bool) -> list[torch.Tensor]:
    """A block whose input does not require grad (as a model's first block's), recomputed or not."""
    torch.manual_seed(0)
    blocks = [Scaled(), Scaled()]
    if reentrant is not None:
        for b in blocks:
            b.forward = Recompute(type(b).forward.__get__(b), torch.device("cpu"), reentrant)
    x = torch.randn(4, 32)
    torch.manual_seed(3)
    h = x
    for b in blocks:
        h = b(h, scale=0.5) if kwargs else b(h)
    h.pow(2).sum().backward()
    return [p.grad for b in blocks for p in b.parameters()]


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("kwargs", [False, True])
def test_recomputed_blocks_give_every_parameter_its_gradient_bit_for_bit(reentrant, kwargs):
    """The first block's input does not require grad: without the grad-requiring tensor that goes
    in beside it, a reentrant recompute would leave its parameters without gradients."""
    ref = recompute_grads(None, kwargs)
    got = recompute_grads(reentrant, kwargs)
    assert all(g is not None for g in got)
    assert all(same_bits(a, b) for a, b in zip(ref, got))


class LiveBytes(TorchDispatchMode):
    """The most bytes that tensors made under it held at once: every op's outputs counted
    until their storage is freed (CPU has no allocator statistics to read)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _count(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in self.live:
            return
        key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(t.untyped_storage(), self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        pytree.tree_map(self._count, out)
        return out


def recompute_peak(reentrant: bool) -> int:
    torch.manual_seed(0)
    blocks = [GPTBlock(64, 2, dropout=0.1) for _ in range(4)]
    with LiveBytes() as live:
        h = torch.randn(2, 128, 64)
        for b in blocks:
            h = Recompute(b, torch.device("cpu"), reentrant)(h)
        h.sum().backward()
    return live.peak


def test_the_reentrant_recompute_holds_no_more_than_the_non_reentrant_one():
    """The reentrant form's nested backward used to keep the rebuilt block's output beside
    everything the block's backward holds: here one block output (64 KiB) over the
    non-reentrant form's peak. (On CUDA, with the saves handed over too: W1, 620.9 MiB in both.)"""
    assert recompute_peak(True) <= recompute_peak(False) + 64  # the released output's one element


class Ends(torch.nn.Module):
    """A block whose output is saved by its own last op, or is a view, or a tuple."""

    def __init__(self, end: str):
        super().__init__()
        self.lin, self.end = torch.nn.Linear(16, 16), end

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        if self.end == "exp":  # exp's backward reads its output
            return y.exp()
        if self.end == "view":
            return y.view(-1, 4, 4)[..., :2].reshape(x.shape[0], -1)
        return y.sigmoid(), y * 2


@pytest.mark.parametrize("end", ["exp", "view", "tuple"])
def test_releasing_the_rebuilt_output_keeps_gradients_bit_for_bit(end):
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        b = Ends(end)
        if recompute:
            b.forward = Recompute(type(b).forward.__get__(b), torch.device("cpu"))
        x = torch.randn(4, 16, requires_grad=True)
        out = b(x)
        loss = sum(o.pow(2).sum() for o in out) if isinstance(out, tuple) else out.pow(3).sum()
        loss.backward()
        return [x.grad] + [p.grad for p in b.parameters()]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True), strict=True))


def test_a_recomputed_block_under_no_grad_just_runs():
    torch.manual_seed(0)
    b = torch.nn.Linear(8, 8)
    r = Recompute(b.forward, torch.device("cpu"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = r(x)
    assert out.grad_fn is None and same_bits(out, b(x).detach())


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_frozen_block_just_runs_and_the_blocks_after_it_get_their_gradients(reentrant):
    """Fine-tuning with the bottom blocks frozen: nothing requires grad in the first, so nothing
    flows back through it; recomputing it raised in backward (its rebuilt output required no grad)."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [Scaled(), Scaled()]
        blocks[0].requires_grad_(False)
        if recompute:
            recomputing(blocks, reentrant)
        torch.manual_seed(3)
        blocks[1](blocks[0](torch.randn(4, 32))).pow(2).sum().backward()
        return [p.grad for p in blocks[1].parameters()]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True), strict=True))


class Nested(torch.nn.Module):
    """A block whose output is a dict holding a tuple (a Hugging Face layer's ModelOutput, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.tanh(self.lin(x))
        return {"hidden": h, "extra": (h * 2, None)}


def test_a_block_whose_output_nests_its_tensors_gets_every_gradient_bit_for_bit():
    """An autograd Function tracks only the tensors it returns at its top level: a block returning
    a dict lost every gradient in the reentrant form, with no error."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [Nested(), Nested()]
        if recompute:
            recomputing(blocks)
        h = torch.randn(4, 32, requires_grad=True)
        out = blocks[0](h)
        out = blocks[1](out["hidden"] + out["extra"][0])
        (out["hidden"].sum() + out["extra"][0].pow(2).sum()).backward()
        assert out["extra"][1] is None
        return [p.grad for b in blocks for p in b.parameters()] + [h.grad]

    ref, got = grads(False), grads(True)
    assert all(g is not None for g in got)
    assert all(same_bits(a, b) for a, b in zip(ref, got, strict=True))


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn = torch.nn.LayerNorm(32), torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


def test_a_block_with_torch_attention_trained_in_eval_mode_recomputes_bit_for_bit():
    """nn.MultiheadAttention in eval mode takes its fast path where autograd is off, as the
    reentrant form's forward runs: another computation than training's. Such a block recomputes
    in the non-reentrant form."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [Attention().eval(), Attention().eval()]
        if recompute:
            recomputing(blocks)
        h = torch.randn(4, 10, 32)
        for b in blocks:
            h = b(h)
        h.square().sum().backward()
        return [p.grad for b in blocks for p in b.parameters()]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True), strict=True))


class Twice(torch.autograd.Function):
    """Reads ctx.saved_tensors twice in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        ctx.saved_tensors
        (x,) = ctx.saved_tensors
        return g * 2 + x * 0


def test_a_saved_tensor_read_twice_in_backward_is_a_clear_error():
    """The recompute hands each saved tensor over once, so that it goes when its node is done."""
    x = torch.randn(4, requires_grad=True)
    y = Recompute(lambda t: Twice.apply(torch.sin(t)), torch.device("cpu"))(x)
    with pytest.raises(RuntimeError, match="unpacked twice in one backward"):
        y.sum().backward()


def autocast_grads(recompute: bool, where: str) -> list[torch.Tensor]:
    """Two dropout blocks whose forward (``where="forward"``) or backward (``"backward"``) runs
    under CPU autocast to bfloat16."""
    torch.manual_seed(0)
    blocks = [Scaled(), Scaled()]
    if recompute:
        recomputing(blocks)
    x = torch.randn(4, 32, requires_grad=True)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "forward"):
        h = blocks[1](blocks[0](x))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "backward"):
        h.float().pow(2).sum().backward()
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_recompute_runs_under_forwards_autocast_not_backwards(where):
    """Recomputed in bfloat16 where forward ran so (a recompute in float32 changes every
    gradient), and in float32 where only backward is under autocast (CPU backward runs on the
    caller's thread, in its autocast)."""
    ref = autocast_grads(False, where)
    got = autocast_grads(True, where)
    assert all(same_bits(a, b) for a, b in zip(ref, got, strict=True))


def test_the_recompute_leaves_the_rng_where_backward_without_it_would():
    """The recompute draws forward's dropout masks again from forward's RNG state, then puts the
    generator back: what the program draws after backward is what it draws without recompute."""
    def after_backward(recompute: bool) -> torch.Tensor:
        torch.manual_seed(0)
        b = Scaled()
        if recompute:
            b.forward = Recompute(b.forward, torch.device("cpu"))
        y = b(torch.randn(4, 32, requires_grad=True))
        torch.rand(3)  # the program draws between forward and backward
        y.sum().backward()
        return torch.rand(8)

    assert same_bits(after_backward(False), after_backward(True))


class Masked(torch.nn.Module):
    """A block whose positional arguments include what is not a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        y = self.lin(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


@pytest.mark.parametrize("masked", [False, True])
def test_positional_arguments_that_are_not_tensors_reach_the_recompute(masked):
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        b = Masked()
        f = Recompute(b.forward, torch.device("cpu")) if recompute else b
        x = torch.randn(4, 16, requires_grad=True)
        mask = torch.rand(4, 16) > 0.5 if masked else None
        f(x, mask, 0.5).pow(2).sum().backward()
        return [x.grad] + [p.grad for p in b.parameters()]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True), strict=True))


def test_an_input_changed_in_place_before_backward_is_autograds_error():
    """The recompute would run on the changed values: autograd's version check refuses."""
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    y = Recompute(torch.nn.Linear(16, 16).forward, torch.device("cpu"))(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_reentrant_form_under_autograd_grad_names_the_fix():
    x = torch.randn(4, 16, requires_grad=True)
    y = Recompute(torch.nn.Linear(16, 16).forward, torch.device("cpu"))(x)
    with pytest.raises(RuntimeError, match="reentrant=False"):
        torch.autograd.grad(y.sum(), [x])


def test_the_reentrant_form_under_create_graph_names_the_fix_and_the_other_form_is_exact():
    """A gradient penalty: backward(create_graph=True) differentiates the gradients again. The
    reentrant form's nested backward runs on detached inputs, so its gradients would carry no
    graph back through them (second-order gradients silently wrong): it refuses, naming the form
    that works, whose second-order gradients are those of the block run plainly."""
    def penalty_grads(reentrant: bool | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        first, block = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        if reentrant is not None:
            recomputing([block], reentrant)
        x = torch.randn(4, 16, requires_grad=True)
        y = block(torch.tanh(first(x))).pow(2).sum()
        (g,) = torch.autograd.grad(y, [x], create_graph=True)
        g.pow(2).sum().backward()
        return [p.grad for p in (*first.parameters(), *block.parameters())]

    with pytest.raises(RuntimeError, match="create_graph=True.*reentrant=False"):
        torch.manual_seed(0)
        block = recomputing([torch.nn.Linear(16, 16)])[0]
        x = torch.randn(4, 16, requires_grad=True)
        block(torch.tanh(x)).pow(2).sum().backward(create_graph=True)
    assert all(same_bits(a, b) for a, b in zip(penalty_grads(None), penalty_grads(False)))


def test_a_block_that_changes_its_input_in_place_is_a_clear_error():
    """A pre-activation block (ReLU(inplace=True) on its input) trains without STORM; the replay
    runs on the saved input, which it may not change: torch's own error named no block."""
    block = recomputing([torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 16))])[0]
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="Sequential changes its input in place"):
        block(x * 2).sum().backward()


class Cached(torch.nn.Module):
    """A block that keeps a KV cache as a Hugging Face layer does: with ``use_cache`` it appends
    its keys to ``cache`` (a list) and attends over everything there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, cache: list | None = None, use_cache: bool = False) -> torch.Tensor:
        keys = self.lin(x)
        if use_cache and cache is not None:
            cache.append(keys)
            keys = torch.cat(cache)
        return x + torch.softmax(x @ keys.T, dim=-1) @ keys


def cached_grads(recompute: bool) -> tuple[list[torch.Tensor], list]:
    torch.manual_seed(0)
    block = Cached()
    if recompute:
        block.forward = Recompute(type(block).forward.__get__(block), torch.device("cpu"), True)
    x, cache = torch.randn(4, 32, requires_grad=True), []
    block(x, cache=cache, use_cache=True).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], cache


def test_a_recomputed_block_runs_without_its_kv_cache_and_says_so(caplog):
    """The recompute would append to the cache a second time and attend over the keys twice;
    as transformers' gradient checkpointing does, a recomputed block runs with use_cache=False
    and no cache (a warning once), so its gradients are those of the block run plainly."""
    want, cache = cached_grads(recompute=False)
    assert len(cache) == 1
    _warn_cache_off.cache_clear()  # warned once a process: maybe by an earlier test
    with caplog.at_level("WARNING", logger="storm"):
        got, cache = cached_grads(recompute=True)
        cached_grads(recompute=True)
    assert all(same_bits(a, b) for a, b in zip(want, got))
    assert cache == []
    warned = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(warned) == 1 and "Cached is recomputed" in warned[0] and "use_cache=False, cache=None" in warned[0]


def test_a_cache_passed_by_position_is_turned_off_as_one_passed_by_keyword():
    """GPT-2's blocks take their cache positionally (block(hidden, cache, ...)): the recompute
    turns it off there too, instead of appending to it a second time."""
    def grads(recompute: bool) -> tuple[list[torch.Tensor], list]:
        torch.manual_seed(0)
        block = Cached()
        if recompute:
            recomputing([block])
        x, cache = torch.randn(4, 32, requires_grad=True), []
        block(x, cache, True).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())], cache

    (want, _), (got, cache) = grads(False), grads(True)
    assert cache == [] and all(same_bits(a, b) for a, b in zip(want, got))


def test_a_block_that_only_reads_its_cache_keeps_it():
    """transformers' _can_checkpoint_with_cache: the layer's class says the replay reads the
    same states, so the cache stays."""
    block = Cached()
    block._can_checkpoint_with_cache = True
    rec = Recompute(type(block).forward.__get__(block), torch.device("cpu"), True)
    cache = ["kept"]
    assert rec._without_cache({"cache": cache, "use_cache": True}) == {"cache": cache, "use_cache": False}


class Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.nn.functional.gelu(self.norm(self.lin(x))) * scale


@pytest.mark.parametrize("reentrant, kwargs", [(True, False), (False, False), (True, True)])
def test_a_recompute_leaves_batchnorms_running_statistics_as_forward_left_them(reentrant, kwargs):
    """The replay normalizes by the batch's statistics as forward did, and counts the batch
    once: running mean, variance and batch count, and every gradient, are those of the block
    run plainly."""
    def run(recompute: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        block = Normed()
        if recompute:
            block.forward = Recompute(type(block).forward.__get__(block), torch.device("cpu"), reentrant)
        x = torch.randn(8, 32, requires_grad=True)
        for _ in range(2):
            (block(x, scale=0.5) if kwargs else block(x)).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())], list(block.norm.buffers())

    (want, want_stats), (got, got_stats) = run(False), run(True)
    assert got_stats[-1].item() == 2  # num_batches_tracked: each step's batch once
    assert all(same_bits(a, b) for a, b in zip(want_stats, got_stats))
    assert all(same_bits(a, b) for a, b in zip(want, got))


def test_a_recompute_leaves_instance_norms_running_statistics_as_forward_left_them():
    """InstanceNorm with track_running_stats keeps running statistics in training as BatchNorm
    does: the replay leaves them as forward left them."""
    def run(recompute: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Unflatten(1, (4, 8)),
                                    torch.nn.InstanceNorm1d(4, track_running_stats=True), torch.nn.Flatten())
        if recompute:
            recomputing([block])
        x = torch.randn(8, 32, requires_grad=True)
        for _ in range(2):
            block(x).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())], list(block[2].buffers())

    (want, want_stats), (got, got_stats) = run(False), run(True)
    assert all(same_bits(a, b) for a, b in zip(want_stats, got_stats))
    assert all(same_bits(a, b) for a, b in zip(want, got))


class Paired(torch.nn.Module):
    """A block of an nn.Sequential that takes and returns (hidden, skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, skip = pair
        return torch.tanh(self.lin(x)) + skip, skip


def test_tensors_passed_within_a_tuple_get_their_gradients_bit_for_bit():
    """The reentrant Function sees only top-level tensors: one within a tuple was neither detached
    nor given its gradient (backward recursed into the Function without end); such a block takes
    the non-reentrant form."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = [Paired(), Paired()]
        if recompute:
            recomputing(blocks)
        x = torch.randn(4, 32, requires_grad=True)
        skip = torch.randn(4, 32, requires_grad=True)
        pair = (x, skip * 2)
        for b in blocks:
            pair = b(pair)
        (pair[0].sum() + pair[1].pow(2).sum()).backward()
        return [x.grad, skip.grad, *(p.grad for b in blocks for p in b.parameters())]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True)))


Pair = collections.namedtuple("Pair", "scale shift")


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, p: Any) -> torch.Tensor:
        return self.lin(x) * p.scale + p.shift if isinstance(p, Pair) else self.lin(x) * p["scale"] + p["shift"]


@pytest.mark.parametrize("container", ["namedtuple", "OrderedDict"])
def test_tensors_passed_within_a_namedtuple_or_an_ordered_dict_get_their_gradients_bit_for_bit(container):
    """As within a tuple: the reentrant Function would leave them attached, and its nested backward
    ran on into the outer graph ("backward through the graph a second time" where the tensor is also
    used outside the block)."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = Affine()
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        scale = w * 2
        p = Pair(scale, w.sin()) if container == "namedtuple" else \
            collections.OrderedDict(scale=scale, shift=w.sin())
        f = Recompute(block.forward, torch.device("cpu")) if recompute else block
        (f(x, p).sum() + (scale * scale).sum()).backward()  # scale is used outside the block too
        return [x.grad, w.grad, *(q.grad for q in block.parameters())]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True)))


class Rotary(torch.nn.Module):
    """A block given tables by keyword, in a tuple, as a Hugging Face layer is its rotary ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, *, tables: tuple[torch.Tensor, torch.Tensor], mask: None = None) -> torch.Tensor:
        cos, sin = tables
        return torch.tanh(self.lin(x) * cos + sin)


def test_keyword_tensors_are_saved_through_the_hooks_as_the_positional_ones():
    """torch's checkpoint holds its keyword arguments in its closure; Recompute passes their tensors
    positionally, so the saved-tensor hooks see them (storm.plan offloads them with a block's
    inputs) and backward hands them back: gradients as without recompute, bit for bit."""
    def grads(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = Rotary()
        if recompute:
            block.forward = Recompute(type(block).forward.__get__(block), torch.device("cpu"), reentrant=False)
        x = torch.randn(4, 32, requires_grad=True)
        cos, sin = torch.randn(4, 32), torch.randn(4, 32, requires_grad=True)
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            y = block(x, tables=(cos, sin), mask=None)
        y.sum().backward()
        saved = {t.untyped_storage().data_ptr() for t in seen}
        assert not recompute or saved == {a.untyped_storage().data_ptr() for a in (x, cos, sin)}
        return [x.grad, sin.grad, *(p.grad for p in block.parameters())]

    assert all(same_bits(a, b) for a, b in zip(grads(False), grads(True)))


class DeepKeywords(torch.nn.Module):
    """A block given a tensor nested deeper: in a list in a dict, beside a flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, *, extra: dict, flag: bool) -> torch.Tensor:
        return torch.tanh(self.lin(x) + extra["bias"][0] * flag)


def test_keyword_tensors_flat_or_nested_come_back_in_their_places_bit_for_bit(monkeypatch):
    """A Hugging Face layer's keyword arguments (tensors, tuples of them, flags, None) are taken
    apart by hand as a block's forward starts and again as it is recomputed, where torch's pytree
    took several times as long; what nests deeper (a list in a dict) goes through the pytree. Both
    come back in their places: gradients bit for bit, the nested tensor saved through the hooks."""
    import storm.recompute as recompute

    flattened = []
    flatten = recompute.tree_flatten
    monkeypatch.setattr(recompute, "tree_flatten", lambda tree: flattened.append(tree) or flatten(tree))

    def grads(block: torch.nn.Module, recompute: bool, **kwargs) -> tuple[list[torch.Tensor], list]:
        torch.manual_seed(0)
        block = type(block)()
        if recompute:
            block.forward = Recompute(type(block).forward.__get__(block), torch.device("cpu"), reentrant=False)
        x = torch.randn(4, 32, requires_grad=True)
        seen: list = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            y = block(x, **kwargs)
        y.sum().backward()
        leaves = [t for t in pytree.tree_leaves(kwargs) if isinstance(t, torch.Tensor) and t.requires_grad]
        return [x.grad, *(t.grad for t in leaves), *(p.grad for p in block.parameters())], seen

    cos, sin = torch.randn(4, 32), torch.randn(4, 32, requires_grad=True)
    flat = {"tables": (cos, sin), "mask": None}
    assert all(same_bits(a, b) for a, b in zip(grads(Rotary(), False, **flat)[0], grads(Rotary(), True, **flat)[0]))
    assert flattened == []
    bias = torch.randn(32, requires_grad=True)
    nested = {"extra": {"bias": [bias]}, "flag": True}
    (plain, _), (got, seen) = grads(DeepKeywords(), False, **nested), grads(DeepKeywords(), True, **nested)
    assert all(same_bits(a, b) for a, b in zip(plain, got)) and bias.grad is not None
    assert len(flattened) == 1 and bias.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in seen}


class Positional(Rotary):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, tables=(cos, sin))


@pytest.mark.parametrize("keyword,reentrant", [(False, True), (False, False), (True, False)])
def test_nothing_but_the_saved_tensor_hooks_holds_a_recomputed_blocks_inputs(keyword, reentrant):
    """Where the hooks move what is saved elsewhere (STORM's offload), a recomputed block's inputs,
    positional and keyword ones, are freed once forward lets go of them: neither form keeps them
    in a closure or context beside what it saved."""
    torch.manual_seed(0)
    block = Rotary() if keyword else Positional()
    block.forward = Recompute(type(block).forward.__get__(block), torch.device("cpu"), reentrant)
    x = torch.randn(4, 32, requires_grad=True)
    h, cos, sin = x * 2, torch.randn(4, 32), torch.randn(4, 32)
    alive = [weakref.ref(t) for t in (h, cos, sin)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = block(h, tables=(cos, sin)) if keyword else block(h, cos, sin)
    del h, cos, sin
    assert [r() for r in alive] == [None] * 3
    y.sum().backward()
    assert x.grad is not None
