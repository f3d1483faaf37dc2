"""storm.offload's check for a model compiled as one graph (compiled.LateSaves), on scripted
allocator readings: a step whose saves were mostly allocated before the first reached the hooks
warns once; eager steps and blocks compiled one by one do not. On CUDA: tests/test_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from storm.compiled import LATE_SAVES_MIN_BYTES, LateSaves, warn_whole_graph

MiB = 1 << 20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(LateSaves, "judged", False)
    warn_whole_graph.cache_clear()
    yield
    warn_whole_graph.cache_clear()


class Allocator:
    """What a device holds, as the test says."""

    def __init__(self) -> None:
        self.held = 1000 * MiB

    def __call__(self, device: torch.device) -> int:
        return self.held


def saves(n: int, nbytes: int = 16 * MiB) -> list[torch.Tensor]:
    x = torch.zeros(1, requires_grad=True)
    return [(x * 1).expand(nbytes // 4).contiguous() for _ in range(n)]  # made by the step: not leaves


def step(allocated: Allocator, made_before_first: int, tensors: list[torch.Tensor], caplog) -> list[str]:
    late = LateSaves(allocated)
    with caplog.at_level(logging.WARNING, logger="storm"):
        late.enter(CPU)
        allocated.held += made_before_first
        for t in tensors:
            late.saved(t)
            allocated.held += t.untyped_storage().nbytes()
        late.exit()
    return [r.getMessage() for r in caplog.records if "compiled as one graph" in r.getMessage()]


def test_saves_handed_over_after_the_whole_forward_warn_once_naming_per_block_compile(caplog):
    tensors = saves(8)
    warned = step(Allocator(), sum(t.untyped_storage().nbytes() for t in tensors), tensors, caplog)
    assert len(warned) == 1 and warned[0].startswith("storm.offload:")
    assert "b.compile()" in warned[0] and "storm.partitioner()" in warned[0]
    assert LateSaves.judged
    caplog.clear()
    assert step(Allocator(), 10**12, tensors, caplog) == []  # judged once a process


@pytest.mark.parametrize("before_first", [0, 2], ids=["eager", "per-block"])
def test_saves_handed_over_as_made_do_not_warn(before_first, caplog):
    """Eager: the first save is the step's first; compiled block by block: one block's (of 8)."""
    tensors = saves(8)
    assert step(Allocator(), before_first * 16 * MiB, tensors, caplog) == []
    assert LateSaves.judged


def test_a_step_saving_little_is_not_judged(caplog):
    tensors = saves(1, LATE_SAVES_MIN_BYTES // 2)
    assert step(Allocator(), 10**12, tensors, caplog) == [] and not LateSaves.judged


def test_leaves_that_require_grad_do_not_count_and_a_warning_already_given_is_not_repeated(caplog):
    weight = torch.zeros(LATE_SAVES_MIN_BYTES, requires_grad=True)
    assert step(Allocator(), 10**12, [weight], caplog) == [] and not LateSaves.judged
    warn_whole_graph("storm.enable", "the model's forward")  # storm.enable saw the model compiled
    caplog.clear()
    tensors = saves(8)
    assert step(Allocator(), 10**12, tensors, caplog) == [] and LateSaves.judged


def test_saves_on_another_device_than_the_one_read_are_not_judged(caplog):
    late = LateSaves(Allocator())
    late.enter(torch.device("meta"))
    for t in saves(8):
        late.saved(t)
    late.exit()
    assert not LateSaves.judged
