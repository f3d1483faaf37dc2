"""Start a stormd child process for this job: ``python -m stormd`` (under a profiler where asked),
dying with the process that started it, serving no metrics unless asked, and waited for until its
socket answers.

Tests, benchmarks and any program that runs its own daemon for one job start it here. It knows
the daemon only by its command line and its socket, not by its internals.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from stormd.wire.endpoint import socket_is_live

START_TIMEOUT_S = 120.0  # a pool of many GiB is reserved (posix_fallocate) before the socket opens
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
METRICS_FLAGS = {"--metrics", "--no-metrics"}


def die_with_parent(parent: int) -> None:
    """In a child before it runs stormd (preexec_fn): the kernel sends it SIGTERM (a drain, then
    exit) when the thread that started it ends, so no job's daemon outlives its run however that
    ends (interrupted, killed): an orphan kept its pool and the default metrics port, and the next
    real stormd then ran without metrics. ``parent``: the starting process's pid, read before the
    fork, to catch a parent that died before the signal was set up."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def popen_stormd(args: Sequence[str], python_args: Sequence[str] = (), **popen: object) -> subprocess.Popen:
    """``python *python_args -m stormd *args``, dying with this process (die_with_parent). It serves
    no metrics unless ``args`` asks (--metrics; --metrics-port 0 for any free port), whatever a
    config file or $STORMD_METRICS says: the default port belongs to the node's real stormd.
    ``python_args``: the interpreter's own options, or a module that runs stormd in turn, such as a
    profiler (``-m cProfile -o FILE``: written when stormd exits, a drain included)."""
    args = list(args)
    if not METRICS_FLAGS & {a.split("=")[0] for a in args}:
        args.append("--no-metrics")
    parent = os.getpid()
    return subprocess.Popen([sys.executable, *python_args, "-m", "stormd", *args],
                            preexec_fn=lambda: die_with_parent(parent), **popen)


def wait_until_serving(proc: subprocess.Popen, socket: Path, timeout: float = START_TIMEOUT_S,
                       log: Path | None = None) -> None:
    """Return once ``proc`` answers on ``socket`` (a killed daemon's file may linger, so the socket
    is asked, not only looked for). RuntimeError, with ``log``'s text where given, if it exits
    first or ``timeout`` seconds pass; a daemon that did not answer in time is killed."""
    deadline = time.monotonic() + timeout
    while not (socket.exists() and socket_is_live(socket)):
        why = f": {log.read_text()}" if log is not None else ""
        if proc.poll() is not None:
            raise RuntimeError(f"stormd exited with {proc.returncode}{why}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"stormd did not answer on {socket} within {timeout} s{why}")
        time.sleep(0.02)


def start_stormd(workdir: Path, pool_size: str, *flags: str, log: Path | None = None,
                 timeout: float = START_TIMEOUT_S, python_args: Sequence[str] = (),
                 **popen: object) -> tuple[subprocess.Popen, str]:
    """A stormd (popen_stormd, ``python_args`` included) with its socket under ``workdir`` and a pool
    of ``pool_size``; returns the process and its endpoint once it answers. ``log``: a file for its
    output (default: this process's)."""
    sock = workdir / "run" / "stormd.sock"
    args = ["--socket", str(sock), "--pool-size", pool_size, *flags]
    if log is None:
        proc = popen_stormd(args, python_args, **popen)
    else:
        with log.open("w") as out:  # the child writes to its own copy of the descriptor
            proc = popen_stormd(args, python_args, **{"stdout": out, "stderr": subprocess.STDOUT, **popen})
    wait_until_serving(proc, sock, timeout, log)
    return proc, f"ipc://{sock}"
