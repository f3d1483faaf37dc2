"""A daemon the user did not start, reached through a name someone else can repoint: the socket's
directory is opened once, never through a symlink, and the connection goes through what was opened;
the pool a daemon names must be a stormd segment. The other-uid cases, which need root, are in
test_faults_isolation.py."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq
from test_ops_daemon import wait_for_log

import storm
from conftest import popen_stormd, start_daemon, stop_daemon
from helpers import offload_one_step
from storm import backend, trust
from storm.connection import DaemonConnection
from stormd.wire.endpoint import ensure_private_dir
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, pack, unpack


@pytest.fixture(autouse=True)
def _only_this_user(monkeypatch):
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    yield
    storm.close_all()


class FakeDaemon:
    """A ROUTER at ``directory``/stormd.sock that answers HELLO naming ``pool`` as its pool, and
    records every op it is sent: a daemon that is not the one the client should reach."""

    def __init__(self, directory: Path, pool: str, pool_size: int = 1 << 20):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.socket = directory / "stormd.sock"
        self.pool, self.pool_size = pool, pool_size
        self.ops: list[str] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{self.socket}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            peer, frame = self._sock.recv_multipart()
            m = unpack(frame)
            self.ops.append(m["op"])
            r = {"id": m["id"], "ok": True}
            if m["op"] == "HELLO":
                r.update(session=1, token="t", pool={"path": self.pool, "size": self.pool_size}, server="fake",
                         version=PROTOCOL_VERSION, codec="raw", cuda_devices=[])
            self._sock.send_multipart([peer, pack(r)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._sock.close(linger=0)
        self._ctx.term()


def test_a_symlinked_socket_directory_is_refused_even_when_it_leads_to_the_users_own_daemon(tmp_path, caplog):
    """The link is the user's and leads to the user's running stormd; still refused, in both modes,
    before anything reaches the socket: whoever owns a link can repoint it between check and use."""
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    link = tmp_path / "link"
    link.symlink_to(d.socket.parent, target_is_directory=True)
    sock = link / d.socket.name
    try:
        said = f"refusing the stormd socket directory {link}: it is a symlink (to '{d.socket.parent}', owned by uid " \
               f"{os.getuid()}); accepted: a directory itself, not a symlink to one, of this user"
        with pytest.raises(storm.StormUntrusted, match=re.escape(said)):
            offload_one_step(mode="daemon", socket=str(sock))
        with pytest.raises(storm.StormUntrusted, match=re.escape(said)):
            DaemonConnection(f"ipc://{sock}")  # made directly, the connection checks for itself
        with caplog.at_level(logging.WARNING, logger="storm"):
            ctx = offload_one_step(socket=str(sock))  # mode='auto'
        assert ctx.backend_name == "embedded store" and ctx.stats.offloaded > 0
        assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.WARNING], caplog.text
        assert "client connected" not in d.output()  # not even a HELLO reached it
        # the same daemon, named by its real directory, is used
        assert offload_one_step(mode="daemon", socket=str(d.socket)).backend_name.startswith("stormd at")
    finally:
        storm.close_all()
        stop_daemon(d)


def test_stormd_refuses_a_symlinked_socket_directory(tmp_path):
    """Even a link to a private directory of this user: stormd would bind wherever the link leads
    when it binds, not where it led when checked."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(PermissionError, match=re.escape(f"socket directory {link} is a symlink (to '{real}'")):
        ensure_private_dir(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    with pytest.raises(PermissionError, match=re.escape(f"socket directory {dangling} is a symlink")):
        ensure_private_dir(dangling)
    assert not (tmp_path / "nowhere").exists()  # not made through the link either

    log = tmp_path / "stormd.log"
    proc = popen_stormd(["--socket", str(link / "s.sock"), "--pool-size", "1MiB", "--no-metrics"],
                        stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120  # generous: the machine may be busy; a fixed stormd exits at once
    while proc.poll() is None and not (real / "s.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    served = (real / "s.sock").exists()
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
    assert not served and proc.returncode == 2, log.read_text()
    assert f"socket directory {link} is a symlink" in log.read_text()


def test_the_connection_goes_to_the_directory_that_was_checked_even_if_the_name_is_repointed(tmp_path,
                                                                                            monkeypatch):
    """The socket path runs through a symlink above its directory (allowed: /tmp, a home or
    XDG_RUNTIME_DIR may be one). Between the check and the connection the link is repointed at
    another directory with another daemon in it: the client still reaches the daemon it checked."""
    (tmp_path / "a").mkdir()
    d = start_daemon(tmp_path / "a", "--pool-size", "1MiB", "--no-metrics")
    other = FakeDaemon(tmp_path / "b" / "run", pool=str(tmp_path / "no-pool"))
    via = tmp_path / "via"
    via.symlink_to(tmp_path / "a", target_is_directory=True)
    sock = via / "run" / "stormd.sock"
    probed: list[Path] = []

    def repoint_then_probe(path: Path) -> bool:  # the seam: runs after the check, before the connect
        probed.append(path)
        (tmp_path / "via.new").symlink_to(tmp_path / "b", target_is_directory=True)
        os.replace(tmp_path / "via.new", via)
        return real_probe(path)

    real_probe = backend.socket_is_live
    monkeypatch.setattr(backend, "socket_is_live", repoint_then_probe)
    try:
        ctx = offload_one_step(mode="daemon", socket=str(sock))
        assert ctx.backend_name.startswith(f"stormd at ipc://{sock}") and ctx.stats.offloaded > 0
        wait_for_log(d, "client connected", timeout=60)
        assert other.ops == []  # the daemon the name now leads to heard nothing
        assert re.fullmatch(r"/proc/self/fd/\d+/stormd\.sock", str(probed[0])), probed
    finally:
        storm.close_all()
        other.close()
        stop_daemon(d)


def test_the_connection_holds_the_checked_directory_open_until_it_closes(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    try:
        conn = DaemonConnection(d.endpoint)
        checked = conn._checked
        fd = checked.dir_fd
        assert conn._connect_to == f"ipc:///proc/self/fd/{fd}/stormd.sock"
        assert os.path.samestat(os.fstat(fd), os.stat(d.socket.parent))
        assert conn.request("PING").result(30)["ok"]
        conn.close()
        assert checked.dir_fd == -1
        try:  # the number may have been reused since, but not for that directory
            assert not os.path.samestat(os.fstat(fd), os.stat(d.socket.parent))
        except OSError:
            pass
    finally:
        stop_daemon(d)


def test_without_proc_self_fd_the_client_fails_closed(tmp_path, monkeypatch):
    """Connecting by name instead would reopen the race, so no /proc means no daemon."""
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    monkeypatch.setattr(trust.CheckedSocket, "via", property(lambda self: Path(f"/no-proc/self/fd/{self.dir_fd}/x")))
    opened_before = set(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(storm.StormUntrusted, match=re.escape(f"refusing the stormd socket {d.socket}: the client "
                                                                 "connects only through the directory it checked")
                           + ".*accepted: a Linux system with /proc mounted"):
            offload_one_step(mode="daemon", socket=str(d.socket))
        assert set(os.listdir("/proc/self/fd")) <= opened_before  # the directory it opened was closed
        assert "client connected" not in d.output()
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("what", ["regular-file", "symlink-to-a-socket"])
def test_a_socket_name_that_is_not_a_socket_is_refused(tmp_path, what):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    if what == "regular-file":
        (mine / "stormd.sock").write_bytes(b"")
        said = "it is a regular file of uid"
    else:
        (mine / "stormd.sock").symlink_to(d.socket)
        said = "it is a symlink of uid"
    try:
        with pytest.raises(storm.StormUntrusted, match=re.escape(f"refusing the stormd socket {mine / 'stormd.sock'}: "
                                                                 f"{said}") + ".*accepted: a socket of this user"):
            offload_one_step(mode="daemon", socket=str(mine / "stormd.sock"))
        assert "client connected" not in d.output()
    finally:
        stop_daemon(d)


def test_a_pool_that_is_not_a_stormd_segment_is_refused_before_any_put(tmp_path):
    """A daemon in a directory of this user's (its own, say, misbehaving) names in HELLO a 0600 file of
    the user's that is no segment: the client says BYE and writes nothing into it."""
    secret = tmp_path / "id_ed25519"
    secret.write_bytes(b"KEY MATERIAL\n" * 100_000)
    secret.chmod(0o600)
    before = secret.read_bytes()
    fake = FakeDaemon(tmp_path / "run", pool=str(secret))
    try:
        said = (f"refusing stormd's pool segment {secret}: it is not named as stormd names its segments; "
                f"accepted: an absolute path whose file name is stormd-UID-PID-HEX")
        with pytest.raises(storm.StormUntrusted, match=re.escape(said)):
            offload_one_step(mode="daemon", socket=str(fake.socket))
        deadline = time.monotonic() + 60
        while "BYE" not in fake.ops and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fake.ops == ["HELLO", "BYE"]
        assert secret.read_bytes() == before
    finally:
        fake.close()


@pytest.mark.parametrize("name", ["id_ed25519", "stormd-0-1-abc.bak", "stormd-x-1-ab", "stormd-0-1-ab\n",
                                  "relative:stormd-0-1-ab"])
def test_check_pool_accepts_only_stormd_segment_names(tmp_path, name):
    path = name[len("relative:"):] if name.startswith("relative:") else str(tmp_path / name)
    f = tmp_path / "f"
    f.write_bytes(b"x")
    f.chmod(0o600)
    with pytest.raises(storm.StormUntrusted, match="not named as stormd names its segments"):
        trust.check_pool(path, os.stat(f))


def test_check_pool_accepts_the_segment_stormd_creates(tmp_path):
    pool = SharedPool.create(4096, str(tmp_path))
    try:
        trust.check_pool(pool.path, os.stat(pool.path))  # no exception: the name and the file are stormd's
    finally:
        pool.close()
