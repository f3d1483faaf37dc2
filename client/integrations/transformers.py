"""Hugging Face ``Trainer``: STORM on the model from train begin to train end.

    from storm.integrations.transformers import StormCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[StormCallback(budget=0.5)])

The callback calls ``storm.enable`` on the model the Trainer trains (its repeated blocks found
inside it: ``model.model.layers``) when training begins, and disables it when training ends,
so evaluation and generation afterwards run as without STORM; evaluation during training runs
under ``torch.no_grad()``, which ``storm.enable`` leaves alone. A callback because transformers'
own switch (``TrainingArguments.activation_checkpointing_kwargs={"offload": True}``) wraps
checkpointing in torch's ``save_on_cpu`` and takes no other offloader.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..enabled import Enabled, enable


class StormCallback(TrainerCallback):
    """``storm.enable(model, **options)`` for the span of ``Trainer.train()``; ``options`` are
    storm.enable's (``budget=`` / ``peak=`` for a plan, else storm.offload's). ``handle`` is
    the Enabled of the run in progress (None outside it): ``handle.explain()``."""

    def __init__(self, **options: Any):
        self.options = options
        self.handle: Enabled | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("StormCallback: the Trainer passed no model to on_train_begin")
        if self.handle is not None:  # a train() that raised had no train end (transformers has no exception event)
            self.handle.disable()
        self.handle = enable(model, **self.options)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.disable()
            self.handle = None
