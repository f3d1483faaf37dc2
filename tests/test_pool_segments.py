"""Stale pool segments: a segment is removed only when its daemon is certainly gone.

A second stormd of the same uid, in another PID namespace that shares the pool directory (a
container with --ipc=host), judged the first daemon's segment by kill(pid, 0): that pid names no
process in its namespace, so it removed a live pool and every new client of the first daemon
fell back to the embedded store. The daemon now holds its segment locked for the pool's life,
and only a segment nobody holds is removed. Such a segment is simulated here by a name whose pid
exists nowhere, held locked through a descriptor of its own (as the other namespace's daemon
would hold it). And a client that cannot map a daemon's pool says so at WARNING.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

import pytest

import storm
from conftest import start_daemon, stop_daemon
from helpers import offload_one_step
from stormd.wire.pool import SEGMENT_PREFIX, SharedPool, remove_stale_segments

NO_SUCH_PID = 999_999_999  # above any pid_max: no process has it, in this namespace or another


def segment(directory: Path, pid: int = NO_SUCH_PID) -> Path:
    p = directory / f"{SEGMENT_PREFIX}{os.getuid()}-{pid}-abcd1234"
    p.write_bytes(b"\0" * 4096)
    p.chmod(0o600)
    return p


def held(path: Path) -> int:
    """A descriptor of ``path`` of its own that holds its lock, as the daemon that made it does."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def lockable(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_segment_its_daemon_holds_is_kept_though_its_pid_names_no_process_here(tmp_path):
    live = segment(tmp_path)
    fd = held(live)
    try:
        assert remove_stale_segments(tmp_path) == []
        assert live.exists()
        SharedPool.create(4096, str(tmp_path)).close()  # a second daemon starting in that directory
        assert live.exists()
    finally:
        os.close(fd)
    assert remove_stale_segments(tmp_path) == [str(live)]  # its daemon died: the kernel dropped the lock


def test_a_segment_nobody_holds_is_removed_unless_its_pid_is_alive_here(tmp_path):
    dead = segment(tmp_path)
    unlocked_but_alive = segment(tmp_path, os.getppid())  # a daemon of an earlier version holds no lock
    assert remove_stale_segments(tmp_path) == [str(dead)]
    assert not dead.exists() and unlocked_but_alive.exists()


def test_the_pools_segment_is_held_while_it_lives_and_let_go_at_close(tmp_path):
    pool = SharedPool.create(4096, str(tmp_path))
    path = Path(pool.path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not lockable(path)
        pool.close()
        assert not path.exists()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError: close let the lock go
    finally:
        os.close(fd)


@pytest.fixture
def quiet_daemon_uid(monkeypatch):
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    yield
    storm.close_all()


def test_a_daemon_whose_pool_cannot_be_mapped_falls_back_at_warning_naming_why(tmp_path, caplog, quiet_daemon_uid):
    """What a second daemon's sweep did to the first daemon's clients: they fell back to the embedded
    store at INFO, which nobody reads, while the daemon they were meant to use kept running."""
    shm = tmp_path / "shm"
    shm.mkdir()
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--pool-dir", str(shm), "--no-metrics")
    try:
        [seg] = list(shm.iterdir())
        seg.unlink()
        with caplog.at_level(logging.INFO, logger="storm"):
            ctx = offload_one_step(socket=str(d.socket))  # mode='auto'
        assert ctx.backend_name == "embedded store"
        said = [r for r in caplog.records if "using the embedded store" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING], caplog.text
        assert str(d.socket) in said[0].getMessage() and "cannot map its pool" in said[0].getMessage()
        assert f"{seg}: No such file or directory" in said[0].getMessage()
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("left", ["nothing", "a dead daemon's socket"])
def test_no_daemon_there_falls_back_as_quietly_as_before(tmp_path, caplog, quiet_daemon_uid, left):
    path = tmp_path / "run" / "stormd.sock"
    if left != "nothing":
        path.parent.mkdir(mode=0o700)
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))  # closed unlistened: the file stays, as a killed daemon leaves it
    with caplog.at_level(logging.INFO, logger="storm"):
        ctx = offload_one_step(socket=str(path))
    assert ctx.backend_name == "embedded store"
    said = [r for r in caplog.records if "using the embedded store" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], caplog.text
    assert ("no stormd socket" if left == "nothing" else "left over") in said[0].getMessage()


def test_a_segment_swept_before_its_creator_could_lock_it_is_made_again_under_another_name(tmp_path, monkeypatch):
    """Between the new file and its lock, another namespace's daemon may take it for stale and
    remove it (create_held then raises FileNotFoundError): the pool takes a second name."""
    from stormd.wire import pool as pool_module
    real, calls = pool_module.create_held, []

    def swept_once(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(f"{path} was removed as it was created")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(pool_module, "create_held", swept_once)
    pool = SharedPool.create(4096, str(tmp_path))
    try:
        assert len(calls) == 2 and calls[0] != calls[1] and pool.path == str(calls[1])
        assert [p.name for p in tmp_path.iterdir()] == [calls[1].name]
    finally:
        pool.close()
