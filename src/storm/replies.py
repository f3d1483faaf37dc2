"""A store's reply as the result the client waits on: a Future completed from it, or a Resolved one.

Both backends (connection.py, embedded.py) answer with these, and backend.py,
which opens the backends, names them in its interface: defined in backend.py,
they made each backend import the module that imports it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from .errors import StormRequestError


def resolve(fut: Future, reply: dict[str, Any]) -> None:
    """Complete ``fut`` from a reply map: its fields, or StormRequestError for an error reply."""
    error = _error(reply)
    if error is None:
        fut.set_result(reply)
    else:
        fut.set_exception(error)


def _error(reply: dict[str, Any]) -> StormRequestError | None:
    return None if reply.get("ok") else StormRequestError(str(reply.get("error")), str(reply.get("message")))


class Resolved:
    """A result that is in already: the part of Future's interface the client uses, without
    the condition variable a Future builds, locks and notifies (which costs
    more than the embedded store's whole request)."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value, self._error = value, error

    @classmethod
    def reply(cls, reply: dict[str, Any]) -> "Resolved":
        """From a reply map, like ``resolve``."""
        error = _error(reply)
        return cls(None if error is not None else reply, error)

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Any) -> None:
        fn(self)
