"""storm.enable's explain(): how its steps are marked, and the plan still there to read after
disable(), its last step read."""

from __future__ import annotations

import torch
from torch import nn

import storm
from integrations_clock import SETTLE_STEPS, StillClock
from storm.examples.models import GPT


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)


def loss_of(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def test_after_disable_explain_tells_the_plan_as_its_last_step_left_it():
    """Training ends with the step that settles the plan (the last of its trial); nothing reads
    the plan between that step and disable(): explain() after it still says settled, what the
    trial kept, and that STORM is off."""
    model, idx = gpt(), torch.randint(0, 64, (2, 32))
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    for _ in range(SETTLE_STEPS):
        loss_of(model, idx).backward()
    handle.disable()
    assert handle.planner.settled  # disable() read the last step
    text = handle.explain()
    assert text.startswith("storm.enable (disabled; as it was then): storm.plan on 3 blocks at blocks (GPTBlock) on "
                           "every forward of GPT with grad enabled (those before one backward: one step)\n"), text
    assert "\nsettled: " in text and "; kept the reentrant form: neither was faster" in text, text
    before, after = text.split("before the blocks: ")[1].split("after the blocks: ")
    assert before.startswith("9 KiB saved by drop 8 KiB, tok 1 KiB, pos 1 KiB; ") and "head" in after, text


def test_steps_marked_by_begin_and_end_are_told_so():
    """With on_forward=False (Lightning's callback) the model's forwards are not what marks a step."""
    model, idx = gpt(), torch.randint(0, 64, (2, 32))
    handle = storm.enable(model, mode="embedded", min_bytes=0, on_forward=False)
    assert handle.explain() == ("storm.enable: storm.offload in GPT, on the steps that begin() and end() mark (a "
                                "framework's callback: Lightning's batch hooks), with grad enabled; no step yet")
    handle.begin()
    loss = loss_of(model, idx)
    handle.end()
    loss.backward()
    assert "on every forward" not in handle.explain() and handle.last.stats.offloaded > 0
    handle.disable()
