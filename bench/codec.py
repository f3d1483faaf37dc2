"""Codec benchmark: ratio and encode/decode throughput per codec and tensor kind.

Side by side in one run: every storm.kernels codec, frames (storm.kernels.frame:
codec b at a fixed size, as CUDA tensors are stored; bf16 only), nvCOMP (ANS, Bitcomp,
Cascaded, GDeflate; PyPI nvidia-nvcomp-cu13) on the same device tensors, and CPU
zstd (PyPI zstandard) on the same bytes, plain and byte-plane shuffled. Also the
associative scan against a device copy and torch.cumsum.

Throughput is uncompressed bytes per second, two ways after a warm-up: the median
of --reps calls each timed alone (the device synchronized before and after), and
--reps calls queued back to back (synchronized once), as the store queues a step's
tensors. storm encode times include the host waits the codec needs to size its
outputs (frames have none); ratios count the full serialized size (header
included). Every decode is checked bit for bit.

Tensor kinds: synthetic bf16/fp32 activations of --size-mib MiB, a dropout mask,
a ternary tensor, and "real-*": the saved tensors of the MiniLM fixture
(tests/fixtures/activations), each encoded on its own at its real (cropped)
size and the results byte-weighted over them, as the store would see them.

    python bench/codec.py --device cuda --out bench/results/codec_h100.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, NamedTuple

import torch

from common import REPO, write
from storm.kernels import CODECS, CodecNotApplicable, associative_scan, decode, encode, frame, verify_lossless
from storm.kernels.frame import complete, decode_frame, encode_frame, frame_nbytes

FIXTURE = REPO / "tests" / "fixtures" / "activations" / "minilm_saved.pt"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timing(NamedTuple):
    call: float    # median seconds of one call, the device synchronized before and after it
    stream: float  # seconds a call, --reps calls queued back to back and synchronized once


def timed(fn: Callable[[], object], dev: torch.device, reps: int) -> tuple[Timing, object]:
    """``fn`` timed both ways, after a warm-up call. One call at a time pays the host's launch
    latency and the wait for the device every call; back to back, as the store queues the
    tensors of a step, the host's work overlaps the device's and what is left is the device's
    time and whatever the call makes the host wait for (an output size)."""
    out = fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(dev)
    return Timing(statistics.median(ts), (time.perf_counter() - t0) / reps), out


def tensor_kinds(size: int, dev: torch.device) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device=dev).manual_seed(0)
    n16, n32 = size // 2, size // 4
    gauss = torch.randn(n16, generator=g, device=dev)
    kinds = {
        "bf16-gauss": gauss.bfloat16(),
        "bf16-gelu": torch.nn.functional.gelu(gauss).bfloat16(),
        "bf16-relu": torch.relu(gauss).bfloat16(),
        "fp32-gauss": torch.randn(n32, generator=g, device=dev),
        "bool-dropout-mask": torch.rand(size, generator=g, device=dev) > 0.1,
        "int8-ternary": torch.randint(-1, 2, (size,), generator=g, device=dev, dtype=torch.int8),
    }
    del gauss
    kinds = {k: [v] for k, v in kinds.items()}
    saved = torch.load(FIXTURE, weights_only=True)["tensors"]
    step = [t for k, t in saved.items() if k.startswith("bf16/")]
    # the real saved tensors one by one at their real (cropped) size, results byte-weighted
    # over them: a codec sees each tensor as the store would hand it over
    kinds["real-bf16-autocast-step"] = [t.to(dev) for t in step]
    kinds["real-bf16-autocast-step-bf16-only"] = [t.to(dev) for t in step if t.dtype == torch.bfloat16]
    kinds["real-fp32-step"] = [t.to(dev) for k, t in saved.items() if k.startswith("fp32/")]
    return kinds


def aggregate(parts: list[dict]) -> dict:
    """Byte-weighted over tensors: total raw over total encoded bytes; GB/s over the tensors
    the codec applied to (the others count as stored raw in the ratio)."""
    raw = sum(p["raw"] for p in parts)
    timed_parts = [p for p in parts if p["te"] is not None]
    traw = sum(p["raw"] for p in timed_parts)
    out = {"tensors": len(parts), "ratio": round(raw / sum(p["enc_bytes"] for p in parts), 4)}
    for key, field in (("enc_GBps", "te"), ("dec_GBps", "td")):
        for suffix, how in (("", "call"), ("_back_to_back", "stream")):
            seconds = sum(getattr(p[field], how) for p in timed_parts)
            out[key + suffix] = round(traw / seconds / 1e9, 3) if seconds else None
    out["lossless"] = all(p["ok"] for p in parts)
    if traw != raw:
        out["not_applicable_bytes"] = raw - traw
    return out


def bench_storm(ts: list[torch.Tensor], codec: str, reps: int) -> dict:
    parts, used, escapes, elems = [], {}, 0, 0
    for t in ts:
        nb = t.numel() * t.element_size()
        try:
            te, enc = timed(lambda: encode(t, codec), t.device, reps)
        except CodecNotApplicable as e:
            if len(ts) == 1:
                return {"skipped": str(e)}
            parts.append({"raw": nb, "enc_bytes": encode(t, "raw").nbytes, "te": None, "td": None, "ok": True})
            continue
        td, out = timed(lambda: decode(enc), t.device, reps)
        parts.append({"raw": nb, "enc_bytes": enc.nbytes, "te": te, "td": td, "ok": verify_lossless(t, out)})
        used[enc.codec] = used.get(enc.codec, 0) + nb
        escapes += enc.escapes
        elems += enc.numel
    return {**aggregate(parts), "codec_bytes": used, "escape_rate": round(escapes / max(1, elems), 5)}


def bench_frame(ts: list[torch.Tensor], reps: int, small_tiles: int | None = None) -> dict:
    """Frames of the bf16 tensors (the others count as raw); a frame that overflows would be
    stored raw by the mover, so it counts as raw too. Each call allocates its output, as the
    mover's does. ``small_tiles``: storm.kernels.frame.SMALL_TILES for this run."""
    used = frame.SMALL_TILES if small_tiles is None else small_tiles
    kept, frame.SMALL_TILES = frame.SMALL_TILES, used
    try:
        parts, overflows = [], 0
        for t in ts:
            n, nb = t.numel(), t.numel() * t.element_size()
            if t.dtype != torch.bfloat16:
                parts.append({"raw": nb, "enc_bytes": nb, "te": None, "td": None, "ok": True})
                continue

            def encoded() -> torch.Tensor:
                f = torch.empty(frame_nbytes(n), dtype=torch.uint8, device=t.device)
                encode_frame(t, f)
                return f

            te, f = timed(encoded, t.device, reps)
            if not complete(f[:16].cpu()):
                overflows += 1
                parts.append({"raw": nb, "enc_bytes": nb, "te": te, "td": Timing(0.0, 0.0), "ok": True})
                continue
            td, out = timed(lambda: decode_frame(f, n), t.device, reps)
            parts.append({"raw": nb, "enc_bytes": f.numel(), "te": te, "td": td,
                          "ok": verify_lossless(t.reshape(-1).view(torch.int16), out)})
    finally:
        frame.SMALL_TILES = kept
    if all(p["te"] is None for p in parts):
        return {"skipped": "frames are for bf16 tensors"}
    return {**aggregate(parts), "overflows": overflows, "small_tiles": used}


