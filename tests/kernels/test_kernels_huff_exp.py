"""Codec c (storm.kernels.codecs.huff_exp): the code it builds from a sample."""
from __future__ import annotations

import numpy as np
import torch

from kernels_strategies import bits_equal
from storm.kernels import decode, encode
from storm.kernels.bits import symbol_field
from storm.kernels.codecs.fields import sample_symbol_hist
from storm.kernels.codecs.huff_exp import _huff_counts


def test_huff_exp_symbol_the_sample_missed() -> None:
    """The code is built from a strided sample plus a margin; a symbol outside both (here
    at an odd index, which a stride-2 sample never reads) still decodes exactly."""
    t = torch.ones((1 << 21) + 6, dtype=torch.bfloat16)
    t[1::2] = 2.0  # in the margin: coded without a fallback
    t[12345] = 3e30
    sampled = _huff_counts(sample_symbol_hist(t), t.dtype)
    assert sampled[int(symbol_field(t[12345:12346]))] == 0  # outside the sampled code set
    enc = encode(t, "huff_exp")
    lengths = np.frombuffer(enc.meta["lengths"], dtype=np.uint8)
    assert lengths[int(symbol_field(t[12345:12346]))] > 0
    assert bits_equal(decode(enc), t)
