"""Length-limited canonical Huffman coding of a byte-symbol stream, in parallel lanes.

Why Huffman and not rANS: the exponent alphabet is small (<= 256 symbols, a
few dozen in use) and its order-0 entropy is 2.5 to 3 bits, where Huffman
lands within a few percent of the bound; a Huffman decoder is a table lookup
per symbol with no multiply or renormalisation, which keeps the GPU decoder
simple.

Layout. ``n`` symbols are dealt to ``lanes = ceil(n / LANE_STEPS)`` lanes in
groups of ``GROUP`` = 4 consecutive symbols, round-robin: group ``q`` (symbols
``4q .. 4q+3``) goes to lane ``q % lanes`` as its steps ``4 * (q // lanes) + k``
(the tail is padded with the shortest code). Each lane is an independent
bitstream (LSB-first, codes bit-reversed so that a decoder masks the low
``MAX_LEN`` bits of a window and indexes a table). Lane streams are
concatenated; their bit lengths (uint16) are stored, and the start of every
lane is their exclusive prefix sum (``associative_scan``). Decoding runs all
lanes in lock step; a GPU thread reads and writes its lane's 4 symbols as one
32-bit word, and neighbouring lanes touch neighbouring words (coalesced).

The code. One Huffman tree over the counts (ties broken by symbol), depths over
MAX_LEN brought down as JPEG does, canonical codes as DEFLATE's. The host builds
it here (``code_lengths``, ``canonical_codes``); for CUDA tensors of bf16, int16
and fp32, kernels.gpu.huffman_code.build_code builds the same code on the device, so
the bytes are the same wherever a tensor is encoded.
"""
from __future__ import annotations

import functools
import heapq

import numpy as np
import torch

from .container import require
from .gpu import use_triton
from .scan import associative_scan

MAX_LEN = 12          # longest code; the decode table has 2**MAX_LEN entries
LANE_STEPS = 256      # symbols per lane: bounds a lane to 3072 bits (fits uint16)
GROUP = 4             # consecutive symbols a lane takes at a time
PAD_WORDS = 3         # the GPU decoder reads a 96-bit window at any bit of the stream


def code_lengths(hist: np.ndarray) -> np.ndarray:
    """Huffman code lengths (uint8, 0 = unused) for a 256-bin histogram, at most MAX_LEN bits.

    One Huffman tree; where it is deeper than MAX_LEN, the depth counts are adjusted as
    JPEG does (ITU-T T.81, Annex K.3: two leaves of the deepest level move up, the Kraft
    sum stays 1) and the lengths are handed out again, shortest to the most frequent.
    """
    freq = hist.astype(np.int64)
    used = np.flatnonzero(freq)
    out = np.zeros(256, dtype=np.uint8)
    if len(used) == 0:
        return out
    if len(used) == 1:
        out[used[0]] = 1
        return out
    depth = _tree_depths(freq[used].tolist())
    if max(depth) <= MAX_LEN:
        out[used] = depth
        return out
    bits = np.bincount(depth).tolist()
    for i in range(len(bits) - 1, MAX_LEN, -1):
        while bits[i] > 0:
            j = i - 2
            while bits[j] == 0:
                j -= 1
            bits[i] -= 2
            bits[i - 1] += 1
            bits[j + 1] += 2
            bits[j] -= 1
    by_freq = used[np.lexsort((used, -freq[used]))]  # most frequent first, ties by symbol
    out[by_freq] = np.repeat(np.arange(MAX_LEN + 1), bits[:MAX_LEN + 1])
    return out


