"""Exceptions the client raises. All derive from StormError."""

from __future__ import annotations


class StormError(RuntimeError):
    """Base class of STORM's errors."""


class StormUnavailable(StormError):
    """No stormd answered (mode='daemon'), or the daemon went away mid-request."""


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
