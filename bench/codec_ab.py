"""huff_exp on the GPU: this tree's lane kernels against an older revision's, in one process.

The lent machines' hosts differ by a third from one machine to the next and drift within
a run, so two runs of bench/codec.py cannot tell a 15% change from noise. This script
loads the older revision's ``kernels/gpu/huffman.py`` and ``kernels/entropy.py`` beside
this tree's and alternates them rep by rep on the same tensors (codec.encode/decode with
``entropy.encode_fields`` and ``entropy.decode`` swapped in), then reports medians, the device's
time per kernel of each, and the host time of each step of one encode of this tree.

    mkdir -p /tmp/old && for f in kernels/gpu/huffman.py kernels/entropy.py; do
        git show REV:$f > /tmp/old/$(basename $f); done
    python bench/codec_ab.py --old /tmp/old --out bench/results/codec-ab.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm.kernels.gpu.fields as fields  # noqa: E402
import storm.kernels.gpu.huffman as huffman  # noqa: E402
import storm.kernels.gpu.huffman_code as huffman_code  # noqa: E402
import storm.kernels.huffman as entropy  # noqa: E402  (the old revision's name for it)
from provenance import commit  # noqa: E402
from storm.kernels import decode, encode  # noqa: E402


def load_old(old: Path) -> types.ModuleType:
    """The old entropy module, importing the old huffman module (both inside storm.kernels)."""
    spec = importlib.util.spec_from_file_location("storm.kernels.gpu.huffman_old", old / "huffman.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    ent = types.ModuleType("storm.kernels.entropy_old")
    ent.__package__ = "storm.kernels"
    sys.modules[ent.__name__] = ent
    src = (old / "entropy.py").read_text().replace("from .gpu.huffman import", "from .gpu.huffman_old import")
    exec(compile(src, str(old / "entropy.py"), "exec"), ent.__dict__)
    return ent


def ab_arguments(old_help: str, reps: int) -> argparse.ArgumentParser:
    """The arguments every one-process A/B script takes: the old revision's directory, the
    reps and the JSON file written."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help=old_help)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--out", required=True)
    return ap


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6, out


def main() -> None:
    args = ab_arguments("directory with the old huffman.py and entropy.py", reps=11).parse_args()
    old = load_old(args.old)
    variants = {"old": (old.encode_fields, old.decode), "new": (entropy.encode_fields, entropy.decode)}
    n = 256 << 20
    torch.manual_seed(0)
    gelu = torch.nn.functional.gelu
    tensors = {"bf16-gelu": gelu(torch.randn(n // 2, device="cuda")).bfloat16(),
               "bf16-gauss": torch.randn(n // 2, device="cuda").bfloat16(),
               "fp32-gauss": torch.randn(n // 4, device="cuda"),
               "bf16-25KB": gelu(torch.randn(12544, device="cuda")).bfloat16(),
               "fp32-25KB": torch.randn(6272, device="cuda")}
    out = {"device": torch.cuda.get_device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "rows": []}
    for name, t in tensors.items():
        times = {v: {"enc": [], "dec": []} for v in variants}
        for rep in range(args.reps + 1):
            for v, (encode_fields, decode_lanes) in variants.items():
                entropy.encode_fields, entropy.decode = encode_fields, decode_lanes
                te, e = timed(lambda: encode(t, "huff_exp"))
                td, d = timed(lambda: decode(e))
                if rep == 0:  # warm-up, and the check that both are lossless
                    assert torch.equal(d.view(torch.uint8), t.view(torch.uint8)), (name, v)
                    continue
                times[v]["enc"].append(te)
                times[v]["dec"].append(td)
        nbytes = t.numel() * t.element_size()
        row = {"kind": name, "ratio": e.ratio}
        for v in variants:
            enc_us, dec_us = statistics.median(times[v]["enc"]), statistics.median(times[v]["dec"])
            row[v] = {"encode_us": enc_us, "decode_us": dec_us, "encode_GBps": nbytes / enc_us / 1e3,
                      "decode_GBps": nbytes / dec_us / 1e3}
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    # the device's time per kernel of one encode and decode of each (torch.profiler)
    from torch.profiler import ProfilerActivity, profile
    out["kernels_us"] = {}
    for v, (encode_fields, decode_lanes) in variants.items():
        entropy.encode_fields, entropy.decode = encode_fields, decode_lanes
        t = tensors["bf16-gelu"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode(encode(t, "huff_exp"))
            torch.cuda.synchronize()
        out["kernels_us"][v] = [(ev.name[:40], round(ev.time_range.end - ev.time_range.start, 1))
                                for ev in sorted(prof.events(), key=lambda ev: ev.time_range.start)
                                if ev.device_type == torch.autograd.DeviceType.CUDA]
        print(v, "kernels (us):", out["kernels_us"][v], flush=True)
    entropy.encode_fields, entropy.decode = variants["new"]

    # host time of each step of this tree's encode (encode_lanes includes its wait for the lane pass;
    # code_work, a context manager since 8f8109f, does its work inside encode_fields' block, in no step)
    steps: dict[str, list[float]] = {}
    for mod, fn in ((fields, "sample_histogram"), (huffman_code, "build_code"), (huffman, "encode_lanes")):
        def wrapped(*a, _f=getattr(mod, fn), _name=fn, **k):
            t0 = time.perf_counter()
            r = _f(*a, **k)
            steps.setdefault(_name, []).append((time.perf_counter() - t0) * 1e6)
            return r
        setattr(mod, fn, wrapped)
    total = [timed(lambda: encode(tensors["bf16-gelu"], "huff_exp"))[0] for _ in range(8)]
    out["host_steps_us"] = {k: statistics.median(v[1:]) for k, v in steps.items()}
    out["host_steps_us"]["encode_total"] = statistics.median(total[1:])
    print("host us per step:", json.dumps(out["host_steps_us"]))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
