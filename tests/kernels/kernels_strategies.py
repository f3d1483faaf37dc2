"""Strategies and helpers shared by the kernel tests (imported by name: the test dir is on sys.path)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]

# bit patterns every float codec must survive: +-0, +-inf, quiet and signalling NaNs
# with payloads, the smallest and largest subnormals, the largest finite value
SPECIAL_BITS = {
    torch.float32: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC12345, 0xFF800001,
                    0x00000001, 0x807FFFFF, 0x7F7FFFFF],
    torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE55, 0x0001, 0x83FF, 0x7BFF],
    torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC5, 0x0001, 0x807F, 0x7F7F],
    torch.float64: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000001, 1, 0x7FEFFFFFFFFFFFFF],
}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def from_bits(words: list[int], dtype: torch.dtype) -> torch.Tensor:
    w = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        data = bytes(x & 1 for x in words)
    else:
        data = b"".join((x & ((1 << (8 * w)) - 1)).to_bytes(w, "little") for x in words)
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).clone()


@st.composite
def tensors(draw, dtype: torch.dtype, max_len: int = 300) -> torch.Tensor:
    """Tensors of ``dtype`` whose bit patterns are random, from a small pool, all equal,
    or normal-ish values; sometimes non-contiguous."""
    w = torch.empty((), dtype=dtype).element_size()
    n = draw(st.integers(0, max_len))
    kind = draw(st.sampled_from(["bits", "pool", "equal", "normal", "sparse"]))
    word = st.integers(0, (1 << (8 * w)) - 1)
    special = SPECIAL_BITS.get(dtype, [0, 1, (1 << (8 * w)) - 1])
    if kind == "bits":
        words = draw(st.lists(st.one_of(word, st.sampled_from(special)), min_size=n, max_size=n))
        t = from_bits(words, dtype)
    elif kind == "pool":
        pool = draw(st.lists(st.one_of(word, st.sampled_from(special)), min_size=1, max_size=20))
        idx = draw(st.lists(st.integers(0, len(pool) - 1), min_size=n, max_size=n))
        t = from_bits([pool[i] for i in idx], dtype)
    elif kind == "equal":
        t = from_bits([draw(st.one_of(word, st.sampled_from(special)))] * n, dtype)
    else:
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        x = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 50.0]))
        if kind == "sparse":
            x = torch.relu(x)
        t = x.to(dtype) if dtype.is_floating_point else (x * 10).round().clamp(-100, 100).to(dtype)
    if draw(st.booleans()) and n >= 4:
        # a strided, non-contiguous view of the same logical kind
        t = t[: (n // 2) * 2].view(-1, 2).t()
        if draw(st.booleans()):
            t = t[:, ::2]
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return (a.contiguous().reshape(-1).view(torch.uint8).cpu().tolist()
            == b.contiguous().reshape(-1).view(torch.uint8).cpu().tolist())


__all__ = ["DTYPES", "SPECIAL_BITS", "bits_equal", "from_bits", "requires_cuda", "tensors"]
