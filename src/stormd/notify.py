"""systemd's notify protocol (sd_notify), written directly: one datagram of
``KEY=VALUE`` lines to the unix socket named by $NOTIFY_SOCKET.

A dozen lines of socket code instead of a dependency: the protocol is a
single datagram write, and the PyPI packages for it either wrap libsystemd
(a C build, absent in slim containers) or are unmaintained. Outside systemd
(no $NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

log = logging.getLogger("stormd")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        # '@name' is a socket in the abstract namespace: its address starts with a NUL byte.
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_interval = _watchdog_interval(env)
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str | int) -> None:
        """``send(READY=1, STATUS="serving")`` -> the datagram ``READY=1\\nSTATUS=serving``."""
        if not self.address:
            return
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(payload, self.address)
        except OSError as e:  # systemd gone or a wrong path: the daemon keeps serving
            if not self._warned:
                log.warning("cannot notify systemd", extra={"notify_socket": self.address, "error": str(e)})
                self._warned = True


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WatchdogSec, as sd_watchdog_enabled advises; None when off."""
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):  # the watchdog is meant for another process
        return None
    try:
        interval = int(usec) / 2e6
    except ValueError:
        interval = 0.0
    if interval <= 0:  # as sd_watchdog_enabled refuses it: a negative one pinged without pause
        log.warning("ignoring WATCHDOG_USEC that is not a positive integer", extra={"value": usec})
        return None
    return interval
