"""10,000 training-shaped steps through a real stormd: pool use and daemon RSS must not grow."""

from __future__ import annotations

import torch

from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import pack

STEPS = 10_000
SIZES = (1000, 4096, 3000)  # small on purpose: the test is about bookkeeping, not bandwidth
ALIGN = 256


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


def batch(c: RawClient, requests: list[tuple[str, dict]]) -> list[dict]:
    """Send several requests at once and collect their replies (one round trip per batch)."""
    ids = []
    for op, fields in requests:
        ids.append(next(c.ids))
        c.sock.send(pack({"op": op, "id": ids[-1], **c.auth, **fields}))
    replies = {r["id"]: r for r in (c.recv() for _ in ids)}
    out = [replies[i] for i in ids]
    assert all(r["ok"] for r in out), out
    return out


def test_10k_steps_do_not_grow_pool_use_or_daemon_rss(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    c = RawClient(d.endpoint)
    try:
        hello = c.hello()
        pool = SharedPool.attach(hello["pool"]["path"], hello["pool"]["size"])
        step_bytes = sum(-(-n // ALIGN) * ALIGN for n in SIZES)
        rss_warm = 0
        for step in range(1, STEPS + 1):
            keys = [step * 10 + i for i in range(len(SIZES))]
            puts = batch(c, [("PUT", put_fields(k, n, step=step)) for k, n in zip(keys, SIZES)])
            for k, n, r in zip(keys, SIZES, puts):
                pool.view(r["offset"], n).fill_(k % 251)
            batch(c, [("SEAL", {"key": k}) for k in keys])
            gets = batch(c, [("GET", {"key": k}) for k in reversed(keys)])
            if step % 1000 == 0:  # the bytes come back: spot-check now and then, cheaply
                for k, r in zip(reversed(keys), gets):
                    assert torch.all(pool.view(r["offset"], r["nbytes"]) == k % 251)
            assert batch(c, [("FREE", {"step": step})])[0]["freed"] == len(SIZES)
            if step == 500:
                rss_warm = rss_bytes(d.proc.pid)
            if step % 2500 == 0:
                node = c.call("STATS")["node"]
                assert node["used"] == 0 and node["keys"] == 0, node
        node, session = (lambda r: (r["node"], r["session"]))(c.call("STATS"))
        rss_end = rss_bytes(d.proc.pid)
        print(f"\n{STEPS} steps: pool peak {node['peak']} bytes (one step is {step_bytes}), plan hits "
              f"{session['plan_hits']}, daemon RSS {rss_warm >> 10} KiB at step 500 -> {rss_end >> 10} KiB")
        assert node["peak"] <= step_bytes, "pool use grew beyond one step's bytes"
        assert session["plan_hits"] == len(SIZES) * (STEPS - 1)  # every step after the first by the plan
        assert rss_end - rss_warm < 4 << 20, f"daemon RSS grew by {(rss_end - rss_warm) >> 10} KiB"
        pool.close()
    finally:
        c.close()
        stop_daemon(d)
    assert d.proc.returncode == 0, d.output()
