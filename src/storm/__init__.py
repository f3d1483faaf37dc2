"""STORM: offload autograd's saved activations to host memory.

    import storm
    with storm.offload():          # stormd if one runs, else an embedded store
        loss = model(batch).sum()
    loss.backward()
"""

from __future__ import annotations

from typing import Any

import torch

from .enabled import Enabled, enable
from .errors import (
    StormError,
    StormInPlaceError,
    StormIntegrityError,
    StormRequestError,
    StormUnavailable,
    StormUntrusted,
)
from .hooks import Offload, offload
from .planner import Planner, plan
from .policy import Keep
from .registry import close_all, session_used
from .sac import checkpoint_policy
from .stats import OffloadStats

__version__ = "0.1.0"


def partitioner(**options: Any) -> Any:
    """torch.compile's partitioner with storm's offloading, for a model compiled as one graph
    (storm.graph.partitioner has the options)::

        model = torch.compile(model, options={"custom_partitioner_fn": storm.partitioner()})
    """
    try:  # torch.compile's modules load here, not at `import storm`
        from .graph import partitioner as storm_partitioner
    except ImportError as e:
        raise RuntimeError(f"storm.partitioner needs torch.compile's custom_partitioner_fn, which torch "
                           f"{torch.__version__} lacks ({e}); compile the model's blocks one by one instead "
                           f"(for b in model.model.layers: b.compile()) and use storm.offload or storm.plan") from None
    return storm_partitioner(**options)


def stats(mode: str = "auto", socket: str | None = None) -> dict[str, Any]:
    """The store's counters for this process's session and for the whole node (pool, clients, errors),
    and which store that is (``store``: "stormd at ...", or "embedded store (...)", which says the
    daemon it took the place of when one stopped). The session is the one of ``mode`` and ``socket``
    that a step took last, whatever pool_size its contexts gave."""
    session = session_used(mode, socket)
    session.synchronize()
    reply = session.mover.request("STATS").result(timeout=10)
    return {"store": session.describe(), "session": reply["session"], "node": reply["node"]}


__all__ = ["offload", "Offload", "plan", "Planner", "enable", "Enabled", "partitioner", "checkpoint_policy",
           "OffloadStats", "Keep", "stats", "close_all", "StormError", "StormUnavailable", "StormUntrusted",
           "StormInPlaceError", "StormIntegrityError", "StormRequestError", "__version__"]
