"""stormd run as a service: systemd notify, drain on SIGTERM, Prometheus metrics, stormctl, logs."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import read_extent, store

from conftest import Daemon, start_daemon, stop_daemon
from helpers import RawClient, put_fields
from stormd.main import metrics_readers
from stormd.wire.protocol import ALL_ERROR_CODES, PROTOCOL_VERSION, ErrorCode, pack, unpack

STORMCTL = str(Path(sys.executable).parent / "stormctl")


def wait_for_log(d: Daemon, pattern: str, timeout: float = 10.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, d.output())
        if m:
            return m
        time.sleep(0.02)
    raise AssertionError(f"no log line matching {pattern!r} within {timeout} s:\n{d.output()}")


def recv_notifications(sock: socket.socket, until: set[str], timeout: float = 10.0) -> list[str]:
    """Datagrams' lines until every prefix in ``until`` has been seen."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not all(any(line.startswith(u) for line in lines) for u in until):
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            lines += sock.recv(4096).decode().split("\n")
        except TimeoutError:
            raise AssertionError(f"saw {lines}, not all of {until}") from None
    return lines


def test_notify_socket_sees_ready_status_and_watchdog(tmp_path, monkeypatch):
    # An abstract-namespace address ('@...'), as systemd uses, checks that case of the protocol too.
    name = f"storm-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # pings every 0.1 s
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    try:
        first = listener.recv(4096).decode().split("\n")
        assert first[0] == "READY=1" and d.socket.exists()  # the socket was bound before READY
        assert first[1].startswith("STATUS=serving 0 clients, pool 0 of 1MiB used")
        t0 = time.monotonic()
        assert "WATCHDOG=1" in recv_notifications(listener, {"WATCHDOG=1"})
        assert time.monotonic() - t0 < 2.0
        assert RawClient(d.endpoint).call("PING")["ok"]  # the daemon still serves while it pings the watchdog
        d.proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in recv_notifications(listener, {"STOPPING=1"})
        assert d.proc.wait(10) == 0
    finally:
        stop_daemon(d)
        listener.close()


@pytest.mark.parametrize("usec", ["-1000000", "0", "ten"])
def test_a_watchdog_usec_that_is_no_positive_integer_turns_no_watchdog_on(usec, caplog):
    """As systemd's sd_watchdog_enabled refuses it: a negative one made an interval under zero, and
    the watchdog task pinged without pause on the loop that serves every client."""
    from stormd.notify import Notifier

    caplog.set_level(logging.WARNING, logger="stormd")
    assert Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": usec}).watchdog_interval is None
    assert any("WATCHDOG_USEC" in r.getMessage() for r in caplog.records)


