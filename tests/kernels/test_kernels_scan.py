"""associative_scan against torch.cumsum, and compaction built on it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storm.kernels import associative_scan, compact


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("reverse", [False, True])
def test_integers_identical_to_cumsum(dtype: torch.dtype, reverse: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-100 if dtype.is_signed else 0, 100, (5, 333, 7), generator=g).to(dtype)
    for dim in (0, 1, 2, -1):
        ref = torch.cumsum(x.flip(dim), dim).flip(dim) if reverse else torch.cumsum(x, dim)
        out = associative_scan(x, dim, reverse=reverse)
        assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("src", [torch.int32, torch.int64, torch.bool, torch.float32])
def test_dtype_like_cumsum(src: torch.dtype) -> None:
    x = torch.tensor([2**31 - 1, 2**31 - 1, 5, -7, 3], dtype=torch.int64).to(src)
    for dtype in (torch.int32, torch.int64):
        for reverse in (False, True):
            ref = torch.cumsum(x.flip(0), 0, dtype=dtype).flip(0) if reverse else torch.cumsum(x, 0, dtype=dtype)
            out = associative_scan(x, 0, reverse=reverse, dtype=dtype)
            assert out.dtype == dtype and torch.equal(out, ref)


def test_int64_wraps_like_cumsum() -> None:
    x = torch.tensor([2**62, 2**62, 2**62, -5], dtype=torch.int64)
    assert torch.equal(associative_scan(x), torch.cumsum(x, 0))


def float_bound(x: torch.Tensor, dim: int, u: float) -> torch.Tensor:
    """Order-independent bound for recursive summation: (i) * u * sum_{j<=i} |x_j|."""
    shape = [-1 if d == dim % x.dim() else 1 for d in range(x.dim())]
    i = torch.arange(1, x.shape[dim] + 1, dtype=torch.float64).view(shape)
    return i * u * torch.cumsum(x.double().abs(), dim)


@pytest.mark.parametrize("dtype,u", [(torch.float32, 2.0**-24), (torch.float64, 2.0**-53)])
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2000), scale=st.sampled_from([1e-6, 1.0, 1e6]), reverse=st.booleans(),
       seed=st.integers(0, 1000))
def test_float_error_bound(dtype: torch.dtype, u: float, n: int, scale: float, reverse: bool, seed: int) -> None:
    x = (torch.randn(3, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)
    out = associative_scan(x, 1, reverse=reverse)
    xs = x.flip(1) if reverse else x
    exact = torch.cumsum(xs.double(), 1)
    err = (out.flip(1) if reverse else out).double() - exact
    assert bool((err.abs() <= float_bound(xs, 1, u) + 1e-300).all())


def test_empty_and_scalar() -> None:
    assert associative_scan(torch.empty(0)).numel() == 0
    assert torch.equal(associative_scan(torch.tensor(5)), torch.cumsum(torch.tensor(5), 0))


@settings(max_examples=40, deadline=None)
@given(bits=st.lists(st.booleans(), max_size=500))
def test_compact_matches_masked_select(bits: list[bool]) -> None:
    mask = torch.tensor(bits, dtype=torch.bool)
    vals = torch.arange(len(bits), dtype=torch.int64) * 3 + 1
    (out,) = compact(mask, vals)
    assert torch.equal(out, vals[mask])
