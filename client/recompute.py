"""Recompute: a block's forward that keeps only its inputs and runs again in backward.

storm.plan sets it as a recomputed block's ``forward``. Two forms:

- Reentrant (the default; torch.utils.checkpoint, use_reentrant=True): forward runs without
  autograd, and backward recomputes the block and runs a nested backward through it. It costs
  the host less than the non-reentrant form, whose Python hooks pack and unpack every tensor
  the block saves, in forward as well: W1 on lent H100s, all 12 blocks recomputed, 36.8 against
  40.3 ms a step (no offload 26.8) and on a slower host 40.5 against 56.4 (no offload 29.0;
  bench/recompute.py), and a host-bound step pays all of it.
- Non-reentrant (torch.utils.checkpoint, use_reentrant=False): for keyword arguments, which the
  reentrant form does not take, and ``reentrant=False``; it also works with
  torch.autograd.grad and backward(inputs=...).

What the reentrant form's nested backward holds is kept to what the non-reentrant one holds
(their difference decided which form fits W1's tightest caps):

- Each tensor the recompute saves is handed to the node that saved it when that node runs
  (``_Saved``), and dropped then, as the non-reentrant form's hooks do; autograd would keep it
  until the node finishes, beside the node's own temporaries (a bias gradient's reduction
  buffer, in W1).
- The rebuilt output goes before the nested backward runs (``_release``).

Under no_grad the block just runs. The RNG state is kept for the recompute either way (the
same dropout masks).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


class Recompute:
    """A block's forward (``forward``, the block's own bound method) recomputed in backward,
    in the reentrant form unless ``reentrant=False``. A tensor that requires grad (``_grad``,
    empty) goes in beside the inputs, so that the block's parameters get their gradients where
    its input does not require grad (the first block's). ``hand_over=False`` leaves the
    reentrant recompute's saved tensors to autograd, which keeps them as it keeps a block's
    that is not recomputed: storm.plan measures what that holds (Planner.kept_extra)."""

    def __init__(self, forward: Callable[..., Any], device: torch.device, reentrant: bool = True,
                 hand_over: bool = True):
        self.forward, self.reentrant, self.hand_over = forward, reentrant, hand_over
        self._grad = torch.empty(0, device=device, requires_grad=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        if kwargs or not self.reentrant:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(self._run, self._grad, *args, use_reentrant=True)

    def _run(self, _grad: torch.Tensor, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # checkpoint's forward
            return self.forward(*args)
        # the recompute in backward
        hooks = torch.autograd.graph.saved_tensors_hooks(_Saved, _Saved.take) if self.hand_over else nullcontext()
        with hooks:
            out = self.forward(*args)
        for t in out if isinstance(out, tuple) else (out,):
            _release(t)
        return out


class _Saved:
    """A tensor the recompute saved, until the node that saved it takes it in the nested
    backward. A second taking (a custom Function reading ``ctx.saved_tensors`` twice) is an
    error, as in torch's non-reentrant checkpoint."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        # detached: its own tensor over the same storage, which _release leaves alone when the
        # saved tensor is the block's output (exp's backward saves its result)
        self.tensor: torch.Tensor | None = tensor.detach()

    def take(self) -> torch.Tensor:
        t, self.tensor = self.tensor, None
        if t is None:
            raise RuntimeError("storm Recompute: a tensor the recomputed block saved was unpacked twice in one "
                               "backward (a custom Function reading ctx.saved_tensors twice?): read them once "
                               "and keep them, as torch's non-reentrant checkpoint also asks")
        return t


def _release(out: Any) -> None:
    """Let the reentrant recompute's rebuilt output go before the nested backward runs: that
    backward needs only its graph (``grad_fn``) and shape, and would otherwise keep the block's
    output alive beside everything the block's backward holds (W1 on a lent H100, 11 blocks
    recomputed: the step's peak 688.9 MiB before, 672.9 after; bench/recompute.py). The tensor
    keeps its shape over a one-element stride-0 buffer; a node that saved the output (``exp``'s
    backward) holds its own reference to the storage, so its gradient is unchanged and only the
    unshared bytes go. Views, leaves (a block that returns its input) and what is not a tensor
    are left alone."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None and not out._is_view():
        out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)