def test_sigterm_drains_gets_are_answered_puts_refused_then_exit_0(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--drain-timeout", "30")
    try:
        c = RawClient(d.endpoint)
        pool = c.hello()["pool"]["path"]
        data = {k: bytes([k]) * (1000 * k) for k in (1, 2, 3)}
        for k, v in data.items():
            store(c, pool, k, v)
        # A GET in flight when SIGTERM arrives: sent, not yet read.
        c.sock.send(pack({"op": "GET", "id": 100, **c.auth, "key": 1}))
        d.proc.send_signal(signal.SIGTERM)
        r = c.recv()
        assert r["ok"] and r["id"] == 100 and read_extent(pool, r["offset"], 1000) == data[1]
        wait_for_log(d, r'msg="draining.*reason=SIGTERM')
        put = c.call("PUT", **put_fields(9, 100))
        assert not put["ok"] and put["error"] == ErrorCode.DRAINING
        newcomer = RawClient(d.endpoint).call("HELLO", version=PROTOCOL_VERSION, pid=1, host="h")
        assert newcomer["error"] == ErrorCode.DRAINING
        time.sleep(0.3)  # still serving: this client holds tensors and the deadline is 30 s
        assert d.proc.poll() is None
        for k in (2, 3):
            r = c.call("GET", key=k)
            assert r["ok"] and read_extent(pool, r["offset"], len(data[k])) == data[k]
        assert c.call("FREE", keys=[1, 2])["freed"] == 2
        assert d.proc.poll() is None  # key 3 is still held
        assert c.call("BYE")["freed"] == 1
        # the last release ends the drain: it exits within half its 30 s deadline however loaded the
        # machine (alone it takes a fraction of a second; under the suite's load it has taken 2.2 s)
        assert d.proc.wait(15) == 0
        assert 'msg="drained: no client holds a tensor; stopping"' in d.output()
        assert not d.socket.exists() and not os.path.exists(pool)
    finally:
        stop_daemon(d)


def test_drain_ends_at_the_deadline_when_a_client_keeps_its_tensors(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--drain-timeout", "0.5")
    try:
        c = RawClient(d.endpoint)
        store(c, c.hello()["pool"]["path"], 1, b"kept" * 100)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(5) == 0
        assert 0.4 < time.monotonic() - t0 < 3
        assert re.search(r'drain deadline passed.* keys=1 clients=1', d.output())
    finally:
        stop_daemon(d)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_endpoint_counts_exactly_the_traffic_sent(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--metrics", "--metrics-port", "0")
    try:
        url = wait_for_log(d, r"metrics=(http://\S+)").group(1)
        assert url.startswith("http://127.0.0.1:")  # loopback by default
        assert re.search(r'level=info .*msg="metrics endpoint answers without authentication" '
                         rf'url={re.escape(url)} readable_by="any local user"', d.output()), d.output()
        c = RawClient(d.endpoint)
        pool = c.hello()["pool"]["path"]
        sizes = [1000, 2048, 4096, 777]
        for k, n in enumerate(sizes, 1):
            store(c, pool, k, b"m" * n)
        for k in (1, 2):
            assert c.call("GET", key=k)["ok"]
        for _ in range(3):
            assert c.call("GET", key=99)["error"] == ErrorCode.NOT_FOUND
        assert c.send_frames(b"\xc1 not msgpack")["error"] == ErrorCode.BAD_MESSAGE
        assert c.call("PUT", **put_fields(1, 10))["error"] == ErrorCode.DUPLICATE_KEY

        m = scrape(url)
        assert m[("stormd_puts_total", ())] == 4
        assert m[("stormd_bytes_in_total", ())] == sum(sizes)
        assert m[("stormd_stored_bytes_total", ())] == sum(sizes)
        assert m[("stormd_compression_ratio", ())] == 1.0
        assert m[("stormd_gets_total", ())] == 2
        assert m[("stormd_bytes_out_total", ())] == 1000 + 2048
        assert m[("stormd_clients", ())] == 1 and m[("stormd_keys", ())] == 4
        assert m[("stormd_pool_capacity_bytes", ())] == 1 << 20
        status = RawClient(d.endpoint).call("STATUS")  # an admin verb: no session
        assert m[("stormd_startup_seconds", ())] == status["startup_s"] > 0
        assert m[("stormd_pool_page_locked_bytes", ())] == status["node"]["page_locked_bytes"]
        assert m[("stormd_pool_page_lock_seconds", ())] == (status["page_lock_s"] or 0)
        assert sum(sizes) <= m[("stormd_pool_used_bytes", ())] <= sum(sizes) + 4 * 256  # extents are aligned
        errors = {dict(k[1])["code"]: v for k, v in m.items() if k[0] == "stormd_errors_total"}
        assert errors == {**{code: 0 for code in ALL_ERROR_CODES}, "NOT_FOUND": 3, "BAD_MESSAGE": 1,
                          "DUPLICATE_KEY": 1}
        count = {dict(k[1])["op"]: v for k, v in m.items() if k[0] == "stormd_request_duration_seconds_count"}
        assert count["HELLO"] == 1 and count["PUT"] == 5 and count["SEAL"] == 4 and count["GET"] == 5
        # the loop's load: every request answered, the STATUS just sent among them, and the seconds spent
        # (a STATUS is counted once answered: the reply does not count itself)
        after = RawClient(d.endpoint).call("STATUS")["traffic"]
        assert status["traffic"]["requests"] == sum(count.values()) == after["requests"] - 1, (status, count)
        assert 0 < m[("stormd_busy_seconds_total", ())] <= status["traffic"]["busy_s"] <= after["busy_s"]
        assert count["invalid"] == 1 and count["FREE"] == 0
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url.replace("/metrics", "/other"), timeout=5)
        assert e.value.code == 404
    finally:
        stop_daemon(d)


@pytest.mark.parametrize("address,level,readers", [
    ("127.0.0.1", logging.INFO, "any local user"), ("::1", logging.INFO, "any local user"),
    ("0.0.0.0", logging.WARNING, "any local user and any host that reaches 0.0.0.0"),
    ("10.1.2.3", logging.WARNING, "any local user and any host that reaches 10.1.2.3")])
def test_stormd_says_who_can_read_its_metrics_louder_off_loopback(address, level, readers):
    """Issue 49, item 4: what the start-up log line (see the test above) says for each address."""
    assert metrics_readers(address) == (level, readers)


def ctl(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([STORMCTL, "--socket", d.endpoint, *args], capture_output=True, text=True, timeout=30)


def test_stormctl_status_stats_ping_and_drain(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    try:
        c = RawClient(d.endpoint)
        store(c, c.hello()["pool"]["path"], 1, b"s" * 5000)
        status = json.loads(ctl(d, "--json", "status").stdout)
        assert status["node"]["clients"] == 1 and status["traffic"]["bytes_in"] == 5000
        assert status["draining"] is False and status["endpoint"] == d.endpoint
        (row,) = json.loads(ctl(d, "--json", "stats").stdout)["clients"]
        # held_bytes: its extent, 5000 rounded up to 256
        assert row["pid"] == os.getpid() and row["keys"] == 1 and row["held_bytes"] == 5120 and row["puts"] == 1
        table = ctl(d, "status")
        assert table.returncode == 0 and "serving" in table.stdout and "stored (PUT)" in table.stdout
        piped = ctl(d, "stats").stdout.splitlines()  # captured: not a terminal, so plain columns, none cut
        assert piped[1].split()[:3] == ["session", "name", "pid"] and "peak held" in piped[1], piped
        assert piped[2].split()[2] == str(os.getpid()) and "…" not in "".join(piped), piped
        ping = ctl(d, "ping")
        assert ping.returncode == 0 and "answered in" in ping.stdout
        assert json.loads(ctl(d, "--json", "ping").stdout)["rtt_ms"] > 0
        drain = json.loads(ctl(d, "--json", "drain").stdout)
        assert drain["draining"] is True
        assert c.call("PUT", **put_fields(2, 10))["error"] == ErrorCode.DRAINING
        assert c.call("FREE", all=True)["freed"] == 1  # nothing held: the drain ends
        assert d.proc.wait(5) == 0
        gone = ctl(d, "ping", "--timeout", "0.3")
        assert gone.returncode == 1 and f"no stormd answered at {d.endpoint}" in gone.stderr
    finally:
        stop_daemon(d)


CLOCK_TICK_S = 0.01  # the resolution of a process's start time in /proc (USER_HZ, 100 on Linux)


def test_status_and_stormctl_say_how_long_stormd_took_to_serve_and_what_it_page_locked(tmp_path):
    """Issue 54: what the daemon buys, from the daemon itself (STATUS), not from its log."""
    before = time.monotonic()
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    waited = time.monotonic() - before
    try:
        status = json.loads(ctl(d, "--json", "status").stdout)
        # from its process's start to serving: after this test's Popen, before its socket answered
        assert 0 < status["startup_s"] <= waited + CLOCK_TICK_S, (status["startup_s"], waited)
        assert f"startup_s={status['startup_s']}" in wait_for_log(d, r"stormd ready.*").group(0)
        if torch.cuda.is_available():  # cuda_ipc (on by default): stormd locks its whole pool at start
            assert status["node"]["page_locked_bytes"] == 1 << 20 and status["page_lock_s"] >= 0
        else:  # no GPU in sight: stormd copies no CUDA memory and locks nothing
            assert status["node"]["page_locked_bytes"] == 0 and status["page_lock_s"] is None
        stats = RawClient(d.endpoint)  # STATS, which clients ask, carries the pool's figure too
        stats.hello()
        assert stats.call("STATS")["node"]["page_locked_bytes"] == status["node"]["page_locked_bytes"]
        table = ctl(d, "status").stdout
        assert re.search(rf"started in +{status['startup_s']:.2f} s \(process start to serving\)", table), table
        locked = "1.0 MiB at start, in " if torch.cuda.is_available() else "0.0 MiB (stormd makes no CUDA copies)"
        assert re.search(rf"page-locked +{re.escape(locked)}", table), table
    finally:
        stop_daemon(d)


def test_json_logs_have_a_line_per_connect_and_disconnect_and_error_floods_are_rate_limited(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--log-format", "json")
    try:
        c = RawClient(d.endpoint)
        session = c.hello()["session"]
        evil = RawClient(d.endpoint)
        for _ in range(200):
            assert evil.send_frames(b"\xc1")["error"] == ErrorCode.BAD_MESSAGE
        assert c.call("BYE")["ok"]
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        lines = [json.loads(line) for line in d.output().splitlines()]
        assert all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
        connected = [x for x in lines if x["msg"] == "client connected"]
        disconnected = [x for x in lines if x["msg"] == "client disconnected"]
        assert [x["session"] for x in connected] == [session] == [x["session"] for x in disconnected]
        assert disconnected[0]["why"] == "said BYE" and connected[0]["pid"] == os.getpid()
        errors = [x for x in lines if x.get("code") == ErrorCode.BAD_MESSAGE]
        # 200 bad messages: one line with the first message; the other 199 as a count at shutdown.
        assert [x["msg"] for x in errors] == ["error reply", "error replies not logged one by one"]
        assert errors[0]["level"] == "warning" and "msgpack" in errors[0]["detail"]
        assert errors[1]["suppressed"] == 199
        assert len(lines) < 12
    finally:
        stop_daemon(d)


def test_metrics_port_in_use_costs_the_metrics_not_the_daemon(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        d = start_daemon(tmp_path, "--pool-size", "1MiB", "--metrics", "--metrics-port", str(busy.getsockname()[1]))
        try:
            wait_for_log(d, r'metrics endpoint not started; serving without it.*error=".*address already in use"')
            assert RawClient(d.endpoint).call("PING")["ok"]
        finally:
            stop_daemon(d)
        assert d.proc.returncode == 0
    finally:
        busy.close()


def test_sighup_drains_and_exits_0_leaving_no_socket_or_pool_segment(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--drain-timeout", "30")
    try:
        c = RawClient(d.endpoint)
        pool = c.hello()["pool"]["path"]
        store(c, pool, 1, b"h" * 1000)
        d.proc.send_signal(signal.SIGHUP)
        wait_for_log(d, r'msg="draining.*reason=SIGHUP', timeout=30)
        assert c.call("PUT", **put_fields(2, 10))["error"] == ErrorCode.DRAINING  # alive, draining
        assert c.call("BYE")["freed"] == 1
        assert d.proc.wait(30) == 0, d.output()
        assert 'msg="drained: no client holds a tensor; stopping"' in d.output()
        assert not d.socket.exists() and not os.path.exists(pool)
    finally:
        stop_daemon(d)


def peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process has had, so a frame buffered and freed since still shows."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def test_a_huge_frame_is_dropped_as_it_arrives_not_buffered(tmp_path):
    frame_bytes = 256 << 20
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    try:
        before = peak_rss(d.proc.pid)
        c = RawClient(d.endpoint, timeout_ms=60_000)
        events = c.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        c.sock.send(b"\x00" * frame_bytes)
        # Either the daemon closes the connection (the frame was dropped) or it answers (it took it all in).
        poller = zmq.Poller()
        poller.register(events, zmq.POLLIN)
        poller.register(c.sock, zmq.POLLIN)
        ready = dict(poller.poll(60_000))
        assert ready, "within 60 s the daemon neither answered the frame nor closed the connection"
        assert events in ready and c.sock not in ready, unpack(c.sock.recv())
        grown = peak_rss(d.proc.pid) - before
        assert grown < 64 << 20, f"the daemon's peak RSS grew by {grown >> 20} MiB for a {frame_bytes >> 20} MiB frame"
        assert RawClient(d.endpoint).call("PING")["ok"]
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.output()


def test_stormctl_stats_with_thousands_of_sessions_prints_what_fits_and_counts_the_rest(tmp_path):
    n = 4000
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics", "--max-sessions-per-peer", str(n),
                     "--max-sessions", str(n), "--client-timeout", "600")
    try:
        c = RawClient(d.endpoint, timeout_ms=60_000)
        for i in range(n):  # pipelined: all sent, then all read
            c.sock.send(pack({"op": "HELLO", "id": i + 1, "version": PROTOCOL_VERSION, "pid": i + 1, "host": "h" * 64}))
        assert all(c.recv()["ok"] for _ in range(n))
        out = ctl(d, "--timeout", "60", "stats")
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        shown = json.loads(ctl(d, "--timeout", "60", "--json", "stats").stdout)
        assert shown["total"] == n and 0 < len(shown["clients"]) < n
        assert f"{len(shown['clients'])} of {n} clients shown" in " ".join(out.stdout.split())
    finally:
        stop_daemon(d)


def test_a_plain_path_in_stormd_socket_serves_stormd_the_client_and_stormctl(tmp_path, monkeypatch):
    """Issue 38, item 5: STORMD_SOCKET=/run/stormd/stormd.sock (the README's form) is read by one function
    for all three. Before, stormd took it but the client's I/O thread died on it (ZMQError: Invalid
    argument, then the embedded store) and stormctl crashed."""
    import torch

    import storm

    sock = tmp_path / "run" / "stormd.sock"
    env = {**os.environ, "STORMD_SOCKET": str(sock)}
    log = tmp_path / "stormd.log"
    proc = subprocess.Popen([sys.executable, "-m", "stormd", "--pool-size", "1MiB", "--no-metrics"], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    d = Daemon(sock, proc, log)
    try:
        wait_for_log(d, "stormd ready", timeout=60)
        assert f"socket=ipc://{sock} " in d.output()
        monkeypatch.setenv("STORMD_SOCKET", str(sock))
        with storm.offload(mode="daemon", min_bytes=0) as ctx:
            loss = torch.nn.Linear(8, 8)(torch.ones(4, 8)).tanh().sum()
        loss.backward()
        assert ctx.backend_name.startswith(f"stormd at ipc://{sock}") and ctx.stats.offloaded > 0
        r = subprocess.run([STORMCTL, "--json", "status"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["endpoint"] == f"ipc://{sock}"
    finally:
        storm.close_all()
        stop_daemon(d)
