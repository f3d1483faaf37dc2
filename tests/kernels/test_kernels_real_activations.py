"""Ratios on saved tensors of a real training step (all-MiniLM-L6-v2, real English text).

The fixture is written by bench/capture_activations.py: every tensor autograd
saved in one step (parameters excluded), each cropped to a fixed fraction of
its elements, so byte weights follow the real step. Ratios count the full
serialized size (header and checksum included).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storm.kernels import CodecNotApplicable, decode, encode, verify_lossless

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "activations" / "minilm_saved.pt"


@pytest.fixture(scope="module")
def saved() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE, weights_only=True)["tensors"]


def byte_weighted(tensors: list[torch.Tensor], codec: str) -> float:
    raw = enc = 0
    for t in tensors:
        try:
            e = encode(t, codec)
            n = e.nbytes
        except CodecNotApplicable:
            n = t.numel() * t.element_size()
        raw += t.numel() * t.element_size()
        enc += n
    return raw / enc


def test_fixture_is_small_and_real(saved: dict[str, torch.Tensor]) -> None:
    assert FIXTURE.stat().st_size <= 10 * 10**6
    dtypes = {t.dtype for k, t in saved.items() if k.startswith("bf16/")}
    assert torch.bfloat16 in dtypes and torch.float32 in dtypes


def test_auto_on_bf16_autocast_step(saved: dict[str, torch.Tensor]) -> None:
    step = [t for k, t in saved.items() if k.startswith("bf16/")]
    ratio = byte_weighted(step, "auto")
    print(f"auto, all saved tensors of the bf16 autocast step: {ratio:.3f}x")
    assert ratio >= 1.45


def test_exponent_dictionary_on_bf16_tensors(saved: dict[str, torch.Tensor]) -> None:
    bf16 = [t for k, t in saved.items() if k.startswith("bf16/") and t.dtype == torch.bfloat16]
    ratio = byte_weighted(bf16, "ancf_exp")
    print(f"ancf_exp (b), bf16 tensors of the bf16 autocast step: {ratio:.3f}x")
    assert ratio >= 1.30


def test_every_real_tensor_roundtrips(saved: dict[str, torch.Tensor]) -> None:
    for k, t in saved.items():
        for codec in ("auto", "ancf_exp", "huff_exp"):
            try:
                e = encode(t, codec)
            except CodecNotApplicable:
                continue
            assert verify_lossless(decode(e), t), (k, codec)
