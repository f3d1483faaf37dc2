"""accelerate: storm.enable(accelerator.unwrap_model(model), ...) after accelerator.prepare, a
tiny GPT trained on Accelerator(cpu=True) through the embedded store, losses and gradients
bit-identical to the same run without STORM, with offload and with a plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate", reason="the accelerate test needs accelerate installed")

import storm  # noqa: E402
from integrations_clock import SETTLE_STEPS, StillClock  # noqa: E402
from storm.examples.models import GPT, same_bits  # noqa: E402


def train(steps: int, **storm_options) -> tuple[list, list, storm.Enabled | None]:
    """``steps`` steps from seed 0 through an Accelerator; with options, STORM is on (the documented
    one line); the losses, each step's gradients, and STORM's handle, still enabled."""
    accelerate.utils.set_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)
    ids = torch.randint(0, 64, (2 * steps, 32), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    handle = storm.enable(accelerator.unwrap_model(model), **storm_options) if storm_options else None
    losses, grads = [], []
    for (idx,) in loader:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        accelerator.backward(loss)
        if handle is not None and handle.planner is None:
            assert handle.last.stats.offloaded > 0
        opt.step()
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads, handle


def assert_same(want, got) -> None:
    assert len(got[0]) == len(want[0]) > 0
    for step, (a, b) in enumerate(zip(want[0], got[0])):
        assert same_bits(a, b), f"loss of step {step} differs"
    for step, (ga, gb) in enumerate(zip(want[1], got[1])):
        assert all(same_bits(a, b) for a, b in zip(ga, gb)), f"gradients of step {step} differ"


def test_accelerate_with_storm_enable_is_bit_identical():
    got = train(3, mode="embedded", min_bytes=0)
    got[2].disable()
    assert_same(train(3), got)


def test_accelerate_with_a_plan_settles_bit_identical():
    got = train(SETTLE_STEPS, budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    assert got[2].planner.settled, got[2].explain()
    got[2].disable()
    assert_same(train(SETTLE_STEPS), got)