def _tree_depths(freqs: list[int]) -> list[int]:
    """Leaf depths of a Huffman tree (ties broken by node id, so deterministic)."""
    m = len(freqs)
    heap = [(f, i) for i, f in enumerate(freqs)]
    heapq.heapify(heap)
    parent = [0] * (2 * m - 1)
    node = m
    while len(heap) > 1:
        fa, a = heapq.heappop(heap)
        fb, b = heapq.heappop(heap)
        parent[a] = parent[b] = node
        heapq.heappush(heap, (fa + fb, node))
        node += 1
    depth = [0] * (2 * m - 1)
    for i in range(2 * m - 3, -1, -1):  # parents are created after their children
        depth[i] = depth[parent[i]] + 1
    return depth[:m]


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Bit-reversed canonical codes (int64 per symbol) for LSB-first streams.

    Canonical as in DEFLATE: codes of one length are consecutive in symbol order, and
    the first code of each length follows the last of the length before, shifted.
    """
    codes = np.zeros(256, dtype=np.int64)
    used = np.flatnonzero(lengths)
    if len(used) == 0:
        return codes
    order = used[np.lexsort((used, lengths[used]))]  # by (length, symbol)
    ln = lengths[order].astype(np.int64)
    count = np.bincount(ln, minlength=MAX_LEN + 1)
    first = np.zeros(MAX_LEN + 1, dtype=np.int64)
    code = 0
    for b in range(1, MAX_LEN + 1):
        code = (code + int(count[b - 1])) << 1
        first[b] = code
    canon = first[ln] + np.arange(len(order)) - np.searchsorted(ln, ln, side="left")
    codes[order] = _REVERSED[canon] >> (MAX_LEN - ln)  # LSB-first: the low ln bits reversed
    return codes


_REVERSED = np.array([int(f"{i:0{MAX_LEN}b}"[::-1], 2) for i in range(1 << MAX_LEN)], dtype=np.int64)


def check_lengths(lengths: np.ndarray) -> None:
    """A decodable table: lengths within 0..MAX_LEN and the Kraft sum at most 1."""
    require(lengths.shape == (256,) and int(lengths.max(initial=0)) <= MAX_LEN,
            "Huffman table: code length out of range")
    used = lengths[lengths > 0].astype(np.int64)
    require(int((1 << (MAX_LEN - used)).sum()) <= (1 << MAX_LEN), "Huffman table: lengths violate the Kraft inequality")


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """int32[2**MAX_LEN]: entry = symbol << 4 | length (length 0 marks an invalid code)."""
    check_lengths(lengths)
    table = np.zeros(1 << MAX_LEN, dtype=np.int32)
    used = np.flatnonzero(lengths)
    if len(used) == 0:
        return table
    ln = lengths[used].astype(np.int64)
    codes = canonical_codes(lengths)[used]
    # a code of length l fills every entry whose low l bits are the code: 2**(MAX_LEN-l) of them
    reps = 1 << (MAX_LEN - ln)
    k = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    table[np.repeat(codes, reps) + (k << np.repeat(ln, reps))] = np.repeat((used << 4) | ln, reps)
    return table


@functools.lru_cache(maxsize=64)
def device_tables(lengths: bytes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode table int16[256] = code << 4 | length, decode table int16[2**MAX_LEN] = symbol
    << 4 | length) of a code, on ``device``: 16 bits an entry (both fit), so a GPU gather
    touches half the cache lines. Cached: the tensors a training step saves repeat their
    kinds, so their codes repeat from step to step, and a table is built and copied once."""
    ln = np.frombuffer(lengths, dtype=np.uint8)
    enc = (canonical_codes(ln) << 4 | ln).astype(np.uint16).view(np.int16)
    return torch.from_numpy(enc).to(device), torch.from_numpy(decode_table(ln).astype(np.int16)).to(device)


def can_merge(n: int) -> bool:
    """Whether the GPU decoder can write merged elements directly (whole groups of 4)."""
    return n % GROUP == 0


