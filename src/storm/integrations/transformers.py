"""Hugging Face ``Trainer``: STORM on the model from train begin to train end.

    from storm.integrations.transformers import StormCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[StormCallback(budget=0.5)])

The callback calls ``storm.enable`` on the model the Trainer trains (its repeated blocks found
inside it: ``model.model.layers``) when training begins, and disables it when training ends,
so evaluation and generation afterwards run as without STORM; evaluation during training runs
under ``torch.no_grad()``, which ``storm.enable`` leaves alone. The disabled handle stays on the
callback, so ``callback.handle.explain()`` tells the plan and its trials after ``train()``. A
callback because transformers' own switch
(``TrainingArguments.activation_checkpointing_kwargs={"offload": True}``) wraps checkpointing in
torch's ``save_on_cpu`` and takes no other offloader.
"""

from __future__ import annotations

import weakref
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..enabled import Enabled, check_options, enable, handle_of

# The handles StormCallbacks made: transformers has no event for a train() that raises, so its
# callback's handle stays on the model, and the next StormCallback on that model takes it off.
_made: "weakref.WeakSet[Enabled]" = weakref.WeakSet()


class StormCallback(TrainerCallback):
    """``storm.enable(model, **options)`` for the span of ``Trainer.train()``; ``options`` are
    storm.enable's (``budget=`` / ``peak=`` for a plan, else storm.offload's). ``handle`` is
    the Enabled of the run in progress, and after it ends, until the next begins, of the run
    that ended, disabled (None before the first): ``handle.explain()`` reads its plan either way.
    The options are checked here, as storm.enable checks them. A train() that raised leaves
    STORM on the model until the next train() with a StormCallback, which takes it off first."""

    def __init__(self, **options: Any):
        check_options(**options)
        self.options = options
        self.handle: Enabled | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("StormCallback: the Trainer passed no model to on_train_begin")
        stale = handle_of(model)  # a StormCallback's (this one's or another's) whose train() raised
        if stale in _made:
            stale.disable()
        self.handle = enable(model, **self.options)
        _made.add(self.handle)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.handle is not None:
            self.handle.disable()  # kept: its plan and last step stay readable until the next train()