def bench_nvcomp(ts: list[torch.Tensor], algo: str, reps: int) -> dict:
    import cupy as cp
    from nvidia import nvcomp

    codec = nvcomp.Codec(algorithm=algo)
    parts = []
    for t in ts:
        src = cp.asarray(t.reshape(-1).contiguous().view(torch.uint8))
        arr = nvcomp.as_array(src)
        te, comp = timed(lambda: codec.encode(arr), t.device, reps)
        td, dec = timed(lambda: codec.decode(comp), t.device, reps)
        parts.append({"raw": src.nbytes, "enc_bytes": cp.asarray(comp).nbytes, "te": te, "td": td,
                      "ok": bool(cp.array_equal(cp.asarray(dec).view(cp.uint8), src))})
    return aggregate(parts)


def bench_zstd(ts: list[torch.Tensor], level: int, shuffle: bool, reps: int) -> dict:
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    cpu = torch.device("cpu")
    parts = []
    for t in ts:
        b = t.reshape(-1).contiguous().view(torch.uint8).cpu()
        if shuffle:  # byte planes: all first bytes, then all second bytes, ...
            b = b.view(-1, t.element_size()).t().contiguous().reshape(-1)
        data = b.numpy().tobytes()
        te, comp = timed(lambda: cctx.compress(data), cpu, reps)
        td, dec = timed(lambda: dctx.decompress(comp), cpu, reps)
        parts.append({"raw": len(data), "enc_bytes": len(comp), "te": te, "td": td, "ok": dec == data})
    return aggregate(parts)


