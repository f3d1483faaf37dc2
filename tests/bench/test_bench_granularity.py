"""bench/granularity.py on the CPU: the parts of a layer it plans are the highest submodules the
layer's forward calls, in call order (a list that is not called gives its called children), and
without CUDA the script exits 2."""

from __future__ import annotations

import sys

import torch

from helpers import bench_module, run_bench

for sibling in ("hf", "zoo_verdicts", "zoo"):  # the zoo's cells: the script imports them as siblings
    bench_module(sibling)
hf = sys.modules["hf"]
granularity = bench_module("granularity")
CPU = torch.device("cpu")


def names(arch: str) -> list[str]:
    w = hf.tiny(arch)
    model, x = w.build(CPU)
    blocks = hf.HF.blocks(model)
    return [type(m).__name__ for m in granularity.parts(model, blocks, lambda: w.forward(model, x))]


def test_a_t5_layer_gives_the_called_children_of_its_uncalled_list_encoder_then_decoder():
    encoder = ["T5LayerSelfAttention", "T5LayerFF"]
    decoder = ["T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF"]
    assert names("t5") == encoder * 2 + decoder * 2


def test_a_llama_layer_gives_its_norms_attention_and_mlp_in_call_order():
    assert names("llama") == ["LlamaRMSNorm", "LlamaAttention", "LlamaRMSNorm", "LlamaMLP"] * 2


def test_without_cuda_it_exits_2(tmp_path):
    done = run_bench("granularity.py", "llama-wide", "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2, done.stderr
