"""PyTorch Lightning: STORM on the LightningModule while it fits.

    from storm.integrations.lightning import StormCallback
    trainer = lightning.pytorch.Trainer(..., callbacks=[StormCallback(budget=0.5)])

``on_fit_start`` enables STORM on the LightningModule, its repeated blocks found inside it (once
the module's ``setup`` and ``configure_model``, where Lightning has models build their layers, have
run); ``teardown``, or ``on_exception`` for a fit that fails (it gets no teardown), disables it.
The disabled handle stays on the callback, so ``callback.handle.explain()`` tells the plan and
its trials after ``fit()``.
A training step is marked by Lightning's batch hooks rather than by the module's forward:
``training_step`` often calls submodules (``self.model(x)``) and never
the LightningModule's own forward, and under a DDP strategy Lightning's wrapper calls
``training_step`` itself. So the step's context is entered at ``on_train_batch_start`` and
exited at ``on_before_backward``, when the loss is computed (or at ``on_train_batch_end`` for a
step that returned no loss). A module whose ``on_train_batch_start`` returns -1 (Lightning's
"skip the rest of this epoch") runs after the callback's: the step it began is ended as the epoch
ends. Validation and prediction batches (under no_grad) are untouched.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ..enabled import Enabled, check_options, enable


class StormCallback(pl.Callback):
    """``storm.enable(pl_module, **options)`` while the Trainer fits; ``options`` are
    storm.enable's (``budget=`` / ``peak=`` for a plan, else storm.offload's). ``handle`` is
    the Enabled of the fit in progress, and after it ends, until the next begins, of the fit
    that ended, disabled (None before the first): ``handle.explain()`` reads its plan either way.
    The options are checked here, as storm.enable checks them."""

    def __init__(self, **options: Any):
        check_options(**options)
        self.options = options
        self.handle: Enabled | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handle = enable(pl_module, on_forward=False, **self.options)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.handle.begin()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.handle.end()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.handle.end()  # a step that returned no loss had no backward

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.handle.end()  # a step the module skipped (on_train_batch_start returned -1) never ended

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # a failed fit gets no teardown from Lightning: end the step it was in and disable here
        if self.handle is not None:
            self.handle.end()
            self._disable()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.handle is not None:
            self.handle.end()  # whatever step is still open: disable() refuses inside one
            self._disable()

    def _disable(self) -> None:
        if self.handle is not None:
            self.handle.disable()  # kept: its plan and last step stay readable until the next fit()
