"""What the store's refusals leave on the GPU after a step: W1 through an embedded pool smaller than a step's saves.

    python bench/refused_saves.py --out bench/results/refused-saves-w1.json   # CUDA

W1 with storm.offload (embedded store, --pool-size, by default 1 GiB of a step's 3 GiB of
saves: the rest is refused and stays on the device), the garbage collector off, --steps
steps: after each, once its copies are done and read, the GPU memory allocated beyond the
model, its gradients and optimizer (the no-offload level after a step); then the same after
gc.collect(). Refused saves that outlive their step until the collector runs show up as
the difference.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
from offload import GiB, cuda_device, write  # noqa: E402
from workloads import W1  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--pool-size", default="1GiB")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = cuda_device("refused_saves.py")
    if device is None:
        return 2
    model, x = W1.build(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(offload: bool) -> storm.Offload | None:
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: the level after a step is steady
        ctx = storm.offload(mode="embedded", min_bytes=1 << 20, pool_size=args.pool_size) if offload else None
        with ctx or torch.enable_grad():
            y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()
        if ctx is not None:
            ctx.synchronize()  # every copy done and read: what the session lets go of, it has
        torch.cuda.synchronize(device)
        return ctx

    step(False)
    base = torch.cuda.memory_allocated(device)
    rows = []
    gc.disable()
    try:
        for _ in range(args.steps):
            ctx = step(True)
            st = ctx.stats
            rows.append({"beyond_GiB": round((torch.cuda.memory_allocated(device) - base) / GiB, 3),
                         "refused_tensors": st.kept.get(storm.Keep.POOL_FULL, 0),
                         "kept_GiB": round(st.kept_bytes / GiB, 3),
                         "offloaded_GiB": round(st.offloaded_bytes / GiB, 3)})
            del ctx
            print(rows[-1], flush=True)
        gc.collect()
        after_gc = round((torch.cuda.memory_allocated(device) - base) / GiB, 3)
    finally:
        gc.enable()
    print(f"after gc.collect(): {after_gc} GiB beyond the no-offload level", flush=True)
    write(args, {"workload": "W1", "pool_size": args.pool_size, "steps": rows, "after_gc_GiB": after_gc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
