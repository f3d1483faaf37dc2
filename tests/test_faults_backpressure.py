"""Issue 7, item 7: a client that sends PUTs faster than stormd answers is slowed, never dropped
silently, and never holds up the other clients."""

from __future__ import annotations

import threading
import time

import zmq
from test_ops_daemon import wait_for_log

from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from stormd.wire.protocol import pack

FLOOD = 30_000
OTHERS_P99_BOUND = 0.25  # seconds; the flood takes about 2 s to serve, so a client queued behind it would fail


def flood(endpoint: str, n: int) -> tuple[RawClient, int]:
    """Send ``n`` PUTs as fast as the socket takes them, reading no reply. Returns the client and how
    many times its socket said 'full' (the high-water mark slowing it down)."""
    c = RawClient(endpoint, timeout_ms=30_000)
    c.sock.setsockopt(zmq.SNDHWM, 100)
    c.hello()
    full = 0
    for key in range(1, n + 1):
        frame = pack({"op": "PUT", "id": key, **c.auth, **put_fields(key, 256)})
        while True:
            try:
                c.sock.send(frame, zmq.NOBLOCK)
                break
            except zmq.Again:
                full += 1
                c.sock.poll(1000, zmq.POLLOUT)
    return c, full


class Other(threading.Thread):
    """A well-behaved client doing PUT/SEAL/GET round trips while the flood runs, timing each."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.c = RawClient(endpoint)
        self.c.hello()
        self.latencies: list[float] = []
        self.errors: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for key in range(1, 1 << 62):
            if self.stop.is_set():
                return
            for op, fields in (("PUT", put_fields(key, 4096)), ("SEAL", {"key": key, "checksum": 0}),
                               ("GET", {"key": key}), ("FREE", {"keys": [key]})):
                t0 = time.perf_counter()
                r = self.c.call(op, **fields)
                self.latencies.append(time.perf_counter() - t0)
                if not r["ok"]:
                    self.errors.append(r)

    def p99(self) -> float:
        return sorted(self.latencies)[int(len(self.latencies) * 0.99)]


def test_a_flooding_client_is_slowed_loses_no_reply_and_blocks_nobody(tmp_path):
    # The backlog limit is above the flood: this client reads its replies late, but it reads them.
    d = start_daemon(tmp_path, "--pool-size", "16MiB", "--no-metrics", "--hwm", "100",
                     "--client-max-backlog", str(2 * FLOOD))
    try:
        other = Other(d.endpoint)
        other.start()
        t0 = time.monotonic()
        blaster, full = flood(d.endpoint, FLOOD)
        assert full > 0  # its sends hit the high-water mark: it was slowed, not buffered without end
        ids = [blaster.recv()["id"] for _ in range(FLOOD)]  # read only now: every reply is there
        served_s = time.monotonic() - t0
        assert ids == list(range(1, FLOOD + 1))  # none lost, none out of order
        other.stop.set()
        other.join(10)
        assert not other.errors and len(other.latencies) > 100
        print(f"\nflood of {FLOOD} served in {served_s:.2f} s; meanwhile another client's p99 "
              f"{other.p99() * 1e3:.2f} ms over {len(other.latencies)} requests")
        assert other.p99() < OTHERS_P99_BOUND
        assert blaster.call("STATS")["session"]["keys"] == FLOOD  # every PUT was served
        assert "cut off" not in d.output() and "dropped" not in d.output()
    finally:
        stop_daemon(d)


def test_a_client_that_never_reads_its_replies_is_cut_off_loudly(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "16MiB", "--no-metrics", "--hwm", "100",
                     "--client-max-backlog", "2000")
    try:
        other = RawClient(d.endpoint)
        other.hello()
        blaster, _ = flood(d.endpoint, 15_000)
        wait_for_log(d, r"client cut off: it does not read its replies.*unread_replies=2001")
        wait_for_log(d, r"client disconnected.*why=\"it left 2001 replies unread")
        node = RawClient(d.endpoint).call("STATUS")["node"]
        assert node["clients"] == 1 and node["used"] == 0  # its session ended and its extents were freed
        assert other.call("PING", **other.auth)["ok"]
    finally:
        stop_daemon(d)
