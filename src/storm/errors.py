"""Exceptions the client raises. All derive from StormError. A daemon that stopped serving this
process is said by ``DaemonLoss`` (how and since when) and raised as its ``StormDaemonLost``."""

from __future__ import annotations

import time
from dataclasses import dataclass

# how a daemon stopped serving a client, as DaemonLoss.how
DRAINED = "drained"      # it drains (SIGTERM, SIGINT, SIGHUP, stormctl drain) and exits
KILLED = "killed"        # it stopped answering: killed, or hung
RESTARTED = "restarted"  # another daemon answers at its endpoint now
ENDED = "ended"          # it ended this client's session and serves on
FAILED = "failed"        # the connection itself failed


@dataclass(frozen=True, eq=False)  # each loss is its own: said once in the log however alike two are
class DaemonLoss:
    """How the daemon at ``endpoint`` stopped serving this process (``how``: one of DRAINED, KILLED,
    RESTARTED, ENDED, FAILED), since when (``since``: time.time()), and what more is known
    (``detail``: the signal that started a drain, the silence, the daemon that answers now)."""

    endpoint: str
    how: str
    since: float
    detail: str

    def said(self) -> str:
        """In words, with the time it has been so counted from now."""
        clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        when = f"{clock} ({max(0.0, time.time() - self.since):.1f} s ago)"
        who = f"stormd at {self.endpoint}"
        return {
            DRAINED: f"{who} stopped: it began draining at {when} on {self.detail}: it takes no new tensors, "
                     f"and exits once its clients hold none or its drain_timeout passes",
            KILLED: f"{who} stopped: it last answered at {when} and did not answer for {self.detail} after that: "
                    f"it was killed, or it hangs",
            RESTARTED: f"{who} stopped: it restarted, and the stormd that answers there since {when} "
                       f"({self.detail}) knows nothing of this process's session",
            ENDED: f"{who} ended this process's session at {when}: {self.detail}",
        }.get(self.how, f"the connection to {who} failed at {when}: {self.detail}")

    def error(self) -> StormDaemonLost:
        return StormDaemonLost(self)


class StormError(RuntimeError):
    """Base class of STORM's errors."""


class StormUnavailable(StormError):
    """No stormd answered (mode='daemon'), or the daemon went away mid-request."""


class StormDaemonLost(StormUnavailable):
    """The daemon this process offloaded to stopped serving it: ``loss`` says how and since when."""

    def __init__(self, loss: "DaemonLoss"):
        super().__init__(f"{loss.said()}. A step whose saved tensors it still held cannot finish "
                         f"(its backward raises this): redo that step. To go on, start stormd again (the next "
                         f"step reconnects), or use storm.offload(mode='auto'), which goes on with the embedded "
                         f"store")
        self.loss = loss


class StormNoDaemon(StormUnavailable):
    """No daemon is there: no socket, or one that a daemon that is gone left behind. Unlike a daemon
    that answered and cannot be used, this is what mode='auto' expects, and it falls back quietly."""


class StormUntrusted(StormUnavailable):
    """The daemon at the socket is not a trusted user's (its directory, socket or pool belongs to
    another uid or is open to other users); nothing was offloaded through it."""


class StormRequestError(StormError):
    """The daemon (or the embedded store) refused a request; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class StormInPlaceError(StormError):
    """A saved tensor was modified in place before STORM finished copying it.

    Autograd's own version check is switched off while saved_tensors_hooks are
    active, so STORM checks instead and refuses to return a value that may
    differ from the one saved."""


class StormIntegrityError(StormError):
    """Bytes read back from the pool do not match the checksum taken when they were stored."""
