"""A stormd for one benchmark run or test: started in a directory of its own, answered before
use, dying with the process that started it, and serving no metrics unless asked."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import storm
from stormd.wire.endpoint import socket_is_live

START_TIMEOUT_S = 120.0  # a pool of many GiB is reserved (posix_fallocate) before the socket opens
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
METRICS_FLAGS = {"--metrics", "--no-metrics", "--metrics-port"}


def die_with_parent(parent: int) -> None:
    """In a child before it runs stormd (preexec_fn): the kernel sends it SIGTERM (a drain, then
    exit) when the thread that started it ends, so no benchmark's or test's daemon outlives its
    run however that ends (interrupted, killed): an orphan kept its pool and the default metrics
    port, and the next real stormd then ran without metrics. ``parent``: the starting process's
    pid, read before the fork, to catch a parent that died before the signal was set up."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def popen_stormd(args: list[str], cpus: set[int] | None = None, python: Sequence[str] = (),
                 **popen: object) -> subprocess.Popen:
    """``python [*python] -m stormd *args``, dying with this process (die_with_parent), on
    ``cpus`` only where given. It serves no metrics unless ``args`` asks (--metrics or
    --metrics-port, 0 for any free port): the default port belongs to the node's real stormd."""
    if not METRICS_FLAGS & {a.split("=")[0] for a in args}:
        args = [*args, "--no-metrics"]
    parent = os.getpid()

    def before_exec() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        die_with_parent(parent)

    return subprocess.Popen([sys.executable, *python, "-m", "stormd", *args], preexec_fn=before_exec, **popen)


def start_daemon(workdir: Path, pool_size: str, *flags: str, log: Path | None = None,
                 cprofile: Path | None = None, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m stormd`` (popen_stormd) with its socket under ``workdir``; returns the process
    and its endpoint once the socket answers. ``log``: a file for its output (default: this process's).
    ``cprofile``: run it under cProfile, which writes this file when stormd exits (SIGTERM).
    ``cpus``: the only CPUs it may run on (default: this process's)."""
    sock = workdir / "run" / "stormd.sock"
    out = log.open("w") if log is not None else None
    profiled = ["-m", "cProfile", "-o", str(cprofile)] if cprofile is not None else []
    proc = popen_stormd(["--socket", str(sock), "--pool-size", pool_size, *flags], cpus, profiled,
                        stdout=out, stderr=subprocess.STDOUT if out is not None else None)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (sock.exists() and socket_is_live(sock)):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f": {log.read_text()}" if log is not None else ""
            raise RuntimeError(f"stormd did not start{why}")
        time.sleep(0.05)
    return proc, f"ipc://{sock}"


def stop_daemon(proc: subprocess.Popen) -> None:
    """Say BYE for this process's sessions, then stop ``proc``: a session still holding keys makes
    stormd wait out its drain deadline (5 s) before it stops."""
    storm.close_all()
    proc.terminate()
    proc.wait(30)


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,8,10-11") as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def physical_cores() -> list[frozenset[int]]:
    """The CPUs this process may run on, grouped by physical core (SMT siblings together, as
    /sys says; a CPU without topology there is a core of its own), in CPU order."""
    allowed = os.sched_getaffinity(0)
    cores: dict[frozenset[int], None] = {}
    for cpu in sorted(allowed):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings = parse_cpu_list(path.read_text()) if path.exists() else {cpu}
        cores[frozenset((siblings & allowed) | {cpu})] = None
    return list(cores)


def split_cores(cores: list[frozenset[int]], daemon_cores: int) -> tuple[set[int], set[int]]:
    """(stormd's CPUs, the training process's): the last ``daemon_cores`` physical cores, SMT
    siblings included, for stormd, the others for the training process, so no thread of one
    shares a core with a thread of the other."""
    if not 0 < daemon_cores < len(cores):
        raise ValueError(f"stormd may have 1 to {len(cores) - 1} of the {len(cores)} physical cores this "
                         f"process may run on, not {daemon_cores}")
    return set().union(*cores[-daemon_cores:]), set().union(*cores[:-daemon_cores])


def thread_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of process ``pid`` (its id) -> the CPUs it may run on."""
    out = {}
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(status.parent.name)] = parse_cpu_list(line.split(":", 1)[1])
    return out
