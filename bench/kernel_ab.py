"""Each GPU kernel's device time: this tree's codecs against an older revision's, in one process.

Where bench/frame_ab.py and bench/codec_ab.py time whole calls (host included), this script
profiles them (torch.profiler) and reports the median device time of every kernel a call runs:
frames and huff_exp, encode and decode, on a 256 MiB bf16 N(0,1) tensor and a 256 MiB fp32 one.
The two revisions alternate, two rounds each; every huff_exp round trip is checked bit for bit.

    mkdir -p /tmp/old && git archive REV kernels | tar -x -C /tmp/old
    python bench/kernel_ab.py --old /tmp/old --out bench/results/kernel-ab.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec_ab import ab_arguments  # noqa: E402
from frame_ab import load_old  # noqa: E402
from provenance import commit  # noqa: E402
import storm.kernels  # noqa: E402


def kernel_times(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Median device time (us) of each kernel (and copy) ``fn`` runs, over ``reps`` calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times.setdefault(e.name[:40], []).append(e.device_time_total)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def calls(pkg: types.ModuleType, x: torch.Tensor, xf: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The calls profiled, through package ``pkg`` (storm.kernels or the old revision's)."""
    n = x.numel()
    f = torch.empty(pkg.frame.frame_nbytes(n), dtype=torch.uint8, device=x.device)
    pkg.frame.encode_frame(x, f)
    out = {"frame_encode": lambda: pkg.frame.encode_frame(x, f), "frame_decode": lambda: pkg.frame.decode_frame(f, n)}
    for name, t in (("bf16", x), ("fp32", xf)):
        e = pkg.encode(t, "huff_exp")
        assert pkg.verify_lossless(t, pkg.decode(e)), (pkg.__name__, name)
        out[f"huff_{name}_encode"] = lambda t=t: pkg.encode(t, "huff_exp")
        out[f"huff_{name}_decode"] = lambda e=e: pkg.decode(e)
    return out


def main() -> None:
    args = ab_arguments("directory holding the old revision's kernels/", reps=10).parse_args()
    load_old(args.old)
    variants = {"old": sys.modules["storm_old_kernels"], "new": storm.kernels}
    n = 128 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, generator=g, device="cuda").bfloat16()
    xf = torch.randn(n // 2, generator=g, device="cuda")
    out = {"device": torch.cuda.get_device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "reps": args.reps, "rows": []}
    for rnd in range(2):
        for v, pkg in variants.items():
            row = {"variant": v, "round": rnd}
            row.update({name: kernel_times(fn, args.reps) for name, fn in calls(pkg, x, xf).items()})
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
