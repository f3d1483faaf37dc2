"""Issue 7, item 4: who can reach stormd. The socket's directory and file keep other users out;
tcp:// (open to every local user) is served only with CURVE keys."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.auth
from test_ops_daemon import STORMCTL, wait_for_log

import storm
from conftest import Daemon, popen_stormd, start_daemon, stop_daemon
from helpers import RawClient, offload_one_step
from stormd.wire.curve import CLIENT_SECRET_ENV, SERVER_PUBLIC_ENV
from stormd.wire.endpoint import ensure_private_dir
from stormd.wire.protocol import PROTOCOL_VERSION, pack

NOBODY = 65534

def probe(sock_path: Path, pool_path: str) -> dict:
    """What a process can do with stormd's socket (as a plain unix socket and as a ZeroMQ client)
    and its pool segment."""
    out: dict = {"uid": os.getuid()}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock_path))
        out["connect"] = "connected"
    except OSError as e:
        out["connect"] = type(e).__name__
    finally:
        s.close()
    ctx = zmq.Context()  # a fresh context: the forked child must not use the parent's
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"ipc://{sock_path}")
    d.send(pack({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": os.getpid(), "host": "x"}))
    out["hello_answered"] = bool(d.poll(1500))
    d.close()
    ctx.term()
    try:
        open(pool_path, "rb").close()
        out["pool"] = "opened"
    except OSError as e:
        out["pool"] = type(e).__name__
    return out


def as_other_user(sock: Path, pool: str) -> dict:
    """``probe`` in a child that became uid/gid 65534 (fork, since that user cannot read this interpreter)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(w, json.dumps(probe(sock, pool)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return json.loads(out)


@pytest.fixture
def open_parent():
    """A directory every user may traverse, so only stormd's own directory and socket modes keep them out."""
    d = Path(tempfile.mkdtemp(prefix="storm-iso-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
def test_a_client_of_another_uid_is_refused(open_parent):
    d = start_daemon(open_parent, "--pool-size", "1MiB", "--no-metrics")
    try:
        owner = RawClient(d.endpoint)  # held: a client socket that closes ends its session at once
        pool = owner.hello()["pool"]["path"]
        assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(os.stat(pool).st_mode) == 0o600
        first = as_other_user(d.socket, pool)
        assert first == {"uid": NOBODY, "connect": "PermissionError", "hello_answered": False,
                         "pool": "PermissionError"}
        d.socket.parent.chmod(0o711)  # even with the directory opened up, the socket file's mode holds
        second = as_other_user(d.socket, pool)
        assert second == first
        assert RawClient(d.endpoint).call("STATUS")["node"]["clients"] == 1  # only the owner's session exists
    finally:
        stop_daemon(d)


def test_socket_directory_others_can_enter_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        ensure_private_dir(loose)
    r = subprocess.run([sys.executable, "-m", "stormd", "--socket", str(loose / "s.sock"), "--pool-size", "1MiB",
                        "--no-metrics"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "open to other users" in r.stderr, r.stderr
    if os.getuid() == 0:  # only root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(PermissionError, match=f"belongs to uid {NOBODY}"):
            ensure_private_dir(theirs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tcp_without_curve_keys_refuses_to_start(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stormd", "--socket", f"tcp://127.0.0.1:{free_port()}",
                        "--pool-size", "1MiB", "--no-metrics"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "tcp:// needs CURVE keys; set curve_secret_key and curve_authorized_keys" in r.stderr, r.stderr


@pytest.fixture
def curve_daemon(tmp_path):
    keys = tmp_path / "keys"
    authorized = tmp_path / "authorized"
    strangers = tmp_path / "strangers"
    for p in (keys, authorized, strangers):
        p.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(keys, "server")
    client_public, client_secret = zmq.auth.create_certificates(authorized, "client")
    zmq.auth.create_certificates(strangers, "stranger")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path / "stormd.log"
    proc = popen_stormd(["--socket", endpoint, "--pool-size", "4MiB", "--curve-secret-key", server_secret,
                         "--curve-authorized-keys", str(authorized)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    d = Daemon(tmp_path / "unused", proc, log)
    wait_for_log(d, "stormd ready", timeout=30)
    yield endpoint, server_public, client_secret, strangers / "stranger.key_secret"
    storm.close_all()
    proc.terminate()
    assert proc.wait(10) == 0, log.read_text()


def test_a_socket_with_no_connection_never_holds_the_clients_io_thread(monkeypatch):
    """A send on a socket with no connection to queue on blocks: a CURVE handshake the daemon
    refuses drops the connection (seen in CI: the client's thread held in HELLO's send, and
    connecting failed only after the 5 s join gave up). ZMQ_IMMEDIATE to a port nobody listens
    on gives such a socket every time. The I/O thread keeps what cannot go yet, so connecting
    fails at its timeout and the thread, free to see the shutdown, ends at once."""
    from storm import connection

    monkeypatch.setattr(connection, "client_curve_options", lambda endpoint: {zmq.IMMEDIATE: 1})
    t0 = time.monotonic()
    with pytest.raises(storm.StormUnavailable, match="no stormd answered .* within 1.5 s"):
        connection.DaemonConnection(f"tcp://127.0.0.1:{free_port()}", connect_timeout=1.5)
    assert time.monotonic() - t0 < 4.5
    assert not [t for t in threading.enumerate() if t.name == "storm-io"]


def test_tcp_serves_only_clients_with_an_authorized_curve_key(curve_daemon, monkeypatch):
    endpoint, server_public, client_secret, stranger_secret = curve_daemon
    monkeypatch.setenv(SERVER_PUBLIC_ENV, server_public)
    monkeypatch.setenv(CLIENT_SECRET_ENV, client_secret)
    lin, x = torch.nn.Linear(32, 32), torch.randn(16, 32)
    with storm.offload(mode="daemon", socket=endpoint, min_bytes=0) as ctx:  # the authorized key
        loss = lin(x).tanh().sum()
    ctx.synchronize()  # in the daemon now, so backward must fetch them over the CURVE socket
    loss.backward()
    assert ctx.backend_name.startswith(f"stormd at {endpoint}") and ctx.stats.fetched > 0
    storm.close_all()

    from storm.connection import DaemonConnection
    monkeypatch.setenv(CLIENT_SECRET_ENV, str(stranger_secret))  # a valid key pair the server does not know
    t0 = time.monotonic()
    with pytest.raises(storm.StormUnavailable, match="no stormd answered"):
        DaemonConnection(endpoint, connect_timeout=1.5)
    assert time.monotonic() - t0 < 5
    monkeypatch.delenv(CLIENT_SECRET_ENV)
    with pytest.raises(storm.StormUnavailable, match=CLIENT_SECRET_ENV):
        DaemonConnection(endpoint)
    plain = RawClient(endpoint, timeout_ms=1500)  # no CURVE at all: the handshake fails, nothing is read
    with pytest.raises(zmq.Again):
        plain.call("PING")


def test_stormctl_reaches_a_tcp_daemon_with_the_clients_curve_keys(curve_daemon):
    """Issue 49, item 5: stormctl set no CURVE keys, so a tcp:// daemon that the library client reached
    with STORM_CURVE_* never answered it ("is it running?"). Both take their keys from one function."""
    endpoint, server_public, client_secret, stranger_secret = curve_daemon
    env = {**os.environ, SERVER_PUBLIC_ENV: server_public, CLIENT_SECRET_ENV: client_secret}

    def stormctl(env: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([STORMCTL, "--socket", endpoint, *args], env=env, capture_output=True, text=True,
                              timeout=120)

    r = stormctl(env, "--json", "--timeout", "60", "status")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["endpoint"] == endpoint
    r = stormctl({**env, CLIENT_SECRET_ENV: str(stranger_secret)}, "--timeout", "1", "ping")
    assert r.returncode == 1 and "no stormd answered" in r.stderr, r.stderr
    r = stormctl({k: v for k, v in env.items() if k != CLIENT_SECRET_ENV}, "ping")
    assert r.returncode == 1 and f"a tcp:// stormd requires CURVE keys; set {CLIENT_SECRET_ENV}" in r.stderr, r.stderr


def pool_of(d) -> str:
    """The pool segment the daemon logged at start-up (read there, so no session is opened for it)."""
    return wait_for_log(d, r"stormd ready.* pool=(\S+)", timeout=30).group(1)


@pytest.mark.skipif(os.getuid() != 0, reason="handing a directory to another uid needs root")
@pytest.mark.parametrize("squat", ["owned-by-another-uid", "world-writable"])
def test_a_socket_directory_another_user_could_have_made_is_refused_before_anything_is_sent(
        tmp_path, squat, monkeypatch, caplog):
    """Issue 38, item 2: another user can make /tmp/stormd-UID first and serve a daemon in it.
    Here the directory of a running daemon is handed to uid 65534 (or opened to everyone): the
    client must refuse it before it sends a byte; mode='auto' runs embedded and says why."""
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    run = d.socket.parent
    try:
        if squat == "owned-by-another-uid":
            os.chown(run, NOBODY, NOBODY)
            owner, mode = NOBODY, "0o700"
        else:
            run.chmod(0o777)
            owner, mode = 0, "0o777"
        said = f"refusing the stormd socket directory {run}: it belongs to uid {owner} with mode {mode}"
        with pytest.raises(storm.StormUntrusted, match=re.escape(said) + ".*accepted: a directory of this user"):
            offload_one_step(mode="daemon", socket=str(d.socket))
        with caplog.at_level(logging.WARNING, logger="storm"):
            ctx = offload_one_step(socket=str(d.socket))
        assert ctx.backend_name == "embedded store" and ctx.stats.offloaded > 0
        assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.WARNING], caplog.text
        assert "client connected" not in d.output()  # not even a HELLO reached it
        if squat == "owned-by-another-uid":  # the container case: stormd runs as a service uid the user names
            monkeypatch.setenv("STORM_DAEMON_UID", str(NOBODY))
            assert offload_one_step(mode="daemon", socket=str(d.socket)).backend_name.startswith("stormd")
    finally:
        storm.close_all()
        os.chown(run, 0, 0)
        run.chmod(0o700)
        stop_daemon(d)


@pytest.mark.skipif(os.getuid() != 0, reason="a link of another uid needs root")
def test_a_socket_directory_name_another_user_made_a_symlink_is_refused_in_both_modes(
        tmp_path, open_parent, monkeypatch, caplog):
    """Another user who made /tmp/stormd-UID first can make it a symlink and repoint it between the
    client's check and its connection (shown: .scratch/attack/a4_trust_symlink_race.py): at the check,
    at a directory of the user's, at the connection, at its own with its own daemon in it. So the link
    is refused as such, here while it leads to the user's own running daemon, and nothing reaches it."""
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    open_parent.chmod(0o1777)  # as /tmp: every user may make a name in it
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    squatted = open_parent / f"stormd-{os.getuid()}"
    squatted.symlink_to(d.socket.parent, target_is_directory=True)
    os.lchown(squatted, NOBODY, NOBODY)
    sock = squatted / d.socket.name
    try:
        said = (f"refusing the stormd socket directory {squatted}: it is a symlink (to '{d.socket.parent}', owned by "
                f"uid {NOBODY}); accepted: a directory itself, not a symlink to one, of this user")
        with pytest.raises(storm.StormUntrusted, match=re.escape(said)):
            offload_one_step(mode="daemon", socket=str(sock))
        with caplog.at_level(logging.WARNING, logger="storm"):
            ctx = offload_one_step(socket=str(sock))
        assert ctx.backend_name == "embedded store" and ctx.stats.offloaded > 0
        assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.WARNING], caplog.text
        assert "client connected" not in d.output()
    finally:
        storm.close_all()
        stop_daemon(d)


@pytest.mark.parametrize("change", ["open-to-others", "owned-by-another-uid"])
def test_a_pool_segment_of_another_user_or_open_to_others_is_refused_before_any_put(tmp_path, change, monkeypatch):
    """The daemon names its pool in HELLO; a pool another uid owns, or that others may open, is not
    a trusted daemon's: the client says BYE without storing anything."""
    if change == "owned-by-another-uid" and os.getuid() != 0:
        pytest.skip("handing a file to another uid needs root")
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    pool = pool_of(d)
    try:
        if change == "open-to-others":
            os.chmod(pool, 0o666)
            said = f"refusing stormd's pool segment {pool}: it belongs to uid {os.getuid()} with mode 0o666"
        else:
            os.chown(pool, NOBODY, NOBODY)
            said = f"refusing stormd's pool segment {pool}: it belongs to uid {NOBODY} with mode 0o600"
        with pytest.raises(storm.StormUntrusted, match=re.escape(said) + ".*accepted: a file of this user"):
            offload_one_step(mode="daemon", socket=str(d.socket))
        wait_for_log(d, "client disconnected", timeout=30)  # its BYE
        status = RawClient(d.endpoint).call("STATUS")
        assert status["traffic"]["puts"] == 0 and status["node"]["clients"] == 0, status
        if change == "owned-by-another-uid":
            monkeypatch.setenv("STORM_DAEMON_UID", str(NOBODY))
            assert offload_one_step(mode="daemon", socket=str(d.socket)).backend_name.startswith("stormd")
    finally:
        storm.close_all()
        if os.getuid() == 0:
            os.chown(pool, os.getuid(), os.getgid())
        os.chmod(pool, 0o600)
        stop_daemon(d)


def test_storm_daemon_uid_must_be_a_uid(tmp_path, monkeypatch):
    monkeypatch.setenv("STORM_DAEMON_UID", "storm")
    with pytest.raises(ValueError, match="STORM_DAEMON_UID='storm': must be a numeric uid"):
        offload_one_step(mode="daemon", socket=str(tmp_path / "run" / "stormd.sock"))


def test_the_default_socket_directory_is_checked_too(tmp_path, monkeypatch):
    """The runtime directory's socket (what a plain storm.offload() uses) gets the same check, before
    even the probe that tells a live socket from a stale one."""
    monkeypatch.delenv("STORMD_SOCKET", raising=False)
    monkeypatch.delenv("STORM_DAEMON_UID", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    run = tmp_path / "stormd"
    run.mkdir()
    run.chmod(0o777)  # anyone could have put the socket there
    (run / "stormd.sock").touch()
    with pytest.raises(storm.StormUntrusted, match=f"refusing the stormd socket directory {run}: .* mode 0o777"):
        offload_one_step(mode="daemon")