def bench_scan(size: int, dev: torch.device, reps: int) -> list[dict]:
    """Each row: a --size-mib input scanned as torch.cumsum would (int32 -> int64), int32 ->
    int32 (dtype=torch.int32) and float32, against a copy of the input (read + write)."""
    rows = []
    for dtype, out_dtype in ((torch.int32, None), (torch.int32, torch.int32), (torch.float32, None)):
        n = size // 4
        x = torch.randint(-50, 50, (n,), device=dev, dtype=torch.int32).to(dtype)
        tc = timed(lambda: x.clone(), dev, reps)[0].call
        (ts, _), y = timed(lambda: associative_scan(x, 0, dtype=out_dtype), dev, reps)
        (tr, _), ref = timed(lambda: torch.cumsum(x, 0, dtype=out_dtype), dev, reps)
        moved = n * x.element_size() + y.numel() * y.element_size()  # read input + write output
        copy_bw = 2 * n * x.element_size() / tc
        row = {"dtype": str(dtype).replace("torch.", ""), "out_dtype": str(y.dtype).replace("torch.", ""),
               "nbytes_in": n * x.element_size(),
               "scan_GBps": round(moved / ts / 1e9, 1), "cumsum_GBps": round(moved / tr / 1e9, 1),
               "copy_GBps": round(copy_bw / 1e9, 1), "fraction_of_copy": round(moved / ts / copy_bw, 3)}
        if dtype == torch.int32:
            row["identical_to_cumsum"] = bool(torch.equal(y, ref))
        else:
            err = (y.double() - torch.cumsum(x.double(), 0)).abs()
            bound = (torch.arange(1, n + 1, device=dev, dtype=torch.float64) * 2.0**-24
                     * torch.cumsum(x.double().abs(), 0))
            row["within_bound"] = bool((err <= bound).all())
        rows.append(row)
    return rows


