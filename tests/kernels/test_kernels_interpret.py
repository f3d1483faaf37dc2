"""Triton kernels under Triton's interpreter on the CPU: the frame kernels against kernels.frame's
torch reference (the same bytes, by one program and by many, with the scan's look-back; the
decoder's round trip), the Huffman lane kernels (code built on the device, lane pass, encoder,
decoder) against huff_exp's torch path, codec b's fused kernels (kernels.gpu.ancf_exp) and 1/2-bit
packing against their torch paths, and the one-pass scan against torch.cumsum. CI has no GPU, so this is
where a change to those kernels is first checked; the device's tests (test_kernels_gpu.py) run
them compiled.

TRITON_INTERPRET is read as the kernels are defined, so they run in a process of their own."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

FRAMES = r"""
import torch
from storm.kernels import frame
from storm.kernels.gpu import frame as gframe

def both(x, small_tiles):
    lay = frame.layout(x.numel())
    ref = torch.full((lay.end,), 0xAB, dtype=torch.uint8)
    frame.encode_frame(x, ref)  # a CPU tensor: the torch reference
    got = torch.full((lay.end,), 0xCD, dtype=torch.uint8)
    gframe.frame_encode(x.contiguous(), got, lay, frame.SAMPLE, small_tiles, frame.MAGIC)
    count = int(ref[:4].view(torch.int32)[0])
    written = lay.sym + min(count, lay.cap)  # slots past the count stay unwritten
    assert torch.equal(ref[:written], got[:written]), (x.numel(), small_tiles)
    if frame.complete(ref):
        out = torch.empty(x.numel(), dtype=torch.int16)
        gframe.frame_decode(got, out, lay, small_tiles)
        assert torch.equal(out, x.view(torch.int16)), (x.numel(), small_tiles)
    return count <= lay.cap

g = torch.Generator().manual_seed(0)
specials = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC5, 0x0001, 0x807F, 0x7F7F],
                        dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
