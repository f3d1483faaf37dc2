"""The stormd that tests and benchmarks start (conftest.start_daemon, stormd/launch.py) serves no
metrics unless asked, so it never takes the default port (9466) from the node's real stormd,
and it dies with the process that started it however that ends: an interrupted pytest once
left an orphaned stormd (parent 1) holding 127.0.0.1:9466, and the next real stormd ran
without metrics."""

from __future__ import annotations

import gc
import os
import pstats
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from test_ops_daemon import wait_for_log

from conftest import start_daemon, stop_daemon, stop_process
from helpers import RawClient
from stormd.launch import start_stormd
from stormd.wire.endpoint import socket_is_live

TESTS = Path(__file__).resolve().parent

DEADLINE_S = 60.0  # a drain takes at most its 5 s deadline; the rest is a loaded machine's slack

PARENT = """
import sys, time
from pathlib import Path
from conftest import start_daemon  # tests/ is on PYTHONPATH
d = start_daemon(Path(sys.argv[1]), "--pool-size", "1MiB")
print(d.proc.pid, flush=True)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_test_daemon_dies_with_the_process_that_started_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(TESTS)})
    pid = None
    try:
        line = parent.stdout.readline()  # once its daemon answers, or empty where the parent failed
        assert line.strip().isdigit(), f"the parent did not start its daemon: {parent.stderr.read()}"
        pid, sock = int(line), tmp_path / "run" / "stormd.sock"
        assert running(pid) and socket_is_live(sock)
        parent.send_signal(signal.SIGKILL)  # as a runner killing pytest would: no finalizer runs
        parent.wait()
        deadline = time.monotonic() + DEADLINE_S
        while running(pid):
            assert time.monotonic() < deadline, (f"stormd {pid} still runs {DEADLINE_S:g} s after the process that "
                                                 f"started it was killed:\n{(tmp_path / 'stormd.log').read_text()}")
            time.sleep(0.1)
        assert not socket_is_live(sock)
    finally:
        parent.kill()
        parent.wait()
        if pid is not None and running(pid):
            os.kill(pid, signal.SIGKILL)


def test_test_daemons_serve_no_metrics_unless_asked(tmp_path):
    for name in ("tests", "bench"):
        (tmp_path / name).mkdir()
    d = start_daemon(tmp_path / "tests", "--pool-size", "1MiB")
    try:
        assert "metrics=off" in wait_for_log(d, r"stormd ready.*", timeout=DEADLINE_S).group(0), d.output()
    finally:
        stop_daemon(d)
    log = tmp_path / "bench.log"
    proc, _ = start_stormd(tmp_path / "bench", "1MiB", log=log)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while "stormd ready" not in log.read_text():
            assert time.monotonic() < deadline, f"no 'stormd ready' line within {DEADLINE_S:g} s:\n{log.read_text()}"
            time.sleep(0.05)
        assert "metrics=off" in log.read_text(), log.read_text()
    finally:
        stop_process(proc)


def test_a_daemon_that_exits_before_answering_is_reported_with_its_output(tmp_path):
    log = tmp_path / "stormd.log"
    with pytest.raises(RuntimeError, match=r"stormd exited with \d+: (?s:.*)pool-size"):
        start_stormd(tmp_path, "not-a-size", log=log)


@pytest.mark.parametrize("helper", ["launch.start_stormd", "conftest.start_daemon"])
def test_the_log_file_a_daemon_is_started_with_is_closed_in_the_process_that_started_it(tmp_path, helper):
    """The child writes to its own copy of the descriptor: this process's file was left open (a
    descriptor held until collected, then a ResourceWarning), one per daemon a job started."""
    log = tmp_path / "stormd.log"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        if helper == "launch.start_stormd":
            proc, _ = start_stormd(tmp_path, "1MiB", log=log)
        else:
            proc = start_daemon(tmp_path, "--pool-size", "1MiB").proc
        try:
            gc.collect()
        finally:
            stop_process(proc)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning) and str(log) in str(w.message)], \
        [str(w.message) for w in caught]


def test_python_args_run_stormd_under_a_profiler_that_writes_its_stats_when_stormd_drains(tmp_path):
    """What bench/ddp.py --profile starts: ``python -m cProfile -o FILE -m stormd ...``, a job's daemon
    like any other (socket, no metrics, dying with its parent), whose profile is there once it exits."""
    prof, log = tmp_path / "stormd.prof", tmp_path / "stormd.log"
    proc, endpoint = start_stormd(tmp_path, "1MiB", log=log, python_args=["-m", "cProfile", "-o", str(prof)])
    try:
        assert RawClient(endpoint, timeout_ms=int(DEADLINE_S * 1000)).call("PING")["ok"]
        assert "metrics=off" in log.read_text(), log.read_text()
        proc.terminate()  # a drain: stormd returns from main, and cProfile writes its file
        assert proc.wait(DEADLINE_S) == 0, log.read_text()
    finally:
        stop_process(proc)
    profiled = pstats.Stats(str(prof)).stats  # (file, line, function) -> its figures
    assert any(path.endswith(os.path.join("stormd", "main.py")) and name == "_serve"
               for path, _, name in profiled), sorted(profiled)[:20]
