"""One rank of tests/test_distributed_nodes.py, launched by torchrun on one of two simulated nodes.

DDP over gloo: STEPS training steps without STORM, then the same steps from the same state with
storm.offload(mode="daemon") and no socket given, so the rank finds its node's stormd the way it
would on a real node (here: $STORMD_SOCKET, which the test sets per node). Writes
rank<RANK>.json in the directory given: whether every loss and gradient was bit-identical, how
many tensors went to the store, and which daemon served the rank.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import storm
from storm.examples.models import GPT, same_bits

STEPS = 3


def train(base: torch.nn.Module, offload: bool, rank: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], dict]:
    model = copy.deepcopy(base)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches, the same in both runs
    losses, grads, seen = [], [], {"offloaded": 0, "backend": None}
    for step in range(STEPS):
        idx = torch.randint(0, 256, (4, 33), generator=data)
        torch.manual_seed(1000 * step + rank)  # the same dropout masks in both runs
        with (storm.offload(mode="daemon", min_bytes=0) if offload else contextlib.nullcontext()) as ctx:
            logits = ddp(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))
        loss.backward()  # DDP all-reduces the gradients across the two nodes
        if ctx is not None:
            seen["offloaded"] += ctx.stats.offloaded
            seen["backend"] = ctx.backend_name
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, seen


def main(out: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        base = GPT(seq_len=32, d_model=64, n_heads=2, n_layers=2, dropout=0.1)
        losses, grads, _ = train(base, offload=False, rank=rank)
        losses_storm, grads_storm, seen = train(base, offload=True, rank=rank)
        same_losses = all(same_bits(a, b) for a, b in zip(losses, losses_storm))
        same_grads = all(same_bits(a, b) for g, h in zip(grads, grads_storm) for a, b in zip(g, h))
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "node": int(os.environ["GROUP_RANK"]), "same_losses": same_losses,
            "same_gradients": same_grads, "socket": os.environ.get("STORMD_SOCKET"), **seen}))
    finally:
        storm.close_all()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
