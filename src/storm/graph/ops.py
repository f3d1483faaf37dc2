"""The three ops a graph rewritten by storm/graph/rewrite.py calls, and what they do at run time.

    token = storm::save(x, previous token, [released tokens])  # right after x is made: its copy into
                                                 # the store starts
    token = storm::released(token, x)            # after x's last use in forward, some saves later:
                                                 # the compute stream waits for x's copy; x may go
    x = storm::load(token, size, stride, ...)    # in backward, before x's first use

A token is an empty CPU tensor that carries, as a Python attribute, what the session gave for x
(a ``Handle``, or a ``Kept``): the compiled forward returns tokens in place of the saved tensors,
autograd keeps them for backward, and when autograd lets go of a token its handle dies and the
store frees the bytes, as with storm.offload's hooks. Each save takes the token before it, which
keeps the saves of one forward in order; the first of a forward starts a step of the session.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import StormError
from ..policy import Policy
from ..registry import session_for
from ..saved import Handle, Kept, Step, StepOptions, copy_of
from ..session import ClientSession

ANY_SIZE = Policy(min_bytes=0)  # the rewrite chose the saves by size already


class Carried:
    """What a token carries: the session and step of the save, and what the save became."""

    __slots__ = ("session", "step", "held")

    def __init__(self, session: ClientSession, step: Step, held: Handle | Kept):
        self.session, self.step, self.held = session, step, held


def token(saved: Carried) -> torch.Tensor:
    t = torch.empty(0, dtype=torch.uint8)
    t.storm_saved = saved
    return t


def carried(t: torch.Tensor) -> Carried:
    saved = getattr(t, "storm_saved", None)
    if saved is None:
        raise StormError("a storm token lost what it carries: a tensor the compiled graph passes between storm's "
                         "ops was copied or rebuilt (saved-tensor hooks around the compiled model that return "
                         "another tensor, or an unsupported torch.compile backend or mode?)")
    return saved


@torch.library.custom_op("storm::save", mutates_args=())
def save(x: torch.Tensor, previous: Optional[torch.Tensor], after: list[torch.Tensor], mode: str,
         socket: Optional[str], pool_size: Optional[int], held_bytes: int) -> torch.Tensor:
    """Start storing ``x``; ``previous``: the token of the save before in this forward (None: the
    first, which starts a step of the session for ``mode``, ``socket`` and ``pool_size``, whose
    copies may run ``held_bytes`` behind forward); ``after``: tokens of releases that must run
    before it (their order in the graph is all)."""
    if previous is None:
        session = session_for(mode, socket, pool_size)
        step = session.new_step(options=StepOptions(max_held_bytes=held_bytes))
    else:
        p = carried(previous)
        session, step = p.session, p.step
    return token(Carried(session, step, session.save(x, step, ANY_SIZE, compiled=True)))


@save.register_fake
def _(x, previous, after, mode, socket, pool_size, held_bytes):
    return torch.empty(0, dtype=torch.uint8)


@torch.library.custom_op("storm::released", mutates_args=())
def released(saved: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` was saved as ``saved`` and forward is done with it: the graph may free or reuse its
    memory once this has run (session.let_go)."""
    s = carried(saved)
    return token(Carried(s.session, s.step, s.session.let_go(s.held)))


@released.register_fake
def _(saved, x):
    return torch.empty(0, dtype=torch.uint8)


@torch.library.custom_op("storm::load", mutates_args=())
def load(saved: torch.Tensor, size: list[int], stride: list[int], dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """The saved tensor back, as the graph expects it (``size``, ``stride``, ``dtype``, ``device``)."""
    s = carried(saved)
    t = s.session.load(s.held)
    if t.shape != tuple(size) or t.dtype != dtype:
        raise StormError(f"storm::load: the store gave back a {tuple(t.shape)} {t.dtype} tensor where the graph "
                         f"expects {tuple(size)} {dtype}")
    if any(a != b for n, a, b in zip(size, t.stride(), stride) if n > 1):  # a dim of one has any stride
        # inductor lays a saved tensor out after the graph was traced (a conv's output channels-last, a
        # transposed view made contiguous): the bytes are right, in another layout than the graph's
        return torch.empty_strided(size, stride, dtype=dtype, device=device).copy_(t)
    if isinstance(s.held, Kept):  # the same tensor at every load, and the graph may overwrite what it gets
        return copy_of(t)
    return t


@load.register_fake
def _(saved, size, stride, dtype, device):
    return torch.empty_strided(size, stride, dtype=dtype, device=device)
