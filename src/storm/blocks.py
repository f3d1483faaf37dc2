"""The block lists of a model that ``storm.enable(model, budget= or peak=)`` plans: ``find_blocks``
finds them, ``CallOrder`` sees how the first forward runs them.

A model keeps its repeated layers in a container: a ModuleList in Hugging Face and GPT-style
models, a ModuleDict in torchtitan's (keys for pipeline stages), an nn.Sequential in small ones.
An encoder-decoder (T5, BART, Whisper) has one per stack, and a hybrid (Jamba) mixes layers of
two classes in one. A plan covers every list found as one sequence of blocks, in the order
forward runs them, as ``storm.plan(blocks=[*encoder_layers, *decoder_layers])`` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# A list is planned beside the largest where it holds at least 1/SHARE of the largest's parameters:
# an encoder's stack is within a factor of two of its decoder's, while a list of task heads is a few
# percent of the layers and often runs only where its task's batch does.
SHARE = 4


@dataclass(frozen=True)
class Found:
    """What ``find_blocks`` found. ``lists``: each planned list's qualified name in the model (""
    the model itself; "blocks=" for blocks given to storm.enable) and its number of blocks, in the
    order forward runs them; ``blocks``: their blocks in that order, one sequence; ``left``: the
    other qualifying lists (not inside a planned one), each its name, number of modules and why it
    was left out, the largest first."""

    lists: tuple[tuple[str, int], ...]
    blocks: list[nn.Module]
    left: tuple[tuple[str, int, str], ...] = ()

    @property
    def where(self) -> str:
        """The planned lists' names, joined by " + " ("encoder.block + decoder.block")."""
        return " + ".join(name for name, _ in self.lists)

    def as_ran(self, calls: list[tuple[int, int]]) -> Found:
        """These lists as a forward ran them (``calls``: each block call's list and place in it, in
        order), for a plan, which needs every block run once, in order, in each forward: from the
        largest list by parameters down, a list is kept where it ran so and no list kept ran
        between its blocks (XLM runs its ``attentions`` and ``ffns`` lists in turn, layer by
        layer); the lists kept come in the order they ran, the others are left out saying why.
        Where none ran so, these lists as they are (the planner says its blocks did not run in order).
        Calls that repeat one sequence are the forwards of one step (Lightning's step marks): the
        first counts."""
        calls = calls[:next((p for p in range(1, len(calls))
                             if len(calls) % p == 0 and calls == calls[:p] * (len(calls) // p)), len(calls))]
        starts = [0]
        for _, n in self.lists:
            starts.append(starts[-1] + n)
        size = [sum(map(_params, self.blocks[starts[i]:starts[i + 1]])) for i in range(len(self.lists))]
        kept: list[int] = []
        left: list[tuple[str, int, str]] = []  # before those find_blocks left out, which are smaller
        for i in sorted(range(len(self.lists)), key=lambda i: -size[i]):
            name, n = self.lists[i]
            seq = [k for k, _ in calls if k == i or k in kept]
            runs = [k for at, k in enumerate(seq) if at == 0 or seq[at - 1] != k]  # stretches of one list
            if [j for k, j in calls if k == i] != list(range(n)):
                left.append((name, n, "its blocks did not run once each, in order, in the first forward"
                             if i in runs else "it did not run in the first forward"))
            elif len(runs) > len(set(runs)):
                broken = [k for k in dict.fromkeys(runs) if k != i and runs.count(k) > 1]
                other = broken[0] if broken else runs[runs.index(i) + 1]
                left.append((name, n, f"it ran interleaved with {self.lists[other][0]}, which is planned: lists "
                                      f"are planned one after the other"))
            else:
                kept.append(i)
        if not kept:
            return self
        kept.sort(key=lambda i: next(at for at, (k, _) in enumerate(calls) if k == i))
        blocks = [b for i in kept for b in self.blocks[starts[i]:starts[i + 1]]]
        return Found(tuple(self.lists[i] for i in kept), blocks, (*left, *self.left))


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP-style wrappers: while ``.module`` is a module that holds every
    parameter of its wrapper, that module."""
    while isinstance(inner := getattr(model, "module", None), nn.Module) and inner is not model:
        if {id(p) for p in model.parameters()} != {id(p) for p in inner.parameters()}:
            break  # a model with a submodule called "module", not a wrapper
        model = inner
    return model


def _qualifying(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Module]]]:
    """Each container of ``model`` (its name, itself, its modules) whose modules are repeats: two
    or more, each of a class that appears at least twice among them (find_blocks says why)."""
    for name, m in model.named_modules():
        if isinstance(m, _CONTAINERS):
            children = list(m.children())
            classes = [type(c) for c in children]
            if len(children) >= 2 and all(classes.count(c) >= 2 for c in classes):
                yield name, m, children


def block_lists(model: nn.Module) -> dict[str, int]:
    """Every container of ``model`` that find_blocks chooses among, by name: its parameters' count."""
    return {name: _params(m) for name, m, _ in _qualifying(model)}


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_blocks(model: nn.Module) -> Found:
    """The block lists of ``model`` (unwrapped as storm.enable does) that a plan covers.

    A container (nn.ModuleList, nn.ModuleDict, nn.Sequential) qualifies when it holds two or more
    modules and every class among them appears at least twice: its modules then repeat one kind
    of layer, or several (a hybrid's attention and Mamba layers). A module whose class appears
    once repeats nothing: it is a stem or a head (``nn.Sequential(embedding, *blocks, head)``), or
    the container is a model's layout (nanoGPT's ``transformer`` ModuleDict: wte, wpe, drop, h,
    ln_f), which holds the real list and would outweigh it in parameters. So such a container is
    not taken, and a hybrid with a single layer of some kind needs ``blocks=``.

    Of the qualifying containers, from the most parameters down (then the most modules; then the
    outermost), one inside a list already taken is part of its blocks (an MoE layer's experts);
    one that holds or shares modules with a list taken is left out, and so is one with less than
    a quarter (1/SHARE) of the largest's parameters, since a small list (task heads, say) is not
    worth a plan's traces and often does not run in every forward, as a plan needs of each block.
    The others are taken: T5's encoder.block and decoder.block, BART's and Whisper's two layers.
    Parameters rank the lists before any step has run, as their layers' compute does.

    The lists come in the order the model registers them, which is the order forward runs them
    in T5, BART and Whisper but not in CLIP (text model registered first, vision model run
    first); storm.enable sees how the first forward runs them (CallOrder, Found.as_ran). Raises
    ValueError, naming what it looked for, where no container qualifies."""
    model = unwrap(model)
    index = {id(m): i for i, m in enumerate(model.modules())}  # registration order
    candidates = sorted(((_params(m), len(children), -index[id(m)], name, m, children)
                         for name, m, children in _qualifying(model)), key=lambda c: c[:3], reverse=True)
    if not candidates:
        raise ValueError(
            f"storm.enable found no repeated blocks in {type(model).__name__}: it looks for an nn.ModuleList, "
            f"nn.ModuleDict or nn.Sequential of two or more modules in which every class appears at least twice "
            f"(model.model.layers in a Hugging Face model, encoder.block and decoder.block in T5, model.layers or "
            f"model.transformer.h in GPT-style ones) and found none; pass blocks= (the model's repeated layers, in "
            f"the order its forward runs them)")
    largest, largest_name = candidates[0][0], candidates[0][3] or "(the model)"
    taken: list[tuple[int, str, nn.Module, list[nn.Module], set[int]]] = []  # index, name, list, blocks, modules
    left: list[tuple[str, int, str]] = []
    named: list[set[int]] = []  # the modules of the lists taken or left out: those inside them are not named
    for params, count, neg_index, name, m, children in candidates:
        if any(id(m) in inside for inside in named):
            continue
        mine = {id(x) for x in m.modules()}
        other = next((t for t in taken if mine & t[4]), None)
        if other is not None:
            left.append((name, count, f"{'holds' if id(other[2]) in mine else 'shares modules with'} {other[1]}, "
                                      f"which is planned"))
        elif params * SHARE < largest:
            left.append((name, count, f"{params / largest:.0%} of the parameters of {largest_name}: a list under "
                                      f"1/{SHARE} of the largest's is not planned"))
        else:
            taken.append((-neg_index, name, m, children, mine))
        named.append(mine)
    taken.sort(key=lambda t: t[0])
    return Found(tuple((t[1], len(t[3])) for t in taken), [b for t in taken for b in t[3]], tuple(left))


class CallOrder:
    """How a forward runs ``found``'s lists: a forward pre-hook on each of their blocks notes the
    list and place of each call with grad enabled (forwards without grad are no steps) in
    ``calls``, which ``started()`` empties as a forward of the model starts, and ``ended()``
    keeps as ``first`` where it is the first forward that ended normally. ``remove()`` takes
    the hooks off."""

    def __init__(self, found: Found):
        self.calls: list[tuple[int, int]] = []
        self.first: list[tuple[int, int]] | None = None
        self._hooks = []
        at = 0
        for i, (_, n) in enumerate(found.lists):
            for j in range(n):
                # outside a compiled block's region, as the planner's hooks are (planner/wiring.py)
                hook = torch.compiler.disable(functools.partial(self._called, i, j))
                self._hooks.append(found.blocks[at + j].register_forward_pre_hook(hook))
            at += n

    def _called(self, i: int, j: int, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.calls.append((i, j))

    def started(self) -> None:
        self.calls = []

    def ended(self, normally: bool) -> None:
        """A forward of the model ended; ``normally``: without raising (one that raised, an OOM
        say, need not have run every list)."""
        if normally and self.first is None and self.calls:
            self.first = self.calls
        self.calls = []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
