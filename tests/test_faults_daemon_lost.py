"""Issue 38, item 4: a training process that loses its daemon can exit.

Once the connection is declared dead, every request the client has sent,
queued or makes later fails at once with StormUnavailable. Before, requests
still queued for the socket were never failed: the mover's worker waited
REQUEST_TIMEOUT (30 s) for each of the hundreds queued behind it, and exit
joined that worker, so a script that caught the error lived on for minutes.

Issue 53, item 4: that error says how the daemon stopped (drained on SIGTERM,
or killed) and since when, not that its socket is gone (tests/test_daemon_loss.py
stops it in the middle of a step).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

import storm
from conftest import start_daemon, stop_daemon
from storm.connection import DaemonConnection

# What the old behaviour could not meet by far (30 s for each of the hundreds of queued requests),
# with room for the client's DEAD_AFTER (5 s) and a step of the trainer on a loaded 2-core machine
# (a full suite beside two busy cores once took over 25 s).
EXIT_BOUND = 60.0

# A training loop whose every step offloads 600 small tensors through stormd, more than the
# connection keeps in flight (MAX_IN_FLIGHT), so requests queue in the client; it catches the error
# that losing the daemon raises and exits. After 3 steps it waits for a line on stdin: the test
# stops the daemon then, so the steps after it run with the daemon gone, whatever the timing.
TRAINER = textwrap.dedent("""
    import sys, torch, storm
    from torch import nn
    endpoint = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(300)])
    x = torch.randn(32, 64)
    steps = 0
    try:
        while True:
            with storm.offload(mode="daemon", socket=endpoint, min_bytes=0) as ctx:
                loss = model(x).sum()
            loss.backward()
            assert ctx.backend_name.startswith("stormd"), ctx.backend_name
            steps += 1
            if steps == 3:
                print("trained 3 steps", flush=True)
                sys.stdin.readline()
    except storm.StormUnavailable as e:
        print(f"lost the daemon after {steps} steps: {e}", flush=True)
""")


def wait_for_line(log, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before {text!r}: {log.read_text()}"
        assert time.monotonic() < deadline, f"the trainer printed no {text!r} within {timeout} s: {log.read_text()}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm-drain"])
def test_a_trainer_that_loses_its_daemon_exits_within_seconds(tmp_path, sig):
    d = start_daemon(tmp_path, "--pool-size", "64MiB", "--no-metrics")
    log = tmp_path / "trainer.log"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, d.endpoint], stdin=subprocess.PIPE,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(log, "trained 3 steps", trainer, timeout=120)
        d.proc.send_signal(sig)  # SIGTERM: the daemon drains and exits, at the latest at its drain deadline
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stormd did not exit within 60 s of {sig.name}: {d.output()}")
        lost = time.monotonic()
        trainer.stdin.write("go on\n")
        trainer.stdin.flush()
        try:
            trainer.wait(EXIT_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer was still running {EXIT_BOUND} s after the daemon exited ({sig.name}): "
                        f"{log.read_text()[-2000:]}")
        assert trainer.returncode == 0, log.read_text()[-2000:]
        said = log.read_text().split("lost the daemon after", 1)[-1]
        assert said != log.read_text(), log.read_text()[-2000:]
        how = "it began draining at " if sig == signal.SIGTERM else "did not answer for 5 s after that: it was killed"
        assert f"stormd at {d.endpoint} stopped: " in said and how in said and " s ago)" in said, said
        assert "on SIGTERM" in said if sig == signal.SIGTERM else "it last answered at " in said, said
        assert "no stormd socket" not in said and "left over" not in said, said
        assert time.monotonic() - lost < EXIT_BOUND
        assert d.proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL), d.output()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        stop_daemon(d)


def test_every_request_queued_when_the_daemon_is_lost_fails_at_once(tmp_path):
    """Requests still queued in the connection (beyond its credit, or behind a socket with no peer)
    fail with the sent ones; those made later fail when made."""
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    dead_after = 3.0  # far longer than queueing the requests below takes, so they queue while it is alive
    conn = DaemonConnection(d.endpoint, heartbeat=0.1, dead_after=dead_after, max_in_flight=4)
    try:
        d.proc.kill()
        d.proc.wait()
        queued = [conn.request("PING") for _ in range(50)]
        for i, fut in enumerate(queued):
            try:
                error = fut.exception(timeout=dead_after + 30)
            except TimeoutError:
                pytest.fail(f"request {i} of 50 was neither answered nor failed {dead_after + 30:g} s after "
                            f"the daemon was killed")
            assert isinstance(error, storm.StormUnavailable) and "did not answer" in str(error), (i, error)
        assert not conn.alive
        late = conn.request("PING")
        assert late.done() and isinstance(late.exception(), storm.StormUnavailable)
    finally:
        conn.close()
        stop_daemon(d)
