"""bench/page_lock.py on a GPU: a pool page-locked in one thread and in several, each timed."""

from __future__ import annotations

import pytest

from helpers import bench_result, run_bench


@pytest.mark.gpu
def test_a_pool_is_page_locked_in_one_thread_and_in_several(tmp_path):
    out = tmp_path / "page_lock.json"
    r = run_bench("page_lock.py", "--size", "64MiB", "--threads", "1", "4", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = bench_result(out)
    assert result["size"] == 64 << 20
    assert [row["threads"] for row in result["rows"]] == [1, 4] and all(row["seconds"] > 0 for row in result["rows"])
