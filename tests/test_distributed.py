"""storm.offload under torch.distributed's wrappers, on CPU with gloo: two ranks of DDP, and of
FSDP2 (``fully_shard``), each without offload, through its own embedded store and through one
stormd that both ranks share, must end with bit-identical gradients (after DDP's all-reduce;
FSDP2's sharded gradients compared shard by shard)."""

from __future__ import annotations

import copy
import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import storm
from storm.examples.models import GPT, same_bits

WORLD = 2
fsdp = pytest.importorskip("torch.distributed.fsdp")


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """What this rank's optimizer would see: DDP's all-reduced gradients, or FSDP2's local shards."""
    return [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters())]


def _rank(rank: int, wrapper: str, init_file: str, socket: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine
    # a collective that never completes raises here, within the parent's deadline, instead of after gloo's 30 min
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=180))
    try:
        torch.manual_seed(0)
        base = GPT(seq_len=32, d_model=64, n_heads=2, n_layers=2, dropout=0.1)
        idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(rank))
        runs: dict[str, dict | None] = {"none": None, "embedded": {"mode": "embedded", "min_bytes": 0},
                                        "daemon": {"mode": "daemon", "socket": socket, "min_bytes": 0}}
        grads, offloaded = {}, {}
        for name, opts in runs.items():
            model = copy.deepcopy(base)
            if wrapper == "ddp":
                wrapped = DistributedDataParallel(model)
            else:
                for block in model.blocks:
                    fsdp.fully_shard(block)
                wrapped = fsdp.fully_shard(model)
            torch.manual_seed(100 + rank)  # the same dropout masks in every run
            if opts is None:
                logits = wrapped(idx[:, :-1])
            else:
                with storm.offload(**opts) as ctx:
                    logits = wrapped(idx[:, :-1])
                offloaded[name] = ctx.stats.offloaded
            F.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1)).backward()
            grads[name] = [g.clone() for g in _gradients(model)]
        same = {name: all(same_bits(a, b) for a, b in zip(grads["none"], grads[name])) for name in offloaded}
        sharded = any(hasattr(p.grad, "to_local") for p in model.parameters())
        Path(out, f"rank{rank}.json").write_text(json.dumps({"same": same, "offloaded": offloaded, "sharded": sharded}))
    finally:
        storm.close_all()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_ranks_sharing_a_daemon_are_bit_exact(wrapper, daemon, tmp_path):
    if wrapper == "fsdp2" and not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    ranks = mp.spawn(_rank, args=(wrapper, str(tmp_path / "init"), daemon.endpoint, str(tmp_path)), nprocs=WORLD,
                     join=False)
    deadline = time.monotonic() + 600  # two torch processes on a loaded machine
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"the {wrapper} ranks were still running after 600 s")
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["same"] == {"embedded": True, "daemon": True}, (rank, r)
        assert min(r["offloaded"].values()) > 0, (rank, r)
        assert r["sharded"] == (wrapper == "fsdp2"), (rank, r)
