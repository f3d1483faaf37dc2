"""The GPU codec kernels at other ``num_warps`` (and the sample histogram at other block sizes):
device time per kernel and wall time of each call.

Each kernel is launched with its usual arguments and ``num_warps`` replaced, one setting at a time,
on 256 MiB tensors (bf16 N(0,1), bf16 GELU outputs, fp32 N(0,1)); every decode is checked bit
for bit. Huffman's lane kernels (lane pass, encoder, decoder) go together, then the code builder
alone, then the frame encoder and decoder together. Device times come from torch.profiler (one
call), wall times are medians of 9 calls with a synchronize around each.

    python bench/kernel_warps.py --out bench/results/kernel-warps.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm.kernels.gpu.fields as fields  # noqa: E402
import storm.kernels.gpu.frame as gframe  # noqa: E402
import storm.kernels.gpu.huffman as huffman  # noqa: E402
import storm.kernels.gpu.huffman_code as huffman_code  # noqa: E402
from provenance import commit  # noqa: E402
from scan import host_seconds  # noqa: E402
from storm.kernels import decode, encode, frame  # noqa: E402


class Warps:
    """A Triton kernel whose launches take ``num_warps`` instead of what the caller passes."""

    def __init__(self, kernel, num_warps: int) -> None:
        self.kernel, self.num_warps = kernel, num_warps

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw["num_warps"] = self.num_warps
            return self.kernel[grid](*args, **kw)
        return launch


def kernel_us(fn) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name.startswith("_"):
            out[ev.name] = round(out.get(ev.name, 0) + ev.time_range.end - ev.time_range.start, 1)
    return out


def wall_us(fn) -> float:
    return round(host_seconds(fn, 9) * 1e6, 1)


def sweep(module, names: tuple[str, ...], settings: tuple[int, ...], run) -> list[dict]:
    """``run(num_warps)`` rows with the kernels ``names`` of ``module`` launched at each setting."""
    kept = {name: getattr(module, name) for name in names}
    rows = []
    try:
        for nw in settings:
            for name, kernel in kept.items():
                setattr(module, name, Warps(kernel, nw))
            rows += run(nw)
    finally:
        for name, kernel in kept.items():
            setattr(module, name, kernel)
    return rows


def sample_hist(tensors: dict[str, torch.Tensor]) -> list[dict]:
    """The strided sample's histogram (huff_exp's first kernel, 2**20 elements 256 or 512 B apart)
    at other programs (fields.SAMPLE_BLOCK elements each) and warps: the same counts every time."""
    from storm.kernels.codecs.fields import sample_stride
    kept = fields.SAMPLE_BLOCK, fields.SAMPLE_WARPS
    rows = []
    try:
        for kind in ("bf16-gauss", "fp32-gauss"):
            t = tensors[kind]
            stride = sample_stride(t)
            want = fields.sample_histogram(t, stride)
            for block in (16384, 8192, 4096, 2048, 1024):
                for nw in (4, 8, 16):
                    fields.SAMPLE_BLOCK, fields.SAMPLE_WARPS = block, nw
                    assert torch.equal(fields.sample_histogram(t, stride), want), (kind, block, nw)
                    rows.append({"kind": kind, "block": block, "num_warps": nw,
                                 "kernels_us": kernel_us(lambda: fields.sample_histogram(t, stride))})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        fields.SAMPLE_BLOCK, fields.SAMPLE_WARPS = kept
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("sample_hist",), help="run this sweep alone")
    args = ap.parse_args()
    torch.manual_seed(0)
    n = 128 << 20
    tensors = {"bf16-gauss": torch.randn(n, device="cuda").bfloat16(),
               "bf16-gelu": torch.nn.functional.gelu(torch.randn(n, device="cuda")).bfloat16(),
               "fp32-gauss": torch.randn(n // 2, device="cuda")}

    def huff(nw: int) -> list[dict]:
        rows = []
        for kind, t in tensors.items():
            e = encode(t, "huff_exp")
            assert torch.equal(decode(e).view(torch.uint8), t.view(torch.uint8)), (kind, nw)
            rows.append({"num_warps": nw, "kind": kind, "encode_kernels_us": kernel_us(lambda: encode(t, "huff_exp")),
                         "decode_kernels_us": kernel_us(lambda: decode(e)),
                         "encode_us": wall_us(lambda: encode(t, "huff_exp")), "decode_us": wall_us(lambda: decode(e))})
            print(json.dumps(rows[-1]), flush=True)
        return rows

    def frames(nw: int) -> list[dict]:
        rows = []
        for kind in ("bf16-gauss", "bf16-gelu"):
            x = tensors[kind]

            def encoded() -> torch.Tensor:
                f = torch.empty(frame.frame_nbytes(n), dtype=torch.uint8, device="cuda")
                frame.encode_frame(x, f)
                return f
            f = encoded()
            assert torch.equal(frame.decode_frame(f, n).view(torch.int16), x.view(torch.int16)), (kind, nw)
            rows.append({"num_warps": nw, "kind": kind, "encode_kernels_us": kernel_us(encoded),
                         "decode_kernels_us": kernel_us(lambda: frame.decode_frame(f, n)),
                         "encode_us": wall_us(encoded), "decode_us": wall_us(lambda: frame.decode_frame(f, n))})
            print(json.dumps(rows[-1]), flush=True)
        return rows

    out = {"device": torch.cuda.get_device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv)}
    if args.only is None:
        out["huffman_lanes"] = sweep(huffman, ("_lane_bits", "_lane_encode", "_lane_decode"), (4, 2, 1, 8), huff)
        out["huffman_build_code"] = sweep(huffman_code, ("_build_code",), (1, 2, 4, 8), huff)
        out["frames"] = sweep(gframe, ("_frame_encode", "_frame_decode"), (4, 8, 2), frames)
    out["sample_hist"] = sample_hist(tensors)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