for n in (0, 7, 4097, 2 * 16384, 2 * 16384 + 2049):
    x = (torch.randn(n, generator=g) * 3).bfloat16()
    x[::400] = specials.repeat(n // 4000 + 1)[: len(x[::400])]
    x[3::500] = 2.0 ** 100  # escapes: 0.45 % of the words, under the 0.78 % of the slots
    for small_tiles in (16, 0):  # one program where it fits, and always many
        assert both(x, small_tiles)
    assert both(torch.cat([x[:1], x])[1:], 0)  # 2 bytes past 4-byte alignment: the pairs' reads need 4
(scratch,) = gframe._FRAME_SCRATCH.pools[("cpu",)]  # one pooled scratch served every encode
assert not scratch[gframe._SCRATCH_HIST.value:gframe._SCRATCH_GROUP.value].any()  # its histogram and count at rest
every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
assert not both(every[:40000], 0)  # overflows: the count, and every slot, still match
print("frames: the interpreter wrote the reference's bytes")
"""


HUFFMAN = r"""
import torch
from storm.kernels import huffman
from storm.kernels.bits import symbol_field
from storm.kernels.codecs import fields, huff_exp
from storm.kernels.gpu import huffman as ghuffman

g = torch.Generator().manual_seed(0)
pooled = set()
for n in (7, 4096 + 4, 40000):  # one program of lanes, and several looking back
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        x[::97] = 1e-38  # subnormal in bf16, a rare exponent in fp32
        x[5::301] = float("nan")
        x[::1000] *= 2.0 ** 60  # rare symbols: codes longer than most
        meta, bufs = huff_exp.encode(x)  # the torch path
        out = huffman.encode_fields(x, fields.sample_stride(x), huff_exp._forced_on_device(dtype, x.device),
                                    huff_exp.HUFF_MARGIN)
        stream, lane_bits, raw, lengths = out
        # the kernels left the pooled work at rest, and every encode took the same one
        (work,) = ghuffman._CODE_WORK.pools[("cpu",)]
        assert not (work.hist.any() or work.info[:2].any() or work.flags.any()), (n, dtype)
        pooled.add(id(work))
        assert lengths.tobytes() == meta["lengths"], (n, dtype)
        for got, key in ((stream, "stream"), (lane_bits, "lane_bits"), (raw, "raw")):
            assert torch.equal(got, bufs[key]), (n, dtype, key)
        lanes, steps = huffman.lane_shape(n)
        table = huffman.device_tables(lengths.tobytes(), x.device)[1]
        merged = (raw, dtype) if huffman.can_merge(n) else (None, None)
        y, info = ghuffman.decode_lanes(stream, lane_bits.view(torch.int16), table, lanes, steps, huffman.MAX_LEN, n,
                                        *merged)
        assert info[0] == 0 and info[1] == lane_bits.view(torch.int16).to(torch.int64).sum(), (n, dtype, info)
        want = x.reshape(-1).view(torch.uint8) if merged[0] is not None else symbol_field(x).to(torch.uint8)
        assert torch.equal(y[:n].view(torch.uint8) if merged[0] is not None else y[:n], want), (n, dtype)
assert len(pooled) == 1, pooled
print("huffman: the interpreter wrote the torch path's bytes")
"""


# codec b's fused kernels, the sample histogram they start from, and 1/2-bit packing
ANCF_EXP = r"""
import numpy as np
import torch
from storm.kernels import bitpack
from storm.kernels.codecs import ancf_exp, fields
from storm.kernels.codecs.base import pos_dtype
from storm.kernels.gpu import ancf_exp as gancf, bitpack as gbit
from storm.kernels.gpu.fields import sample_histogram
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for n in (5, 2048 * 3 + 7):
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        x[::97] = 1e-38  # rare exponents: escapes
        meta, bufs = ancf_exp.encode(x)  # the torch path
        hist = fields.sample_symbol_hist(x)
        assert (sample_histogram(x.reshape(-1), fields.sample_stride(x)).numpy() == hist).all()
        top = np.frombuffer(meta["table"], dtype=np.uint8)
        lut_np = np.full(256, 15, dtype=np.int32)
        lut_np[top] = np.arange(len(top), dtype=np.int32)
        codes, raw, pos, sym = gancf.dict4_encode(x, torch.from_numpy(lut_np), pos_dtype(n), 0)
        assert torch.equal(codes, bufs["codes"]) and torch.equal(raw, bufs["raw"]), dtype
        assert torch.equal(pos.view(torch.uint8), bufs["esc_pos"]) and torch.equal(sym, bufs["esc_sym"])
        lut = torch.zeros(16, dtype=torch.uint8)
        lut[:len(top)] = torch.from_numpy(top.copy())
        words, stat = gancf.dict4_decode(codes, raw, lut, n, len(top), dtype, pos, sym)
        assert stat == [meta["escapes"], 0, 0], stat
        assert torch.equal(words.view(dtype), x), dtype
for w in (1, 2):
    v = torch.randint(0, 1 << w, (1003,), generator=g)
    packed = gbit.pack_small_triton(v, w)
    assert torch.equal(packed, bitpack.pack_bits(v, w, backend="torch"))
    assert torch.equal(gbit.unpack_small_triton(packed, w, 1003), v)
print("ancf_exp, fields and bitpack kernels: the torch path's bytes under the interpreter")
"""


SCAN = r"""
import torch
from storm.kernels.gpu.scan import scan_lastdim

g = torch.Generator().manual_seed(0)
for rows, length in ((1, 1), (3, 5000), (2, 40000)):  # one block; many, each looking back
    x = torch.randint(-1000, 1000, (rows, length), generator=g, dtype=torch.int32)
    assert torch.equal(scan_lastdim(x), torch.cumsum(x, -1)), length
    assert torch.equal(scan_lastdim(x, torch.int32), torch.cumsum(x, -1, dtype=torch.int32)), length
print("scan: the interpreter matched torch.cumsum")
"""


def interpret(script: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def test_frame_kernels_write_the_reference_bytes_under_the_interpreter() -> None:
    assert "reference's bytes" in interpret(FRAMES)


def test_huffman_lane_kernels_write_the_torch_paths_bytes_under_the_interpreter() -> None:
    assert "torch path's bytes" in interpret(HUFFMAN)


def test_ancf_exp_and_bitpack_kernels_write_the_torch_paths_bytes_under_the_interpreter() -> None:
    assert "torch path's bytes under the interpreter" in interpret(ANCF_EXP)


def test_one_pass_scan_matches_cumsum_under_the_interpreter() -> None:
    assert "matched torch.cumsum" in interpret(SCAN)
