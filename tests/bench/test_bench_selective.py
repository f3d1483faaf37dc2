"""bench/selective.py on the CPU: every zoo architecture at a tiny size steps bit-exact under the
selective-checkpoint policy, which saves fewer bytes than the blocks keep and more than their
inputs alone; the policy saves matrix products' outputs and recomputes the rest; and its command
line without CUDA."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers import bench_module, run_bench

for sibling in ("hf", "zoo_verdicts", "zoo"):  # the zoo's cells: the script imports them as siblings
    bench_module(sibling)
hf = sys.modules["hf"]
selective = bench_module("selective")
CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", sorted(hf.ARCHS))
def test_each_architecture_steps_bit_exact_and_the_policy_frees_part_of_the_blocks_saves(arch):
    r = selective.measure(hf.tiny(arch), CPU, steps=1, warmup=0)
    assert r["bit_exact"]
    assert 0 < r["selective_frees"] < r["whole_frees"] < 1
    assert "kept" not in r  # no times on the CPU


def test_a_step_whose_gradients_differ_is_not_called_bit_exact(monkeypatch):
    real = selective.one_step

    def off_by_a_bit(w, device, how):
        digest, saves = real(w, device, how)
        return (digest + "x" if how == "selective" else digest), saves

    monkeypatch.setattr(selective, "one_step", off_by_a_bit)
    assert not selective.measure(hf.tiny("llama"), CPU, steps=1, warmup=0)["bit_exact"]


def test_the_policy_saves_matrix_products_and_recomputes_the_rest():
    CheckpointPolicy = torch.utils.checkpoint.CheckpointPolicy
    assert selective.policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert selective.policy(None, torch.ops.aten.addmm.default) is CheckpointPolicy.MUST_SAVE
    for op in (torch.ops.aten.mul.Tensor, torch.ops.aten.silu.default, torch.ops.aten.add.Tensor):
        assert selective.policy(None, op) is CheckpointPolicy.PREFER_RECOMPUTE


def test_the_command_line_writes_each_cell_and_refuses_without_cuda(tmp_path):
    out = tmp_path / "sel.json"
    done = run_bench("selective.py", "--tiny", "--device", "cpu", "--cells", "llama-wide", "t5-wide", "--out", str(out))
    assert done.returncode == 0, done.stderr
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {"llama-wide", "t5-wide"} and all(c["bit_exact"] for c in cells.values())
    if not torch.cuda.is_available():
        done = run_bench("selective.py", "--tiny", "--cells", "llama-wide", "--out", str(tmp_path / "x.json"))
        assert done.returncode == 2 and "CUDA" in done.stdout
