"""stormd as a separate process: sessions, isolation, malformed input, pool limits, lifecycle."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import xxhash

import storm
from conftest import fall_back_then_reconnect, start_daemon, stop_daemon
from helpers import RawClient, put_fields, relu_mlp
from stormd.wire.protocol import PROTOCOL_VERSION, ErrorCode, pack


def write_extent(pool_path: str, offset: int, data: bytes) -> None:
    with open(pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[offset:offset + len(data)] = data


def read_extent(pool_path: str, offset: int, n: int) -> bytes:
    with open(pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        return bytes(m[offset:offset + n])


def store(c: RawClient, pool: str, key: int, data: bytes, step: int = 1) -> int:
    r = c.call("PUT", **put_fields(key, len(data), step))
    assert r["ok"], r
    write_extent(pool, r["offset"], data)
    assert c.call("SEAL", key=key, checksum=xxhash.xxh3_64_intdigest(data))["ok"]
    return r["offset"]


def test_put_get_free_and_sessions_are_isolated(daemon):
    a, b = RawClient(daemon.endpoint), RawClient(daemon.endpoint)
    pool = a.hello()["pool"]["path"]
    b.hello()
    store(a, pool, 1, b"A" * 1000)
    store(b, pool, 1, b"B" * 1000)  # the same key in another session is another tensor
    ra, rb = a.call("GET", key=1), b.call("GET", key=1)
    assert read_extent(pool, ra["offset"], 1000) == b"A" * 1000
    assert read_extent(pool, rb["offset"], 1000) == b"B" * 1000
    store(a, pool, 2, b"only a")
    r = b.call("GET", key=2)
    assert not r["ok"] and r["error"] == ErrorCode.NOT_FOUND
    r = b.call("FREE", keys=[2])
    assert not r["ok"] and r["error"] == ErrorCode.NOT_FOUND
    assert a.call("GET", key=2)["ok"]  # b's attempt freed nothing of a's
    forged = b.call("GET", key=2, **{"session": a.auth["session"], "token": "0" * 32})
    assert forged["error"] == ErrorCode.UNAUTHORIZED
    assert a.call("FREE", step=1)["freed"] == 2
    st = a.call("STATS")
    assert st["session"]["keys"] == 0 and st["node"]["clients"] == 2
    assert b.call("BYE")["freed"] == 1
    assert b.call("PING", **b.auth)["error"] == ErrorCode.UNAUTHORIZED  # the session is gone


def test_get_before_seal_and_duplicate_keys(daemon):
    c = RawClient(daemon.endpoint)
    c.hello()
    assert c.call("PUT", **put_fields(5, 100))["ok"]
    assert c.call("GET", key=5)["error"] == ErrorCode.NOT_SEALED
    assert c.call("PUT", **put_fields(5, 100))["error"] == ErrorCode.DUPLICATE_KEY


def test_version_mismatch_is_explained(daemon):
    c = RawClient(daemon.endpoint)
    r = c.call("HELLO", version=PROTOCOL_VERSION + 1, pid=1, host="h")
    assert r["error"] == ErrorCode.VERSION_MISMATCH and "install matching versions" in r["message"]


def test_full_pool_is_an_error_reply_not_a_crash(small_daemon):
    c = RawClient(small_daemon.endpoint)
    pool = c.hello()["pool"]["path"]
    store(c, pool, 1, b"x" * 40_000)
    r = c.call("PUT", **put_fields(2, 40_000))
    assert r["error"] == ErrorCode.POOL_FULL and "free" in r["message"]
    assert c.call("PUT", **put_fields(3, 1 << 30))["error"] == ErrorCode.TOO_LARGE
    assert read_extent(pool, c.call("GET", key=1)["offset"], 40_000) == b"x" * 40_000


MALFORMED = [
    (b"\xc1garbage",), (b"",), (pack([1, 2, 3]),), (pack({"op": "NOPE", "id": 1}),),
    (pack({"op": "PUT", "id": 1, "session": 1, "token": "x"}),),
    (pack({"op": "GET", "id": "one", "session": 1, "token": "x", "key": 1}),),
    (pack({"op": "PUT", "id": 2, "session": 1, "token": "x", **put_fields(1, 1 << 62)}),),
    (pack({"op": "PUT", "id": 3, "session": 1, "token": "x", **{**put_fields(1, 64), "storage_offset": 1 << 40}}),),
    (pack({"op": "PING", "id": 4}), b"second frame"),
    (pack({1: 2}),),
]


def test_malformed_messages_get_errors_and_others_keep_working(daemon):
    good = RawClient(daemon.endpoint)
    pool = good.hello()["pool"]["path"]
    store(good, pool, 1, b"precious" * 100)
    evil = RawClient(daemon.endpoint)
    for frames in MALFORMED:
        r = evil.send_frames(*frames)
        assert r["ok"] is False and r["error"] in {ErrorCode.BAD_MESSAGE, ErrorCode.BAD_FIELD,
                                                   ErrorCode.UNKNOWN_OP, ErrorCode.UNAUTHORIZED}, (frames, r)
        assert r["message"]
    assert evil.call("PING")["ok"]
    r = good.call("GET", key=1)
    assert read_extent(pool, r["offset"], 800) == b"precious" * 100
    assert r["checksum"] == xxhash.xxh3_64_intdigest(b"precious" * 100)


def test_silent_client_is_dropped_and_its_extents_freed(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--client-timeout", "0.5")
    try:
        c = RawClient(d.endpoint)
        pool = c.hello()["pool"]["path"]
        store(c, pool, 1, b"z" * 500_000)
        watcher = RawClient(d.endpoint)
        watcher.hello()
        deadline = time.monotonic() + 60  # the drop comes after 0.5 s; a loaded machine may take longer
        while (node := watcher.call("STATS")["node"])["used"]:
            assert time.monotonic() < deadline, f"the silent client's extents still held after 60 s: {node}"
            time.sleep(0.1)
        assert node["clients"] == 1
        assert "no message for 0.5 s" in d.output()
    finally:
        stop_daemon(d)


CLIENT = textwrap.dedent("""
    import copy, sys, torch, storm
    from storm.examples.models import GPT, same_bits
    torch.manual_seed(int(sys.argv[2]))
    m = GPT(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    idx = torch.randint(0, 256, (2, 17))
    ref = copy.deepcopy(m)
    for step in range(5):
        torch.manual_seed(step); ref.loss(idx[:, :-1], idx[:, 1:]).backward()
        torch.manual_seed(step)
        with storm.offload(mode="daemon", socket=sys.argv[1], min_bytes=0) as ctx:
            loss = m.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        assert ctx.stats.offloaded > 0
        for a, b in zip(ref.parameters(), m.parameters()):
            assert same_bits(a.grad, b.grad), "gradient differs"
    print("OK", ctx.backend_name)
""")


def test_two_training_processes_at_once(daemon):
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, daemon.endpoint, str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.startswith("OK"), err
    sessions = {out.split("session ")[1].split(",")[0] for out, _ in outs}
    assert len(sessions) == 2
    c = RawClient(daemon.endpoint)
    c.hello()
    assert c.call("STATS")["node"]["used"] == 0  # both said BYE at exit and everything was freed


def test_sigterm_exits_cleanly_and_removes_socket_and_pool(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB")
    pool = RawClient(d.endpoint).hello()["pool"]["path"]
    assert os.path.exists(pool)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(10) == 0
    assert not d.socket.exists() and not os.path.exists(pool)


def test_stale_pool_segment_of_a_killed_daemon_is_removed(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB")
    pool = RawClient(d.endpoint).hello()["pool"]["path"]
    d.proc.kill()
    d.proc.wait()
    assert os.path.exists(pool)
    d.socket.unlink()
    d2 = start_daemon(tmp_path, "--pool-size", "1MiB")
    try:
        assert not os.path.exists(pool)
    finally:
        stop_daemon(d2)


@pytest.mark.parametrize("args,message", [
    (["--pool-size", "12XB"], "cannot read size"),
    (["--pool-dir", "/nonexistent"], "does not exist"),
    (["--pool-size", "100TiB"], "does not fit"),
    (["--socket", "tcp://10.1.2.3:5555"], "loopback"),
])
def test_bad_configuration_is_refused_with_a_reason(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "stormd", "--socket", str(tmp_path / "s.sock"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_second_daemon_on_the_same_socket_is_refused(daemon):
    r = subprocess.run([sys.executable, "-m", "stormd", "--socket", str(daemon.socket), "--pool-size", "1MiB",
                        "--no-metrics"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "another stormd" in r.stderr
    assert RawClient(daemon.endpoint).call("PING")["ok"]


def test_daemon_killed_mid_step_then_embedded_then_restarted(tmp_path, monkeypatch):
    import torch
    from torch import nn

    import storm

    d = start_daemon(tmp_path, "--pool-size", "16MiB")
    monkeypatch.setenv("STORMD_SOCKET", d.endpoint)
    lin = nn.Linear(256, 256)
    x = torch.randn(512, 256)
    try:
        with storm.offload(min_bytes=0) as ctx:
            loss = lin(x).tanh().sum()
        ctx.synchronize()
        assert ctx.backend_name.startswith("stormd")
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(storm.StormUnavailable, match="did not answer"):
            loss.backward()  # the saved tensors lived in the daemon: this step cannot finish
        assert time.monotonic() - t0 < 15
        with pytest.raises(storm.StormUnavailable):
            with storm.offload(mode="daemon"):
                pass
        d = fall_back_then_reconnect(tmp_path, lambda: lin(x).tanh().sum().backward())
    finally:
        storm.close_all()
        stop_daemon(d)


def test_client_name_selects_its_quota_and_tensors_over_it_stay(tmp_path, monkeypatch):
    import copy

    import torch
    from torch import nn

    import storm
    from storm.examples.models import same_bits

    d = start_daemon(tmp_path, "--pool-size", "16MiB", "--clients", "small=300KiB:0")
    monkeypatch.setenv("STORM_CLIENT_NAME", "small")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    ref = copy.deepcopy(model)
    x = torch.randn(256, 128)
    try:
        with storm.offload(mode="daemon", socket=d.endpoint, min_bytes=0) as ctx:
            loss = model(x).square().sum()
        ctx.synchronize()
        assert ctx.stats.kept.get(storm.Keep.QUOTA, 0) >= 1 and ctx.stats.offloaded >= 1
        loss.backward()
        ref(x).square().sum().backward()
        assert all(same_bits(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))
    finally:
        storm.close_all()
        stop_daemon(d)


def test_the_daemon_codec_setting_reaches_clients(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "64MiB", "--codec", "auto")
    try:
        m, x = relu_mlp()
        with storm.offload(mode="daemon", socket=d.endpoint, min_bytes=0) as ctx:
            loss = m(x).sum()
        ctx.synchronize()
        loss.backward()
        assert ctx.stats.stored_bytes < 0.8 * ctx.stats.offloaded_bytes
        s = storm.stats(mode="daemon", socket=d.endpoint)
        assert s["session"]["raw_bytes_in"] == ctx.stats.offloaded_bytes > s["session"]["bytes_in"]
    finally:
        storm.close_all()
        stop_daemon(d)


STOPPED_PEER = textwrap.dedent("""
    import sys, zmq
    from zmq.utils.monitor import recv_monitor_message
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    events = sock.get_monitor_socket()
    sock.connect(sys.argv[1])
    def wait_for(event, seconds):
        poller = zmq.Poller()
        poller.register(events, zmq.POLLIN)
        while poller.poll(seconds * 1000):
            if recv_monitor_message(events)["event"] == event:
                return True
        return False
    assert wait_for(zmq.EVENT_HANDSHAKE_SUCCEEDED, 60), "no handshake with the daemon"
    print("ready", flush=True)
    sys.stdin.readline()  # the parent stops this process, resumes it, then writes a line
    print("disconnected" if wait_for(zmq.EVENT_DISCONNECTED, 60) else "still connected", flush=True)
""")


def connections_to(sock: Path) -> int:
    """Connections the daemon holds on its unix socket ``sock``: Linux lists each accepted socket in
    /proc/net/unix under its listener's path, connected (state 03); a client's end has no path."""
    with open("/proc/net/unix") as f:
        rows = [line.split(None, 7) for line in f.read().splitlines()[1:]]
    return sum(1 for r in rows if len(r) == 8 and r[7] == str(sock) and r[5] == "03")


def test_a_peer_that_answers_nothing_is_disconnected_by_zeromqs_heartbeats(tmp_path):
    """A stopped process answers no ZMTP heartbeat: the daemon's socket closes its connection after
    stormd.server.heartbeat_timeout (2 s at this client_timeout), freeing what libzmq holds for it.
    Without the heartbeat options the connection stays open however long the peer is stopped."""
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--client-timeout", "0.5")
    peer = subprocess.Popen([sys.executable, "-c", STOPPED_PEER, d.endpoint], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "ready"
        assert connections_to(d.socket) == 1
        peer.send_signal(signal.SIGSTOP)
        # the peer stays stopped until the daemon has closed its end: after heartbeat_timeout, later on
        # a loaded host, never earlier
        deadline = time.monotonic() + 60
        while connections_to(d.socket):
            assert time.monotonic() < deadline, "the daemon still holds the stopped peer's connection after 60 s"
            time.sleep(0.1)
        peer.send_signal(signal.SIGCONT)
        peer.stdin.write("go\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "disconnected"
        assert peer.wait(timeout=120) == 0
    finally:
        peer.kill()
        stop_daemon(d)
