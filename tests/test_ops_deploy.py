"""deploy/: the systemd unit passes systemd-analyze, and the log limiter bounds what a flood writes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from stormd.logs import ErrorReplyLog

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "stormd.service"


def verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify on the unit, with ExecStart pointing at this environment's stormd
    (verify insists that the binary exists; the unit names where `pip install` puts it on a node)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None and not os.environ.get("CI"):  # .ci/run installs it, and there it must run
        pytest.skip("systemd-analyze is not installed (Debian/Ubuntu: apt install systemd); .ci/run installs it")
    assert analyze, "systemd-analyze is missing: install the 'systemd' package (.ci/run does)"
    stormd = shutil.which("stormd")
    assert stormd, "the stormd console script is not on PATH: pip install -e ."
    path = tmp_path / "stormd.service"
    path.write_text(unit_text.replace("/usr/local/bin/stormd", stormd))
    return subprocess.run([analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)


def test_systemd_unit_passes_systemd_analyze_verify_without_warnings(tmp_path):
    text = UNIT.read_text()
    r = verify(text, tmp_path)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    # verify only warns about a bad value and exits 0, which is why stderr must be empty above:
    broken = verify(text.replace("WatchdogSec=30", "WatchdogSec=soon"), tmp_path)
    assert "WatchdogSec" in broken.stderr or "sec value" in broken.stderr


def test_systemd_unit_has_what_the_daemon_relies_on():
    settings = dict(line.split("=", 1) for line in UNIT.read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert int(settings["WatchdogSec"]) > 0
    assert settings["RuntimeDirectory"] == "stormd" and settings["RuntimeDirectoryMode"] == "0700"
    assert "--socket /run/stormd/stormd.sock" in settings["ExecStart"]
    assert settings["LimitMEMLOCK"] == "infinity" and settings["Restart"] == "on-failure"
    assert "PrivateDevices" not in settings  # a private /dev/shm would hide the pool from clients


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_error_log_writes_at_most_two_lines_per_code_per_interval(caplog):
    clock = Clock()
    limiter = ErrorReplyLog(logging.getLogger("stormd.test"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="stormd.test"):
        for i in range(10_000):
            limiter.record("BAD_MESSAGE", f"garbage {i}")
        limiter.record("NOT_FOUND", "key 1")
        clock.now += 5
        limiter.flush()  # the interval is not over: nothing yet
        assert len(caplog.records) == 2
        clock.now += 6
        limiter.record("BAD_MESSAGE", "garbage again")
        limiter.flush()
    lines = [(r.getMessage(), r.code, getattr(r, "suppressed", None), getattr(r, "detail", None))
             for r in caplog.records]
    assert lines == [("error reply", "BAD_MESSAGE", None, "garbage 0"),
                     ("error reply", "NOT_FOUND", None, "key 1"),
                     ("error replies not logged one by one", "BAD_MESSAGE", 9_999, None),
                     ("error reply", "BAD_MESSAGE", None, "garbage again")]


@pytest.mark.parametrize("key", ["ipc: host", "pid: host", "stormd-run:/run/stormd", "memlock: -1",
                                 "capabilities: [gpu]", 'user: "10001:10001"'])
def test_compose_example_shares_what_cuda_ipc_needs_in_both_containers(key):
    compose = (ROOT / "deploy" / "compose.yaml").read_text()
    stormd, train = compose.split("\n  train:\n")
    assert key in stormd
    if key != "memlock: -1":
        assert key in train
