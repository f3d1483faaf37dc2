"""The source document's ANCFEncoder surface: policies, verify_lossless, statistics."""
from __future__ import annotations

import pytest
import torch

from storm.kernels import ANCFEncoder
from storm.kernels.ancf_encoder import dictionary_size


def test_policies() -> None:
    assert [dictionary_size(0, s) for s in (0.0, 0.5, 0.9)] == [256, 256, 256]
    assert [dictionary_size(1, s) for s in (0.0, 0.5, 0.9)] == [512, 256, 128]
    assert [dictionary_size(2, s) for s in (0.0, 0.5, 0.9)] == [512, 128, 128]
    with pytest.raises(ValueError):
        ANCFEncoder(policy=3)


@pytest.mark.parametrize("policy", [0, 1, 2])
def test_encode_decode_and_stats(policy: int) -> None:
    enc = ANCFEncoder(policy=policy)
    dense = torch.randn(4096).half()
    sparse = torch.relu(torch.randn(4096)) * (torch.rand(4096) > 0.6)
    for layer, t in ((0, dense), (1, sparse)):
        e = enc.encode_activation(t, layer_id=layer)
        assert e.meta["entries"] == dictionary_size(policy, float((t == 0).float().mean()))
        out = enc.decode_activation(e, device="cpu", layer_id=layer)
        assert enc.verify_lossless(t, out)
    s = enc.compression_stats()
    assert set(s["layers"]) == {"0", "1"} and s["total"]["tensors"] == 2
    assert s["layers"]["0"]["ratio"] < 1.0  # dense: the exact-value dictionary expands
    assert 0 < s["layers"]["0"]["escape_rate"] <= 1
    assert enc.average_compression_ratio() == pytest.approx(s["total"]["ratio"])
    assert "total" in enc.get_compression_stats()


def test_other_codec_behind_the_same_surface() -> None:
    enc = ANCFEncoder(codec="auto")
    t = torch.randn(1 << 14).bfloat16()
    e = enc.encode_activation(t)
    assert e.codec == "huff_exp" and enc.verify_lossless(t, enc.decode_activation(e))
    assert enc.average_compression_ratio() > 1.3
