"""stormd's log lines: structured (logfmt key=value, or JSON), and error replies rate-limited.

Context goes in ``extra=`` fields, not in the message text, so a log pipeline
can filter on ``session=3`` or ``code=POOL_FULL`` without parsing prose.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
    if record.exc_info:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info logger=stormd msg="client connected" session=3``."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the same keys as the text format."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def _logfmt_value(v: Any) -> str:
    s = str(v)
    if s and not any(c in s for c in ' "=\n\\'):
        return s
    return json.dumps(s)  # quoted, with quotes, backslashes and newlines escaped


def configure(level: str, fmt: str) -> None:
    """Send every logger's records to stderr (journald and docker collect it) in ``fmt``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@dataclass
class _Window:
    start: float
    suppressed: int = 0


class ErrorReplyLog:
    """Logs error replies without letting a flood of bad requests fill the disk.

    Per error code, the first error of each ``interval`` is logged with its
    message; the others in that interval are only counted, and the count is
    logged (``suppressed=N``) when the interval is over: with the next error
    of that code or at ``flush()``, which the daemon calls periodically. So at
    most two lines per code per interval, whatever the request rate.
    """

    def __init__(self, logger: logging.Logger, interval: float, clock: Any = time.monotonic):
        self.log = logger
        self.interval = interval
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def record(self, code: str, message: str) -> None:
        now = self.clock()
        w = self._windows.get(code)
        if w is not None and now - w.start < self.interval:
            w.suppressed += 1
            return
        if w is not None and w.suppressed:
            self._report_suppressed(code, w)
        self._windows[code] = _Window(now)
        self.log.warning("error reply", extra={"code": code, "detail": message})

    def flush(self, everything: bool = False) -> None:
        """Log the counts of intervals that are over, or of all of them (at shutdown), and forget them."""
        now = self.clock()
        for code, w in list(self._windows.items()):
            if everything or now - w.start >= self.interval:
                if w.suppressed:
                    self._report_suppressed(code, w)
                del self._windows[code]

    def _report_suppressed(self, code: str, w: _Window) -> None:
        self.log.warning("error replies not logged one by one", extra={
            "code": code, "suppressed": w.suppressed, "interval_s": self.interval})
