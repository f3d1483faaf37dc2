"""PyTorch Lightning with StormCallback: a tiny LightningModule whose training_step calls its
model (not its own forward), fitted through the embedded store, losses and parameters
bit-identical to the same fit without STORM, with offload and with a plan; validation untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import storm

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning test needs lightning installed")

from integrations_clock import SETTLE_STEPS, StillClock  # noqa: E402
from storm.examples.models import GPT, same_bits  # noqa: E402
from storm.integrations.lightning import StormCallback  # noqa: E402


class TinyGPT(pl.LightningModule):
    def __init__(self, skip: int | None = None, fail: int | None = None):
        super().__init__()
        self.model = GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)
        self.losses: list[torch.Tensor] = []
        self.validated = 0
        self.skip, self.fail = skip, fail  # the batch whose step returns no loss, the one whose step raises

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        (idx,) = batch
        loss = nn.functional.cross_entropy(self.model(idx).flatten(0, 1), idx.flatten())
        if batch_idx == self.fail:
            raise ZeroDivisionError("a failing step")
        self.losses.append(loss.detach().clone())
        return None if batch_idx == self.skip else loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        assert not torch.is_grad_enabled()
        (idx,) = batch
        self.model(idx)
        self.validated += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(steps: int, *callbacks: pl.Callback, **module_options: int) -> TinyGPT:
    """``steps`` training steps of a TinyGPT from seed 0, validating one batch every 2 steps."""
    pl.seed_everything(0, verbose=False)
    module = TinyGPT(**module_options)
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
    """Called after STORM's callback: before backward, that a save no longer goes to STORM (its
    step has ended); after each training batch, what the step offloaded and whether the plan
    has settled."""

    def __init__(self, storm_callback: StormCallback):
        self.storm = storm_callback
        self.offloaded: list[int] = []
        self.settled: list[bool] = []
        self.steps: list[storm.Offload] = []

    def on_before_backward(self, trainer, pl_module, loss):
        stats = self.storm.handle.last.stats
        saved = stats.saved
        a = torch.ones(4, requires_grad=True)
        (a * a).sum()  # saves a for backward
        assert stats.saved == saved, "a save after the step's forward went to STORM"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        handle = self.storm.handle
        self.steps.append(handle.last)
        self.offloaded.append(handle.last.stats.offloaded)
        if handle.planner is not None:
            self.settled.append(handle.planner.settled)


def test_lightning_fit_with_the_callback_is_bit_identical_and_validation_untouched():
    callback = StormCallback(mode="embedded", min_bytes=0)
    watch = Watch(callback)
    got = fit(3, callback, watch)
    assert len(watch.offloaded) == 3 and all(n > 0 for n in watch.offloaded)  # every step offloaded
    assert got.validated > 0  # validation ran (under no_grad, so without a step)
    assert storm.enabled.handle_of(got) is None  # disabled at teardown
    assert not got._forward_hooks and not got._forward_pre_hooks
    assert_same(fit(3), got)


def test_lightning_fit_with_a_plan_settles_bit_identical():
    callback = StormCallback(budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    watch = Watch(callback)
    got = fit(SETTLE_STEPS, callback, watch)
    assert watch.settled[-1], watch.settled
    assert not any(b.__dict__.get("forward") for b in got.model.blocks)  # the plan closed: blocks' own forwards
    assert_same(fit(SETTLE_STEPS), got)
    # after fit(), the plan is still there to read: steps marked by Lightning's hooks, modules by their names
    text = callback.handle.explain()
    assert text.startswith("storm.enable (disabled; as it was then): storm.plan on 3 blocks at model.blocks "
                           "(GPTBlock) in TinyGPT, on the steps that begin() and end() mark"), text
    assert "on every forward" not in text and "\nsettled: " in text
    before, after = text.split("before the blocks: ")[1].split("after the blocks: ")
    assert "model.tok" in before and "model.head" in after and "TinyGPT (own code)" in after, text


def test_a_step_without_loss_ends_its_scope_and_a_failing_one_leaves_the_model_restored():
    callback = StormCallback(mode="embedded", min_bytes=0)
    watch = Watch(callback)
    fit(3, callback, watch, skip=1)
    assert len(watch.steps) == 3 and len(set(map(id, watch.steps))) == 3  # each batch its own step
    callback = StormCallback(mode="embedded", min_bytes=0)
    with pytest.raises(ZeroDivisionError):
        fit(3, callback, fail=1)
    assert storm.enabled.handle_of(callback.handle.model) is None  # disabled at on_exception
    assert not callback.handle._open  # the failed step's scope ended


class SkipsTheRest(TinyGPT):
    """Lightning's "skip the rest of this epoch": on_train_batch_start returns -1, after the
    callback's on_train_batch_start has begun the batch's step."""

    def on_train_batch_start(self, batch: list[torch.Tensor], batch_idx: int) -> int | None:
        return -1 if batch_idx == 1 else None


def test_a_batch_the_module_skips_ends_the_step_the_callback_began():
    """The skipped batch's step got no backward and no batch end: teardown's disable() raised
    inside it, and STORM's saved-tensor hooks stayed on the thread."""
    def fit_skipping(*callbacks: pl.Callback) -> SkipsTheRest:
        pl.seed_everything(0, verbose=False)
        module = SkipsTheRest()
        ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             callbacks=list(callbacks))
        trainer.fit(module, loader)
        return module

    callback = StormCallback(mode="embedded", min_bytes=0)
    got = fit_skipping(callback)
    assert storm.enabled.handle_of(got) is None and not callback.handle._open
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert_same(fit_skipping(), got)


class BuiltLate(TinyGPT):
    """Builds its model in configure_model, as Lightning recommends for large ones."""

    def __init__(self) -> None:
        super().__init__()
        del self.model

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)


def test_a_model_built_in_configure_model_is_planned():
    """Callbacks' setup runs before the module's configure_model: enabled there, the plan found no
    blocks and the fit failed."""
    callback = StormCallback(budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    pl.seed_everything(0, verbose=False)
    module = BuiltLate()
    ids = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(module, loader)
    assert callback.handle.planner is not None and "3 blocks at model.blocks" in callback.handle.explain()


@pytest.mark.parametrize("options, error, message", [
    ({"mode": "bogus"}, ValueError, "mode must be one of"),
    ({"budegt": 0.5}, TypeError, "budegt"),
    ({"budget": 0.5, "clock": "cuda"}, TypeError, "clock must be None"),
])
def test_bad_options_are_refused_when_the_callback_is_made(options, error, message):
    """As storm.enable refuses them, at the line that wrote them: they passed until fit()."""
    with pytest.raises(error, match=message):
        StormCallback(**options)
