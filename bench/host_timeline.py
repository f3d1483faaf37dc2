"""Where the host time of one GPU encode or decode goes, on a 256 MiB bf16 tensor.

bench/codec.py times each call from entry to the end of its last kernel. The kernels'
own time is stable from machine to machine; what is left is the host's: the calls it
makes before the first kernel starts, the gaps where the device waits for a launch, and
the tail after the last kernel. This script profiles one call of each path
(huff_exp encode/decode, frames encode/decode) with torch.profiler and prints the
timeline: every host step (the codec's own functions, wrapped in record_function), every
runtime call and every kernel, relative to the call's start. It also times what single host
calls cost on this machine: a Triton launch (through the JIT, through kernels.gpu.launch's
Launcher, and straight to the compiled kernel's launcher), an allocation, a zeroed
allocation, the current stream.

    python bench/host_timeline.py --out bench/results/host-timeline.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm.kernels.frame as frame  # noqa: E402
import storm.kernels.gpu.fields as fields  # noqa: E402
import storm.kernels.gpu.frame as gframe  # noqa: E402
import storm.kernels.gpu.huffman as huffman  # noqa: E402
import storm.kernels.gpu.huffman_code as huffman_code  # noqa: E402
import storm.kernels.huffman as lanes  # noqa: E402
from provenance import commit  # noqa: E402
from storm.kernels import decode, encode  # noqa: E402

# the codec's steps, each shown as a range of its own (not huffman.code_work: a context manager, whose
# work is done inside encode_fields' block)
WRAPPED = ((fields, "sample_histogram"), (huffman_code, "build_code"), (huffman, "encode_lanes"),
           (huffman, "decode_lanes"), (lanes, "device_tables"), (gframe, "frame_encode"), (gframe, "frame_decode"),
           (frame, "layout"), (frame, "_check_frame"))


def wrap() -> None:
    for mod, name in WRAPPED:
        fn = getattr(mod, name)

        def wrapped(*a, _f=fn, _name=f"step:{name}", **k):
            with record_function(_name):
                return _f(*a, **k)
        setattr(mod, name, wrapped)  # the callers look each up at the call


def timeline(fn, reps: int = 3) -> list[dict]:
    """The events of the last of ``reps`` calls of ``fn`` (each followed by a sync), in order."""
    for _ in range(2):
        fn()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            with record_function("call"):
                fn()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    events = [e for e in events if e.get("ph") == "X"]
    call = [e for e in events if e["name"] == "call" and e.get("cat") == "user_annotation"][-1]
    t0, t1 = call["ts"], call["ts"] + call["dur"]
    rows = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e is call or not (t0 <= e["ts"] <= t1) or e.get("cat") in ("python_function",):
            continue
        rows.append({"cat": e.get("cat"), "name": e["name"][:48], "start_us": round(e["ts"] - t0, 1),
                     "dur_us": round(e["dur"], 1)})
    rows.append({"cat": "call", "name": "call", "start_us": 0.0, "dur_us": round(call["dur"], 1)})
    return rows


def host_cost(fn, n: int = 200) -> float:
    """Median host microseconds of one ``fn()`` (batches of n, the device drained between)."""
    per = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / n)
    torch.cuda.synchronize()
    return round(statistics.median(per), 2)


def host_costs() -> dict:
    x = torch.zeros(4096, dtype=torch.int16, device="cuda")
    hist = torch.zeros(256, dtype=torch.int32, device="cuda")
    args = (x, hist, 1, 4096)
    jit = fields._sample_hist.fn  # the kernel under its kernels.gpu.launch.Launcher
    compiled = jit[(1,)](*args, W=2, BLOCK=4096)
    stream = torch.cuda.current_stream().cuda_stream
    costs = {
        "triton_jit_launch": host_cost(lambda: jit[(1,)](*args, W=2, BLOCK=4096)),
        "launcher_launch": host_cost(lambda: fields._sample_hist[(1,)](*args, W=2, BLOCK=4096)),
        "torch_empty_256": host_cost(lambda: torch.empty(256, dtype=torch.int32, device="cuda")),
        "torch_zeros_256": host_cost(lambda: torch.zeros(256, dtype=torch.int32, device="cuda")),
        "tensor_zero_": host_cost(lambda: hist.zero_()),
        "current_stream": host_cost(lambda: torch.cuda.current_stream().cuda_stream),
        "event_record": host_cost(lambda: torch.cuda.Event().record()),
        "empty_like_256MiB": host_cost(lambda: torch.empty(128 << 20, dtype=torch.int16, device="cuda"), 20),
    }
    launcher = fields._sample_hist
    costs["launcher_state"] = {"jit": launcher.jit, "compiled": len(launcher.compiled),
                               "enter_hook": repr(triton.knobs.runtime.launch_enter_hook)}
    try:  # the compiled kernel's own launcher, past the JIT's argument binding and cache lookup
        costs["triton_direct_launch"] = host_cost(lambda: compiled.run(
            1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, 2, 4096))
    except Exception as e:  # the launcher's signature changes between Triton versions
        costs["triton_direct_launch"] = f"{type(e).__name__}: {e}"
    return costs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = 128 << 20
    t = torch.randn(n, device="cuda").bfloat16()
    out = {"device": torch.cuda.get_device_name(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
           "command": " ".join(sys.argv), "torch": torch.__version__, "triton": triton.__version__,
           "host_costs_us": host_costs()}
    print(json.dumps(out["host_costs_us"]), flush=True)
    wrap()
    e = encode(t, "huff_exp")
    f = torch.empty(frame.frame_nbytes(n), dtype=torch.uint8, device="cuda")
    frame.encode_frame(t, f)
    paths = {"huff_exp_encode": lambda: encode(t, "huff_exp"), "huff_exp_decode": lambda: decode(e),
             "frames_encode": lambda: frame.encode_frame(
                 t, torch.empty(frame.frame_nbytes(n), dtype=torch.uint8, device="cuda")),
             "frames_decode": lambda: frame.decode_frame(f, n)}
    out["timelines"] = {}
    for name, fn in paths.items():
        rows = timeline(fn)
        out["timelines"][name] = rows
        print(f"--- {name}")
        for r in rows:
            print(f"{r['start_us']:9.1f} {r['dur_us']:8.1f}  {r['cat']:14s} {r['name']}")
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
