"""The lane-parallel Huffman coder (storm.kernels.huffman): its length-limited code."""
from __future__ import annotations

import numpy as np

from storm.kernels import huffman


def test_huffman_lengths_are_limited_and_complete() -> None:
    """Skewed counts whose Huffman tree is far deeper than MAX_LEN: every symbol keeps a
    code, none longer than MAX_LEN, the Kraft sum is exactly 1, and the more frequent of
    two symbols never gets the longer code."""
    hist = np.zeros(256, dtype=np.int64)
    hist[:40] = 2 ** np.arange(40, dtype=np.int64)[::-1] // 2**8 + 1  # a geometric tail: depth 40 unlimited
    lengths = huffman.code_lengths(hist)
    used = hist > 0
    assert ((lengths > 0) == used).all() and lengths.max() == huffman.MAX_LEN
    assert sum(2.0 ** -int(x) for x in lengths[used]) == 1.0
    order = np.argsort(-hist[used], kind="stable")
    assert (np.diff(lengths[used][order].astype(int)) >= 0).all()