def lane_shape(n: int) -> tuple[int, int]:
    """(lanes, steps) for n symbols; steps is a multiple of GROUP."""
    lanes = max(1, -(-n // LANE_STEPS))
    steps = max(1, -(-n // lanes))
    return lanes, -(-steps // GROUP) * GROUP


def _to_steps(s: torch.Tensor, lanes: int, steps: int) -> torch.Tensor:
    """Element order [n_pad] -> (steps, lanes) lane order."""
    return s.view(steps // GROUP, lanes, GROUP).permute(0, 2, 1).reshape(steps, lanes)


def _pad_symbol(lengths: np.ndarray) -> int:
    """The symbol the tail of the last lanes is padded with: the first of the shortest codes."""
    return int(np.flatnonzero(lengths == lengths[lengths > 0].min())[0])


def encode(sym: torch.Tensor, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(stream bytes, lane bit lengths as uint16 bytes) for uint8 symbols ``sym``; None when
    a symbol has no code (length 0), so the caller can build a code that has one."""
    dev = sym.device
    n = sym.numel()
    lanes, steps = lane_shape(n)
    pad_sym = _pad_symbol(lengths)
    if use_triton(sym):
        from .gpu.huffman import encode_lanes, programs
        from .gpu.huffman_code import host_code
        flags = torch.zeros(1 + programs(lanes), dtype=torch.int64, device=dev)
        out = encode_lanes(sym.reshape(-1), 1, device_tables(lengths.tobytes(), dev)[0],
                           host_code(lengths, pad_sym, dev), flags, lanes, steps, PAD_WORDS, MAX_LEN)
        return None if out is None else out[:2]
    len_t = torch.from_numpy(lengths.astype(np.int64)).to(dev)
    s = torch.full((steps * lanes,), pad_sym, dtype=torch.int64, device=dev)
    s[:n] = sym.reshape(-1).to(torch.int64)
    lens = len_t[s]
    if bool((lens == 0).any()):
        return None
    lens = _to_steps(lens, lanes, steps)
    s = _to_steps(s, lanes, steps)
    code_t = torch.from_numpy(canonical_codes(lengths)).to(dev)
    lane_bits = lens.sum(dim=0)
    lane_start = associative_scan(lane_bits) - lane_bits
    off = (associative_scan(lens, dim=0) - lens) + lane_start
    total_bits = int((lane_start[-1] + lane_bits[-1]).item())  # host waits: output size
    nwords = -(-total_bits // 32) + PAD_WORDS
    v = code_t[s] << (off & 31)
    w = off >> 5
    words = torch.zeros(nwords, dtype=torch.int64, device=dev)
    words.index_add_(0, w.reshape(-1), (v & 0xFFFFFFFF).reshape(-1))
    words.index_add_(0, (w + 1).reshape(-1), (v >> 32).reshape(-1))
    return _words_to_bytes(words), lane_bits.to(torch.int16).view(torch.uint8)


def encode_fields(t: torch.Tensor, stride: int, force: torch.Tensor,
                  margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray] | None:
    """``encode`` of the symbol field of a CUDA bf16/int16/fp32 tensor with the code built on
    the device (kernels.gpu.huffman_code.build_code: the lengths ``code_lengths`` gives for the
    counts kernels.codecs.huff_exp._huff_counts makes of the histogram of every ``stride``-th
    element, with ``force``'s symbols and ``margin``), reading the elements themselves (no
    symbol stream is written): (stream, lane bit lengths, raw field bytes in the layout of
    kernels.gpu.fields, code lengths), or None as ``encode``."""
    from .gpu.fields import sample_histogram
    from .gpu.huffman import code_work, encode_lanes
    from .gpu.huffman_code import build_code
    w = t.element_size()
    x = t.contiguous().reshape(-1).view(torch.int16 if w == 2 else torch.int32)
    if x.data_ptr() % 16:  # the lane kernels read 4 elements at once
        x = x.clone()
    lanes, steps = lane_shape(x.numel())
    with code_work(x.device, lanes) as work:
        sample_histogram(x, stride, out=work.hist)
        build_code(work, force, margin, MAX_LEN)
        return encode_lanes(x, w, work.table, work.info, work.flags, lanes, steps, PAD_WORDS, MAX_LEN)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    return words.view(torch.uint8).view(-1, 8)[:, :4].reshape(-1).contiguous()


def decode(stream: torch.Tensor, lane_bits_b: torch.Tensor, lengths: np.ndarray, n: int,
           merge_raw: torch.Tensor | None = None, merge_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of ``encode``: uint8 symbols [n]. Raises CorruptEncodedError on inconsistent data.

    With ``merge_raw``/``merge_dtype`` (Triton path only, see ``can_merge``), the GPU decoder
    joins each symbol with its raw field (kernels.bits layout) and returns the flat tensor
    of ``merge_dtype`` instead of the symbols.
    """
    lanes, steps = lane_shape(n)
    require(lane_bits_b.numel() == 2 * lanes, f"Huffman: {lane_bits_b.numel()} bytes of lane lengths for {lanes} lanes")
    require(stream.numel() % 4 == 0 and stream.numel() >= 4 * PAD_WORDS, "Huffman: stream is not whole 32-bit words")
    nwords = stream.numel() // 4
    if use_triton(stream):
        from .gpu.huffman import decode_lanes
        table = device_tables(lengths.tobytes(), stream.device)[1]  # checks the lengths when it builds
        out, info = decode_lanes(stream, lane_bits_b.view(torch.int16), table, lanes, steps, MAX_LEN, n, merge_raw,
                                 merge_dtype)
        bad, total = info.tolist()  # the one host wait; the kernel clamps its reads, so it ran safely either way
        require(-(-total // 32) + PAD_WORDS == nwords, "Huffman: lane lengths do not match the stream length")
        require(not bad, "Huffman: a lane's codes do not match its length (corrupted stream)")
        return out[:n]
    table = decode_table(lengths)
    lane_bits = lane_bits_b.view(torch.int16).to(torch.int64) & 0xFFFF
    lane_start = associative_scan(lane_bits) - lane_bits
    total = int(lane_bits.sum())
    require(-(-total // 32) + PAD_WORDS == nwords, "Huffman: lane lengths do not match the stream length")
    # CPU (and CUDA without Triton): all lanes in lock step with NumPy gathers,
    # which are several times cheaper than torch advanced indexing on the CPU
    words = stream.cpu().numpy().view(np.uint32).astype(np.uint64)
    start = lane_start.cpu().numpy().astype(np.int64)
    pos = start.copy()
    out = np.empty((steps, lanes), dtype=np.uint8)
    bad = np.zeros(lanes, dtype=bool)
    mask = (1 << MAX_LEN) - 1
    for i in range(steps):
        w = np.minimum(pos >> 5, nwords - 2)  # clamped: a corrupt length cannot read past the end
        win = (words[w] | (words[w + 1] << np.uint64(32))) >> (pos & 31).astype(np.uint64)
        e = table[(win & np.uint64(mask)).astype(np.int64)]
        ln = e & 15
        out[i] = e >> 4
        bad |= ln == 0
        pos += ln
    require(not bad.any() and np.array_equal(pos, start + lane_bits.cpu().numpy()),
            "Huffman: a lane's codes do not match its length (corrupted stream)")
    elems = out.reshape(steps // GROUP, GROUP, lanes).transpose(0, 2, 1).reshape(-1)
    return torch.from_numpy(np.ascontiguousarray(elems[:n])).to(stream.device)
