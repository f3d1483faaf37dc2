"""bench/trainer.py trains a Hugging Face Llama through transformers.Trainer with and without
StormCallback; on CPU with --tiny it runs for real, through the embedded store."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.slow
def test_a_tiny_llama_through_trainer_is_bit_identical_with_the_callback(tmp_path):
    out = tmp_path / "trainer.json"
    r = run_bench("trainer.py", "--device", "cpu", "--tiny", "--seq", "32", "--batch", "2", "--steps", "3",
                  "--mode", "embedded", "--pool-size", "64MiB", "--out", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    result = bench_result(out)
    assert result["without_again"]["bit_identical"], result  # training here is deterministic at all
    assert result["with_storm"]["bit_identical"], result
    assert len(result["with_storm"]["losses"]) == 3 and result["with_storm"]["offloaded_tensors"] > 0
    assert result["storm_options"] == {"mode": "embedded", "min_bytes": 0, "pool_size": "64MiB"}
