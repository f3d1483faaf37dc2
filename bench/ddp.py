"""DDP (or FSDP2) ranks of one node sharing one stormd: identical losses and gradients, and throughput per rank.

    python bench/ddp.py --nproc 2 --out bench/results/ddp-DATE.json        # 2 GPUs (one per rank)
    python bench/ddp.py --nproc 2 --wrapper fsdp2 --out bench/results/fsdp2-DATE.json
    python bench/ddp.py --nproc 2 --tiny --device cpu --out /tmp/ddp.json   # gloo on CPU, a smoke run

Starts one stormd, then runs torchrun twice: with one rank and with --nproc ranks. Each rank
trains W1 (bench/common.py, --batch per rank) for --steps steps without offload, then the
same steps from the same initial state under storm.offload(mode="daemon") through that one
daemon. Every step's loss and a hash of every gradient (after DDP's all-reduce) must be
bit-identical between the two (FSDP2: this rank's shards of the gradients); the JSON has both
step times per rank (median after --warmup), per-rank throughput with --nproc ranks against the
single-rank run, and offload's cost (step time with offload over step time without) against the
single rank's, which leaves out what DDP itself costs each rank. Each rank also measures
its pinned link (GB/s each way) alone, ranks taking turns, and with every rank copying at once:
full offload is link-bound, so what the ranks' links lose together bounds what offload can keep.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initialises CUDA

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import storm  # noqa: E402
from common import TINY, W1, Workload, start_daemon, write  # noqa: E402


def wrap(model: torch.nn.Module, wrapper: str, device: torch.device) -> torch.nn.Module:
    """DDP around the model, or FSDP2: each block sharded, then the rest (torch.distributed.fsdp.fully_shard)."""
    if wrapper == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def train(w: Workload, device: torch.device, steps: int, offload: dict | None,
          wrapper: str = "ddp") -> tuple[list[str], list[float], int]:
    """Per step: a hash of the loss and all gradients as the optimizer sees them, and the step time;
    and how many tensors were offloaded in all."""
    model, _ = w.build(device)
    ddp = wrap(model, wrapper, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    rank = dist.get_rank()
    hashes, times, offloaded = [], [], 0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(w.batch, w.seq, w.d, generator=g).to(device, model.blocks[0].ln1.weight.dtype)
        start_together(device)
        t0 = time.perf_counter()
        if offload is None:
            y = ddp(x)
        else:
            with storm.offload(**offload) as ctx:
                y = ddp(x)
            offloaded += ctx.stats.offloaded
        loss = y.float().pow(2).mean()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        h = xxhash.xxh3_64()
        for t in [loss.detach(), *(p.grad for p in model.parameters())]:
            t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
            h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
        hashes.append(h.hexdigest())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return hashes, times, offloaded


def start_together(device: torch.device) -> None:
    """Every rank starts the step at once. Hashing last step's gradients (outside the timer) takes
    ranks different times; without this, the first rank to finish waits for the others in DDP's
    all-reduce inside its timed step, and the skew counts as step time."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_alone_and_together(device: torch.device) -> dict[str, list[float]]:
    """This rank's pinned GB/s (to host, to device): alone (ranks take turns), then all at once."""
    alone = None
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            alone = storm.planner.link_bandwidth(device)
    dist.barrier()
    together = storm.planner.link_bandwidth(device)
    return {"link_alone_GBps": [round(v, 1) for v in alone], "link_together_GBps": [round(v, 1) for v in together]}


def worker(a: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True)
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    w = TINY if a.tiny else dataclasses.replace(W1, batch=a.batch)
    link = link_alone_and_together(device)
    plain, t_plain, _ = train(w, device, a.steps, None, a.wrapper)
    opts = {"mode": a.mode, "min_bytes": 0 if a.tiny else 1 << 20, "budget": budget(a.budget)} \
        | ({"socket": a.socket} if a.mode == "daemon" else {"pool_size": a.pool_size})
    offloaded, t_off, tensors = train(w, device, a.steps, opts, a.wrapper)
    med = lambda ts: round(statistics.median(ts[a.warmup:]) * 1e3, 2)  # noqa: E731
    row = {"rank": rank, "steps": a.steps, "identical_steps": sum(p == o for p, o in zip(plain, offloaded)),
           "offloaded_tensors_per_step": tensors / a.steps,
           "step_ms_no_offload": med(t_plain), "step_ms_offload": med(t_off),
           "offload_cost": round(med(t_off) / med(t_plain), 3),
           "samples_per_s_offload": round(w.batch / (med(t_off) / 1e3), 2), **link}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(a.result).write_text(json.dumps({"workload": dataclasses.asdict(w), "ranks": rows}))
    dist.destroy_process_group()


def budget(text: str | None) -> str | float | None:
    """--budget: a fraction (0.25) or bytes (2GiB), as storm.offload takes it."""
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def launch(a: argparse.Namespace, nproc: int, endpoint: str, tmp: str) -> dict:
    result = Path(tmp) / f"ranks-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           "--worker", "--socket", endpoint, "--result", str(result), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--batch", str(a.batch), "--device", a.device, "--wrapper", a.wrapper,
           "--mode", a.mode, "--pool-size", a.pool_size] \
        + (["--tiny"] if a.tiny else []) \
        + (["--budget", a.budget] if a.budget is not None else [])
    subprocess.run(cmd, check=True)
    return json.loads(result.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="W1's batch per rank")
    p.add_argument("--pool-size", default="8GiB", help="every rank page-locks all of it: about 1 s per GiB "
                   "(the daemon's pool; with --mode embedded, each rank's)")
    p.add_argument("--mode", choices=["daemon", "embedded"], default="daemon",
                   help="ranks share one stormd, or each offloads to its own embedded store")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of W1 (smoke runs on CPU)")
    p.add_argument("--wrapper", choices=["ddp", "fsdp2"], default="ddp",
                   help="DistributedDataParallel, or FSDP2 (fully_shard per block, then the model)")
    p.add_argument("--budget", default=None, help="storm.offload(budget=...): a fraction (0.25) or bytes (2GiB); "
                   "default: offload all")
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        daemon, endpoint = start_daemon(Path(tmp), a.pool_size) if a.mode == "daemon" else (None, "")
        try:
            single, multi = launch(a, 1, endpoint, tmp), launch(a, a.nproc, endpoint, tmp)
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(30)
    base, cost = single["ranks"][0]["samples_per_s_offload"], single["ranks"][0]["offload_cost"]
    for r in multi["ranks"]:
        r["throughput_vs_single_rank"] = round(r["samples_per_s_offload"] / base, 3)
        # DDP alone already slows each rank (gradient all-reduce, a shared host): what
        # offload adds on top of that, against what it adds to one rank
        r["offload_cost_vs_single_rank"] = round(r["offload_cost"] / cost, 3)
    results = {"wrapper": a.wrapper, "mode": a.mode, "single_rank": single, f"{a.nproc}_ranks": multi,
               # without peer access NCCL's all-reduce goes through host memory, over the links offload uses
               "peer_access": a.device == "cuda" and torch.cuda.device_count() > 1
               and torch.cuda.can_device_access_peer(0, 1)}
    ok = all(r["identical_steps"] == r["steps"] and r["offloaded_tensors_per_step"] > 0
             for run in (single, multi) for r in run["ranks"])
    print(json.dumps(results, indent=1))
    if a.out:
        write(a.out, results, a.device)
    print("OK" if ok else "FAILED: a step differed with offload")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
