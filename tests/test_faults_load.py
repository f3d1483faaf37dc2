"""Issue 7, item 6: 8 client processes x 2,000 steps of PUT/GET with random sizes: not one wrong byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_8_processes_2000_steps_each_zero_mismatches(tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "load.py"), "--procs", "8", "--steps", "2000",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert r.returncode == 0, (r.stderr, result["errors"])
    assert result["tensors"] == 16_000 and result["requests"] == 4 * 16_000  # PUT, SEAL, GET, FREE each
    assert result["mismatches"] == 0 and result["errors"] == []
    assert result["latency_ms"]["all"]["p50"] <= result["latency_ms"]["all"]["p99"]
