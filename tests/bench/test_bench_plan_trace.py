"""bench/plan_trace.py records storm.plan's traces on W1/W2 on CUDA (tests/planner/data/ is made
from them); without CUDA it exits 2 before building anything."""

from __future__ import annotations

import pytest
import torch

from helpers import run_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures where CUDA is")
def test_without_cuda_it_records_nothing_and_says_so(tmp_path):
    r = run_bench("plan_trace.py", "--workloads", "W1", "--out", str(tmp_path / "trace.json"))
    assert r.returncode == 2 and "bench/plan_trace.py measures on CUDA" in r.stderr, r.stderr
    assert not (tmp_path / "trace.json").exists()


def test_it_traces_only_the_workloads_the_golden_test_uses(tmp_path):
    r = run_bench("plan_trace.py", "--workloads", "tiny", "--out", str(tmp_path / "trace.json"))
    assert r.returncode == 2 and "invalid choice: 'tiny'" in r.stderr, r.stderr
