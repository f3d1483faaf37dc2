"""A neighbour that holds the shared pool, and a training process beside it: what stormd's quota keeps for the second.

    python bench/quota.py --device cuda --model W1 --pool-size 4GiB --quota 2GiB --holder-batch 12 --batch 4 \\
        --out bench/results/quota-<device>-<date>-<commit>.json
    python bench/quota.py --device cpu --model tiny --pool-size 64MiB --quota 32MiB --holder-batch 768 --batch 96

Per setting (no quota, then --quota as stormd's client_quota, the bytes one session may hold): a
fresh stormd with a --pool-size pool; a holder process runs one forward of --model at --holder-batch
through it, offloading (it wants more than the pool), and holds its saves while the trainer, this
process, runs --steps steps of --model at --batch through the same stormd; then the holder's backward
runs and it exits. The trainer's steps run first without offload, from the same parameters and
inputs, so that each offloaded step is checked against them bit for bit.

Per setting the JSON has, for the holder, what it offloaded and what it kept on its device and why;
for the trainer, per step, what it offloaded and kept and why, whether its loss and gradients equal
the step without offload, and on CUDA the most its GPU held above the step's start. Without a quota
the holder takes the pool and the trainer's saves stay on its GPU ("pool full"); with one, the holder
is held to its share ("over quota") and the trainer offloads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import storm
from common import start_daemon, step_digest, stop_daemon, synchronize, workloads, write
from stormd.wire.sizes import parse_size

STORE_REFUSALS = (storm.Keep.POOL_FULL, storm.Keep.QUOTA, storm.Keep.STORE_ERROR)  # what the store said no to


def offload(socket: str) -> storm.Offload:
    return storm.offload(mode="daemon", socket=socket, min_bytes=0)


def refused(stats: storm.OffloadStats) -> dict[str, int]:
    """The saves the store refused, by reason (pool full, over quota)."""
    return {k: v for k, v in stats.kept.items() if k in STORE_REFUSALS}


def holder(a: argparse.Namespace) -> None:
    """One forward through stormd, its saves held until a line on stdin; its figures as a JSON line
    after the forward and after the backward."""
    device = torch.device(a.device)
    (w,) = workloads([a.model], a.holder_batch)
    model, x = w.build(device, seed=1)
    with offload(a.socket) as ctx:
        y = w.forward(model, x)
    ctx.synchronize()  # every put answered: what was refused is counted
    print(json.dumps({"offloaded_bytes": ctx.stats.offloaded_bytes, "refused": refused(ctx.stats)}), flush=True)
    sys.stdin.readline()
    w.objective(y).backward()
    synchronize(device)
    print(json.dumps({"backward": True}), flush=True)


def trainer_steps(w: object, device: torch.device, steps: int, socket: str | None) -> list[dict]:
    """``steps`` SGD steps from the same parameters and inputs: per step a hash of the loss and
    gradients, and with ``socket`` what the offload did (through that stormd)."""
    model, _ = w.build(device, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(w.batch, w.seq, w.d, generator=g).to(device, torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
        if socket is None:
            y = w.forward(model, x)
        else:
            with offload(socket) as ctx:
                y = w.forward(model, x)
        loss = w.objective(y)
        loss.backward()
        synchronize(device)
        row: dict = {"hash": step_digest(loss, model)}
        if socket is not None:
            ctx.synchronize()
            row.update(offloaded_bytes=ctx.stats.offloaded_bytes, refused=refused(ctx.stats))
        if device.type == "cuda":
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - start
        out.append(row)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def setting(a: argparse.Namespace, quota: str | None, reference: list[dict]) -> dict:
    """One stormd (with ``quota`` as its client_quota where given), the holder beside the trainer."""
    device = torch.device(a.device)
    (w,) = workloads([a.model], a.batch)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ("--client-quota", quota) if quota else ()
        proc, socket = start_daemon(Path(tmp), a.pool_size, *flags, log=Path(tmp) / "stormd.log")
        try:
            held = subprocess.Popen([sys.executable, __file__, "--holder", "--socket", socket, "--model", a.model,
                                     "--holder-batch", str(a.holder_batch), "--device", a.device],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                holding = json.loads(held.stdout.readline())
                steps = trainer_steps(w, device, a.steps, socket)
                held.stdin.write("\n")
                held.stdin.flush()
                holding["backward"] = json.loads(held.stdout.readline())["backward"]
            finally:
                held.stdin.close()
                held.wait(60)
            storm.close_all()
        finally:
            stop_daemon(proc)
    for row, ref in zip(steps, reference):
        row["identical"] = row.pop("hash") == ref["hash"]
    return {"quota": quota, "holder": holding, "trainer": steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="W1", help="a bench/common.py workload of Blocks (W1, tiny)")
    p.add_argument("--pool-size", default="4GiB", help="stormd's pool, shared by the holder and the trainer")
    p.add_argument("--quota", default=None, help="stormd's client_quota in the second setting (default: half "
                                                  "the pool)")
    p.add_argument("--holder-batch", type=int, default=12, help="the holder's batch: more saves than the pool")
    p.add_argument("--batch", type=int, default=4, help="the trainer's batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.holder:
        holder(a)
        return 0
    torch.use_deterministic_algorithms(True)
    quota = a.quota or str(parse_size(a.pool_size) // 2)
    (w,) = workloads([a.model], a.batch)
    reference = trainer_steps(w, torch.device(a.device), a.steps, None)
    results = {"model": a.model, "pool_size": a.pool_size, "holder_batch": a.holder_batch, "batch": a.batch,
               "settings": [setting(a, None, reference), setting(a, quota, reference)]}
    for s in results["settings"]:
        h = s["holder"]
        print(f"quota {s['quota'] or 'none'}: holder offloaded {h['offloaded_bytes']} bytes, refused {h['refused']}")
        for i, t in enumerate(s["trainer"]):
            print(f"  trainer step {i}: offloaded {t['offloaded_bytes']} bytes, refused {t['refused']}, "
                  f"identical {t['identical']}" + (f", peak {t['peak_bytes']}" if "peak_bytes" in t else ""))
    if a.out:
        write(a.out, results, a.device)
    ok = all(t["identical"] for s in results["settings"] for t in s["trainer"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
