"""Models and blocks under torch.compile: which are compiled, and the one warning for a model
compiled as one graph.

A graph that torch.compile compiled as one piece (AOTAutograd's forward) hands the tensors it
saves for backward to the saved-tensor hooks only once the whole graph has run: after forward's
memory peak, so offloading them lowers nothing at the peak and costs the copies. Blocks compiled
one by one hand theirs over as each block ends, which STORM offloads and plans as in eager mode.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

import torch
from torch import nn

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
                "supports", who, what, who)
