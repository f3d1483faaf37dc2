"""STORM in the training frameworks users already run, one line each (docs/integrations.md).

- ``storm.integrations.transformers.StormCallback``: Hugging Face ``Trainer(callbacks=[...])``.
- ``storm.integrations.lightning.StormCallback``: ``lightning.pytorch.Trainer(callbacks=[...])``.
- accelerate needs no module: ``storm.enable(accelerator.unwrap_model(model), ...)`` after
  ``accelerator.prepare``.

Each module imports its framework, so ``import storm`` never needs one.
"""