def profile(kind: str, ts: list[torch.Tensor], reps: int) -> None:
    """Where the time of each codec goes (torch.profiler, device kernels and host), plus
    sweeps of the block-size knobs of the Triton kernels; printed, not written to JSON."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    import storm.kernels.gpu.ancf_exp as gancf

    t = ts[0]
    for codec in ("ancf_exp", "huff_exp", "zero", "pack", "auto"):
        try:
            enc = encode(t, codec)
        except CodecNotApplicable:
            continue
        decode(enc)
        sync(t.device)
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            enc = encode(t, codec)
            decode(enc)
            sync(t.device)
        print(f"== {kind} {codec}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    nb = t.numel() * t.element_size()
    for groups, warps in ((1024, 4), (1024, 8), (512, 4), (256, 4), (2048, 8)):
        gancf.GROUPS, gancf.BLOCK, gancf.WARPS = groups, 4 * groups, warps
        (te, _), enc = timed(lambda: encode(t, "ancf_exp"), t.device, reps)
        (td, _), _ = timed(lambda: decode(enc), t.device, reps)
        print(f"ancf_exp groups={groups} warps={warps}: enc {nb / te / 1e9:.0f} GB/s dec {nb / td / 1e9:.0f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", default="", help="comma-separated subset of tensor kinds")
    ap.add_argument("--skip", default="", help="comma-separated: nvcomp, zstd, scan, ancf")
    ap.add_argument("--only", default="", help="comma-separated implementations to run (e.g. "
                    "storm:ancf_exp_frame,nvcomp:ANS); default: all")
    ap.add_argument("--frame-small-tiles", default="",
                    help="comma-separated values of storm.kernels.frame.SMALL_TILES, a frames row each")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default="", help="profile the codecs on this tensor kind and sweep kernel knobs")
    args = ap.parse_args()
    dev = torch.device(args.device)
    size = args.size_mib << 20
    skip = set(filter(None, args.skip.split(",")))
    res = {"size_bytes": size, "reps": args.reps, "rows": [], "scan": []}
    kinds = tensor_kinds(size, dev)
    if args.profile:
        profile(args.profile, kinds[args.profile], args.reps)
        return
    if args.kinds:
        kinds = {k: v for k, v in kinds.items() if k in args.kinds.split(",")}
    impls: list[tuple[str, Callable[[list[torch.Tensor]], dict]]] = [
        (f"storm:{c}", lambda t, c=c: bench_storm(t, c, args.reps)) for c in list(CODECS) + ["auto"]
        if not (c == "ancf" and "ancf" in skip)]
    impls.append(("storm:ancf_exp_frame", lambda t: bench_frame(t, args.reps)))
    impls += [(f"storm:ancf_exp_frame:small_tiles={k}", lambda t, k=k: bench_frame(t, args.reps, k))
              for k in map(int, filter(None, args.frame_small_tiles.split(",")))]
    if dev.type == "cuda" and "nvcomp" not in skip:
        impls += [(f"nvcomp:{a}", lambda t, a=a: bench_nvcomp(t, a, args.reps))
                  for a in ("ANS", "Bitcomp", "Cascaded", "GDeflate")]
    if "zstd" not in skip:
        impls += [(f"zstd-cpu:1{'-shuffled' if s else ''}", lambda t, s=s: bench_zstd(t, 1, s, min(args.reps, 2)))
                  for s in (False, True)]
    if args.only:
        only = args.only.split(",")
        unknown = set(only) - {name for name, _ in impls}
        if unknown:
            ap.error(f"--only: unknown {', '.join(sorted(unknown))}; known: {', '.join(name for name, _ in impls)}")
        impls = [(name, fn) for name, fn in impls if name in only]
    for kind, ts in kinds.items():
        for name, fn in impls:
            try:
                row = fn(ts)
            except Exception as e:  # a missing package or an unsupported input is a result too
                row = {"error": repr(e)[:300]}
            row = {"kind": kind, "dtype": ",".join(sorted({str(t.dtype).replace("torch.", "") for t in ts})),
                   "nbytes": sum(t.numel() * t.element_size() for t in ts), "impl": name, **row}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    if "scan" not in skip:
        res["scan"] = bench_scan(size, dev, args.reps)
        for r in res["scan"]:
            print(json.dumps(r), flush=True)
    if args.out:
        write(args.out, res, dev, cpu_threads=torch.get_num_threads())
    print(f"\n{'kind':32s} {'impl':24s} {'ratio':>7s} {'enc GB/s':>9s} {'dec GB/s':>9s}   back to back: enc, dec")
    for r in res["rows"]:
        if "ratio" in r:
            print(f"{r['kind']:32s} {r['impl']:24s} {r['ratio']:7.3f} "
                  f"{r['enc_GBps'] or 0:9.2f} {r['dec_GBps'] or 0:9.2f}"
                  f"   {r['enc_GBps_back_to_back'] or 0:9.2f} {r['dec_GBps_back_to_back'] or 0:9.2f}"
                  f"{'' if r.get('lossless') else '  NOT LOSSLESS'}")


if __name__ == "__main__":
    main()
