"""Frames on the GPU: this tree's against an older revision's, in one process, rep by rep.

The lent machines' hosts differ by up to twice from one machine to the next, so two runs of
bench/codec.py cannot compare versions. This script imports the older revision's whole
``kernels`` package under another name beside this tree's and alternates their
``encode_frame`` / ``decode_frame`` on the same tensors: 256 MiB bf16 tensors and the real
sample's bf16 tensors (tests/fixtures, each on its own, summed per rep), each call allocating
its output as the mover does. Reports medians, GB/s (uncompressed bytes) and the ratio (frame
bytes) of each; every decode is checked bit for bit.

    mkdir -p /tmp/old && git archive REV kernels | tar -x -C /tmp/old
    python bench/frame_ab.py --old /tmp/old --out bench/results/frame-ab.json
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec import FIXTURE  # noqa: E402
from codec_ab import ab_arguments, timed  # noqa: E402
from provenance import commit  # noqa: E402
from storm.kernels import frame  # noqa: E402


def load_old(old: Path) -> types.ModuleType:
    """The old revision's kernels.frame, its package imported as ``storm_old_kernels``."""
    spec = importlib.util.spec_from_file_location("storm_old_kernels", old / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(old / "kernels")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("storm_old_kernels.frame")


def code(mod: types.ModuleType, ts: list[torch.Tensor]) -> tuple[float, float, int]:
    """(encode us, decode us, frame bytes) of every tensor of ``ts`` through ``mod``, checked."""
    te = td = 0.0
    nbytes = 0
    for t in ts:
        n = t.numel()

        def encoded() -> torch.Tensor:
            f = torch.empty(mod.frame_nbytes(n), dtype=torch.uint8, device=t.device)
            mod.encode_frame(t, f)
            return f

        dt, f = timed(encoded)
        te += dt
        assert mod.complete(f[:16].cpu()), "an overflowing frame: pick tensors that fit"
        dt, out = timed(lambda: mod.decode_frame(f, n))
        td += dt
        assert torch.equal(out, t.reshape(-1).view(torch.int16)), mod.__name__
        nbytes += f.numel()
    return te, td, nbytes


def main() -> None:
    ap = ab_arguments("directory holding the old revision's kernels/", reps=11)
    ap.add_argument("--size-mib", type=int, default=256)
    args = ap.parse_args()
    variants = {"old": load_old(args.old), "new": frame}
    n = (args.size_mib << 20) // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    gauss = torch.randn(n, generator=g, device="cuda")
    saved = torch.load(FIXTURE, weights_only=True)["tensors"]
    kinds = {"bf16-gauss": [gauss.bfloat16()], "bf16-gelu": [torch.nn.functional.gelu(gauss).bfloat16()],
             "real-bf16": [t.cuda() for k, t in saved.items() if k.startswith("bf16/") and t.dtype == torch.bfloat16]}
    del gauss
    out = {"device": torch.cuda.get_device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "reps": args.reps, "rows": []}
    for kind, ts in kinds.items():
        raw = sum(2 * t.numel() for t in ts)
        times = {v: {"enc": [], "dec": []} for v in variants}
        framed = {}
        for rep in range(args.reps + 1):  # the first compiles and checks
            for v, mod in variants.items():
                te, td, framed[v] = code(mod, ts)
                if rep:
                    times[v]["enc"].append(te)
                    times[v]["dec"].append(td)
        row = {"kind": kind, "tensors": len(ts), "raw_bytes": raw}
        for v in variants:
            enc_us, dec_us = statistics.median(times[v]["enc"]), statistics.median(times[v]["dec"])
            row[v] = {"ratio": round(raw / framed[v], 4), "encode_us": round(enc_us, 1), "decode_us": round(dec_us, 1),
                      "encode_GBps": round(raw / enc_us / 1e3, 3), "decode_GBps": round(raw / dec_us / 1e3, 3)}
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
