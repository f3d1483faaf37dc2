"""Models and blocks under torch.compile: which are compiled, and the one warning for a model
compiled as one graph.

A graph that torch.compile compiled as one piece (AOTAutograd's forward) hands the tensors it
saves for backward to the saved-tensor hooks only once the whole graph has run: after forward's
memory peak, so offloading them lowers nothing at the peak and costs the copies. Blocks compiled
one by one hand theirs over as each block ends, which STORM offloads and plans as in eager mode.
A model compiled as one graph offloads through storm.partitioner (storm/graph/) instead.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import torch
from torch import nn

from .gpu import allocated_or_none
from .room import Reader

log = logging.getLogger("storm")


def compiled(module: nn.Module) -> bool:
    """Whether ``module`` is compiled itself: ``torch.compile(module)`` or ``module.compile()``."""
    return optimized(module) or module._compiled_call_impl is not None


def optimized(module: nn.Module) -> bool:
    """Whether ``module`` is torch.compile's ``OptimizedModule``: none exists before torch._dynamo
    is imported, which `import storm` leaves to whoever compiles."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def probe_compiling(warn: Callable[[], None]) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook for dynamo to trace (it is not disabled): it calls ``warn`` (run
    eagerly) only where the module's forward is being compiled into a larger region."""
    eager_warn = torch.compiler.disable(warn)

    def probe(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            eager_warn()

    return probe


@functools.cache
def warn_whole_graph(who: str, what: str) -> None:
    """Once per caller and case: ``what`` runs inside a region compiled as one graph."""
    log.warning("%s: %s runs inside a region that torch.compile compiled as one graph (the whole model compiled?), "
                "which hands its saved tensors over only once the whole graph has run, after forward's memory peak: "
                "offloading them lowers no peak and costs the copies. Compile the model's blocks one by one instead "
                "(for b in model.model.layers: b.compile(), or torch.compile(b) in their ModuleList), which %s "
                "supports, or compile the model with storm.partitioner(), which offloads inside the compiled graph "
                "(torch.compile(model, options={'custom_partitioner_fn': storm.partitioner()}))", who, what, who)


LATE_SAVES_MIN_BYTES = 64 << 20  # a step saving less is not judged: too little to tell from noise
LATE_SAVES_FRACTION = 0.75       # of a step's saved bytes, allocated already when the first reached the hooks


class LateSaves:
    """storm.offload's check, judged on one step a process, that the forward it wraps hands its
    saved tensors over as they are made. storm.offload sees no model, so it cannot probe the
    model as storm.enable does; it sees what the caching allocator holds instead: where most of a
    step's saved bytes were already allocated when the first of them reached the hooks, a graph
    compiled as one piece made them, and it warns as storm.enable does (unless a warning of that
    kind was given already). Blocks compiled one by one hand theirs over at each block's end, one
    block's worth at the first. ``allocated`` reads a device's allocated bytes (None: it cannot):
    the CUDA allocator's, unless a test gives another."""

    judged = False  # a step was judged in this process: no more checks

    def __init__(self, allocated: Reader = allocated_or_none):
        self._allocated = allocated
        self._device: torch.device | None = None
        self._at_enter: int | None = None
        self._before_first: int | None = None  # allocated since enter when the first save came
        self._saved = 0

    def enter(self, device: torch.device) -> None:
        """The step's forward starts on ``device`` (where its saves will be, as far as known)."""
        self._device, self._at_enter = device, self._allocated(device)
        self._before_first, self._saved = None, 0

    def saved(self, t: torch.Tensor) -> None:
        """A tensor reached the pack hook (parameters and other leaves that require grad are not
        made by the step and do not count)."""
        if self._at_enter is None or (t.is_leaf and t.requires_grad):
            return
        if self._before_first is None:
            if t.device != self._device:
                self._at_enter = None  # saves on another device than the one read: nothing to tell
                return
            self._before_first = self._allocated(self._device) - self._at_enter
        self._saved += t.untyped_storage().nbytes()

    def exit(self) -> None:
        """The step's forward ended: judged where it saved enough, warning where late."""
        if self._at_enter is None or self._before_first is None or self._saved < LATE_SAVES_MIN_BYTES:
            return
        LateSaves.judged = True
        if self._before_first >= LATE_SAVES_FRACTION * self._saved and not warn_whole_graph.cache_info().currsize:
            warn_whole_graph("storm.offload", "the forward it wraps")
