"""Offloading in a model torch.compile compiles as one graph.

Under a graph compiled as one piece, autograd's saved-tensor hooks see the saved tensors only once
the whole forward has run, after its memory peak. Here storm's partitioner puts the offloading
into the compiled graphs instead (rewrite.py): each large saved tensor is handed to the store as
soon as it is made, the graph frees it after its last use in forward, and backward loads it before
its first use, through the same session, store and prefetch as storm.offload (ops.py).

    model = torch.compile(model, options={"custom_partitioner_fn": storm.partitioner()})

or, where a framework calls torch.compile itself (Trainer's ``torch_compile``, Lightning,
accelerate), before it compiles: ``torch._inductor.config.custom_partitioner_fn = storm.partitioner()``.
"""

from __future__ import annotations

from ..options import bytes_option, mode_option, pool_size_option, socket_option
from ..policy import DEFAULT_MIN_BYTES
from ..saved import DEFAULT_MAX_HELD_BYTES
from .rewrite import GraphOptions, Partitioner  # ImportError where torch has no custom partitioners

__all__ = ["partitioner", "Partitioner", "GraphOptions"]


def partitioner(*, mode: str = "auto", socket: str | None = None, pool_size: int | str | None = None,
                min_bytes: int | str = DEFAULT_MIN_BYTES, held_bytes: int | str = DEFAULT_MAX_HELD_BYTES,
                budget: int | str | None = None, memory_budget: float | None = None) -> Partitioner:
    """Inductor's partitioner with storm's offloading, for ``custom_partitioner_fn``.

    ``mode``, ``socket``, ``pool_size``, ``min_bytes``: as storm.offload's. ``held_bytes``: how many
    bytes of saves a copy may run behind forward before forward waits for it; the last
    ``held_bytes`` of a forward's saves stay on the device (backward needs them first).
    ``budget``: offload at most this many bytes a forward of each compiled graph (a model split by
    graph breaks has several), the earliest saves first (None: all but the last ``held_bytes``).
    ``memory_budget``: torch's ``activation_memory_budget`` (a fraction in (0, 1]) for these graphs'
    min-cut alone, whose selective recompute then chooses what is saved, of which storm offloads
    ``budget``: torch's recompute and storm's offload in one compiled graph (``budget=0``: torch's
    alone). None: the global ``torch._functorch.config``'s, which is not part of a compiled graph's
    cache key: a second model of the same code compiled under another global budget reuses the
    first one's graph, where this one's is.
    Saves are stored raw (no codec) and only those of static shape."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float))
                                      or not 0 < memory_budget <= 1):
        raise ValueError(f"memory_budget must be a fraction in (0, 1] (torch's activation_memory_budget) or None, "
                         f"got {memory_budget!r}")
    mode = mode_option(mode)
    return Partitioner(GraphOptions(
        mode=mode, socket=socket_option(mode, socket), pool_size=pool_size_option(pool_size),
        min_bytes=bytes_option("min_bytes", min_bytes), held_bytes=bytes_option("held_bytes", held_bytes),
        budget=None if budget is None else bytes_option("budget", budget),
        memory_budget=None if memory_budget is None else float(memory_budget)))
