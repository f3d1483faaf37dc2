"""Codec a (storm.kernels.codecs.ancf): an exact-value dictionary reports its true ratio."""
from __future__ import annotations

import torch

from storm.kernels import encode


def test_ancf_reports_its_true_ratio_on_dense_data() -> None:
    t = torch.randn(1 << 15).bfloat16()
    enc = encode(t, "ancf")
    assert enc.ratio < 1.0  # dense activations expand under an exact-value dictionary
    assert 0 < enc.escapes < t.numel()
