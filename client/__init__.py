"""STORM: offload autograd's saved activations to host memory.

    import storm
    with storm.offload():          # stormd if one runs, else an embedded store
        loss = model(batch).sum()
    loss.backward()
"""

from __future__ import annotations

from typing import Any

from .errors import (StormError, StormInPlaceError, StormIntegrityError, StormRequestError, StormUnavailable,
                     StormUntrusted)
from .enabled import Enabled, enable
from .hooks import Offload, offload
from .planner import Planner, plan
from .policy import Keep
from .session import close_all, session_for
from .stats import OffloadStats

__version__ = "0.1.0"


def stats(mode: str = "auto", socket: str | None = None) -> dict[str, Any]:
    """The store's counters for this process's session and for the whole node (pool, clients, errors)."""
    session = session_for(mode, socket, None)
    session.synchronize()
    reply = session.mover.request("STATS").result(timeout=10)
    return {"session": reply["session"], "node": reply["node"]}


__all__ = ["offload", "Offload", "plan", "Planner", "enable", "Enabled", "OffloadStats", "Keep", "stats", "close_all", "StormError", "StormUnavailable",
           "StormUntrusted", "StormInPlaceError", "StormIntegrityError", "StormRequestError", "__version__"]
