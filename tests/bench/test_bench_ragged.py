"""bench/ragged.py on the CPU: its batches are padded to their longest sequence, with the mask
that says which tokens are padding, the same for a seed; without CUDA the script exits 2."""

from __future__ import annotations

import sys

import torch

from helpers import bench_module, run_bench

for sibling in ("hf", "zoo_verdicts", "zoo"):  # the zoo's cells: the script imports them as siblings
    bench_module(sibling)
ragged = bench_module("ragged")
hf = sys.modules["hf"]


def test_each_batch_is_padded_to_its_longest_and_masked_there():
    w = hf.tiny("llama", batch=4, seq=16)
    data = ragged.batches(w, steps=30, at_max=0.1, shortest=4, seed=1)
    assert len(data) == 30
    lengths = set()
    for ids, mask in data:
        real = mask.sum(1)
        assert ids.shape == mask.shape and ids.shape[0] == 4 and real.max() == ids.shape[1] <= 16
        assert (ids[mask == 0] == 0).all() and (ids[mask == 1] > 0).all()
        assert (mask.cummin(1).values == mask).all()  # the real tokens first, then the padding
        lengths.add(ids.shape[1])
    assert 16 in lengths and len(lengths) > 3  # the longest, and shorter batches of several lengths
    again = ragged.batches(w, steps=30, at_max=0.1, shortest=4, seed=1)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(data, again))


def test_without_cuda_it_exits_2(tmp_path):
    done = run_bench("ragged.py", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2, done.stderr
