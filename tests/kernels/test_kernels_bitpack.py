"""Fixed-width bit packing: every width, every backend, identical bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storm.kernels import pack_bits, unpack_bits
from storm.kernels.bitpack import backend_for, packed_nbytes


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 32), n=st.integers(0, 200), seed=st.integers(0, 2**31))
def test_roundtrip_every_width(width: int, n: int, seed: int) -> None:
    v = torch.randint(0, 1 << width, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    buf = pack_bits(v, width)
    assert buf.dtype == torch.uint8 and buf.numel() == n * (width // 8) + packed_nbytes(n, width % 8)
    assert torch.equal(unpack_bits(buf, width, n), v)


@pytest.mark.parametrize("width", [1, 2])
def test_backends_agree_and_match_numpy_layout(width: int) -> None:
    v = torch.randint(0, 1 << width, (1001,), generator=torch.Generator().manual_seed(0))
    a = pack_bits(v, width, backend="torch")
    b = pack_bits(v, width, backend="numpy")
    assert torch.equal(a, b)
    if width == 1:  # LSB-first, as np.packbits(bitorder="little")
        assert a.numpy().tobytes() == np.packbits(v.numpy().astype(np.uint8), bitorder="little").tobytes()
    for be in ("torch", "numpy"):
        assert torch.equal(unpack_bits(a, width, 1001, backend=be), v)


def test_backend_choice() -> None:
    assert backend_for(torch.zeros(3), 1) == "numpy"
    assert backend_for(torch.zeros(3), 2) == "torch"


def test_ternary_packs_four_per_byte() -> None:
    t = torch.randint(-1, 2, (4000,), dtype=torch.int8)
    buf = pack_bits(t.to(torch.int64) + 1, 2)
    assert buf.numel() == 1000
    assert torch.equal(unpack_bits(buf, 2, 4000) - 1, t.to(torch.int64))
