from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import storm
from stormd import host_share, launch


def pytest_configure(config):
    """Under pytest-xdist each worker runs torch with one thread, and so do the processes tests
    start: workers as many as cores, each with torch's default of a thread per core, would spin
    their OpenMP threads against each other and run every CPU-bound test many times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # the slow tests first (a stable sort: each module's order otherwise kept), so that pytest-xdist's
    # workers start with them rather than one worker ending the run alone on the last of them
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_backends():
    """Each test gets its own connections and embedded store."""
    yield
    storm.close_all()


@pytest.fixture(autouse=True)
def _own_ledger(monkeypatch, tmp_path_factory):
    """The embedded stores a test makes in this process share the host's memory among themselves
    (stormd/host_share.py), not with the user's training: a test's stand-in host (room=) would set
    the budget of the ledger in /dev/shm that every embedded store of the user reads."""
    monkeypatch.setattr(host_share, "LEDGER_ROOT", str(tmp_path_factory.mktemp("shm")))


class Daemon:
    def __init__(self, socket: Path, proc: subprocess.Popen, log: Path):
        self.socket = socket
        self.proc = proc
        self.log = log

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket}"

    def output(self) -> str:
        return self.log.read_text()


_started: list[subprocess.Popen] = []  # every stormd a test started, stopped at its end (_stop_daemons_left)


def popen_stormd(args: list[str], **popen: object) -> subprocess.Popen:
    """A test's ``python -m stormd *args``: it dies with this process and serves no metrics unless
    asked (stormd.launch.popen_stormd), and is stopped at the test's end if still running."""
    proc = launch.popen_stormd(args, **popen)
    _started.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _stop_daemons_left():
    """Whatever a test left running (it failed before stopping its daemon) is stopped and reaped."""
    yield
    while _started:
        stop_process(_started.pop())


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still there after 10 s; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_daemon(tmp_path: Path, *args: str, timeout: float = 60.0) -> Daemon:
    """A stormd on a socket under ``tmp_path`` (see popen_stormd), once the socket answers."""
    sock_dir = tmp_path / "run"
    sock = sock_dir / "stormd.sock"
    log = tmp_path / "stormd.log"
    # every test daemon refuses a tensor placed over another's bytes, so a placement bug fails loudly
    env = {**os.environ, "STORMD_CHECK_EXTENTS": "1"}
    with log.open("w") as out:  # the child writes to its own copy of the descriptor
        proc = popen_stormd(["--socket", str(sock), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    launch.wait_until_serving(proc, sock, timeout, log)
    return Daemon(sock, proc, log)


def stop_daemon(d: Daemon) -> None:
    stop_process(d.proc)
    # a client falls back quietly when a PUT is refused, so the refusal is looked for in the log
    assert "ExtentConflict" not in d.output(), f"stormd placed a tensor over a live one:\n{d.output()}"


def serve(tmp_path: Path, pool_size: str):
    """A daemon for one test; it must exit cleanly (0) once the test's clients are closed."""
    d = start_daemon(tmp_path, "--pool-size", pool_size)
    yield d
    storm.close_all()
    stop_daemon(d)
    assert d.proc.returncode == 0, d.output()


@pytest.fixture
def daemon(tmp_path):
    yield from serve(tmp_path, "256MiB")


@pytest.fixture
def small_daemon(tmp_path):
    """A daemon whose pool holds only a few small tensors."""
    yield from serve(tmp_path, "64KiB")


@pytest.fixture
def spill_dir():
    """A directory for a spill file, on disk as stormd requires (/tmp may be a tmpfs on some hosts;
    /var/tmp is disk by convention)."""
    d = tempfile.mkdtemp(prefix="stormd-spill-test-", dir="/var/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def env_without_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("STORMD_SOCKET", f"ipc://{tmp_path}/nobody/stormd.sock")


def fall_back_then_reconnect(tmp_path: Path, step, *daemon_args: str) -> Daemon:
    """After a daemon was killed: the next step (mode auto) runs embedded, and a daemon started
    again on the same socket is used from the step after. Returns that daemon."""
    with storm.offload(min_bytes=0) as ctx:
        step()
    assert ctx.backend_name == "embedded store" and ctx.stats.offloaded > 0
    d = start_daemon(tmp_path, "--pool-size", "16MiB", *daemon_args)  # the stale socket file is replaced
    with storm.offload(min_bytes=0) as ctx:
        step()
    assert ctx.backend_name.startswith("stormd")
    return d
