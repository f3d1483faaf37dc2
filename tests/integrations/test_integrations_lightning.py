"""PyTorch Lightning with StormCallback: a tiny LightningModule whose training_step calls its
model (not its own forward), fitted through the embedded store, losses and parameters
bit-identical to the same fit without STORM, with offload and with a plan; validation untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning test needs lightning installed")

from conftest import SETTLE_STEPS  # noqa: E402
from storm.examples.models import GPT, same_bits  # noqa: E402
from storm.integrations.lightning import StormCallback  # noqa: E402


class TinyGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)
        self.losses: list[torch.Tensor] = []
        self.validated = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        loss = nn.functional.cross_entropy(self.model(idx).flatten(0, 1), idx.flatten())
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        assert not torch.is_grad_enabled()
        (idx,) = batch
        self.model(idx)
        self.validated += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(steps: int, *callbacks: pl.Callback) -> TinyGPT:
    """``steps`` training steps of a TinyGPT from seed 0, validating one batch every 2 steps."""
    pl.seed_everything(0, verbose=False)
    module = TinyGPT()
    ids = torch.randint(0, 64, (2 * steps, 32), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         limit_val_batches=1, val_check_interval=2, callbacks=list(callbacks))
    trainer.fit(module, loader, loader)
    return module


def assert_same(want: TinyGPT, got: TinyGPT) -> None:
    assert len(got.losses) == len(want.losses) > 0
    assert all(same_bits(a, b) for a, b in zip(want.losses, got.losses)), (want.losses, got.losses)
    differ = [n for (n, a), b in zip(got.named_parameters(), want.parameters()) if not same_bits(a, b)]
    assert not differ, f"parameters differ after fitting: {differ}"


class Watch(pl.Callback):
    """After each training batch (after STORM's callback), what its step offloaded and whether
    its plan has settled."""

    def __init__(self, storm_callback: StormCallback):
        self.storm = storm_callback
        self.offloaded: list[int] = []
        self.settled: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        handle = self.storm.handle
        self.offloaded.append(handle.last.stats.offloaded)
        if handle.planner is not None:
            self.settled.append(handle.planner.settled)


def test_lightning_fit_with_the_callback_is_bit_identical_and_validation_untouched():
    callback = StormCallback(mode="embedded", min_bytes=0)
    watch = Watch(callback)
    got = fit(3, callback, watch)
    assert len(watch.offloaded) == 3 and all(n > 0 for n in watch.offloaded)  # every step offloaded
    assert got.validated > 0  # validation ran (under no_grad, so without a step)
    assert callback.handle is None  # disabled at teardown
    assert not got._forward_hooks and not got._forward_pre_hooks
    assert_same(fit(3), got)


def test_lightning_fit_with_a_plan_settles_bit_identical(still_clock):
    callback = StormCallback(budget=0.5, mode="embedded", min_bytes=0, clock=still_clock)
    watch = Watch(callback)
    got = fit(SETTLE_STEPS, callback, watch)
    assert watch.settled[-1], watch.settled
    assert not any(b.__dict__.get("forward") for b in got.model.blocks)  # the plan closed: blocks' own forwards
    assert_same(fit(SETTLE_STEPS), got)
