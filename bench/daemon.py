"""A stormd for one benchmark run: started in a directory of its own, answered before use."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from stormd.config import socket_is_live

START_TIMEOUT_S = 120.0  # a pool of many GiB is reserved (posix_fallocate) before the socket opens


def start_daemon(workdir: Path, pool_size: str, *flags: str, log: Path | None = None,
                 cprofile: Path | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m stormd`` with its socket under ``workdir``; returns the process and its endpoint
    once the socket answers. ``log``: a file for its output (default: this process's).
    ``cprofile``: run it under cProfile, which writes this file when stormd exits (SIGTERM)."""
    sock = workdir / "run" / "stormd.sock"
    out = log.open("w") if log is not None else None
    profiled = ["-m", "cProfile", "-o", str(cprofile)] if cprofile is not None else []
    proc = subprocess.Popen([sys.executable, *profiled, "-m", "stormd", "--socket", str(sock), "--pool-size", pool_size,
                             *flags],
                            stdout=out, stderr=subprocess.STDOUT if out is not None else None)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (sock.exists() and socket_is_live(sock)):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f": {log.read_text()}" if log is not None else ""
            raise RuntimeError(f"stormd did not start{why}")
        time.sleep(0.05)
    return proc, f"ipc://{sock}"
