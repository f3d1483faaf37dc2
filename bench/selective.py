"""What selective recompute by an op-by-op policy would free of each zoo architecture's blocks, and
what it costs: whether such a policy could be the planner's per-block selective-recompute action
(docs/planner.md, "Next: selective recompute").

    python bench/selective.py --out bench/results/selective.json                        # CUDA: bytes and times
    python bench/selective.py --device cpu --layers 2 --batch 1 --seq 256 --out X.json  # bytes only
    python bench/selective.py --tiny --device cpu --out X.json                          # every architecture, tiny

Per zoo cell (bench/zoo.py; at --layers, --batch and --seq where given), one step each way from the
same weights and tokens:

- "kept": the blocks as they are; what they save for backward (parameters left out: they stay
  anyway), summed over blocks;
- "selective": each block under torch.utils.checkpoint (non-reentrant) with a selective-checkpoint
  policy that saves the outputs of matrix products and attention and recomputes every other op in
  backward (norms, activations, rotary embeddings, residual adds): what the blocks save is their
  inputs and those outputs. The step's loss and gradients against the kept step's, bit for bit;
- "whole": what checkpointing each block whole keeps, its inputs.

On CUDA each way also trains --steps timed steps after --warmup (common.run: the median step with
its SGD step, the peak above the step's start; "whole" through transformers' own checkpointing);
on the CPU times are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from typing import Any, Callable

import torch
from hf import HF, tiny
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from zoo import CELLS

from common import run, step_digest, write

# the ops whose outputs the policy saves: matrix products and attention, whose recompute costs
# what their forward did; every other op is recomputed (those that exist in this torch)
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, name))


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under the policy (torch's non-reentrant checkpoint, keyword arguments too)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy), **kwargs)
    return run


class PolicySaves(TorchDispatchMode):
    """The storages of the policy's saved ops' outputs in forward: what it keeps for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.bytes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return out


class BlockSaves:
    """What autograd saves within the blocks' forwards (parameters left out), by storage: while a
    block runs forward, a saved-tensor hook notes each save. Under the policy that is what torch's
    checkpoint saves itself, the block's inputs."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes: dict[int, int] = {}
        self._open: list[Any] = []
        self._handles = [h for b in blocks for h in (b.register_forward_pre_hook(self._enter),
                                                     b.register_forward_hook(self._leave))]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.bytes[s.data_ptr()] = s.nbytes()
        return t

    def _enter(self, *_: Any) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        ctx.__enter__()
        self._open.append(ctx)

    def _leave(self, *_: Any) -> None:
        self._open.pop().__exit__(None, None, None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@dataclasses.dataclass(frozen=True)
class Selective(HF):
    """A zoo workload whose blocks each run under the policy."""

    @classmethod
    def of(cls, w: HF) -> "Selective":
        return cls(**{f.name: getattr(w, f.name) for f in dataclasses.fields(w)})

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        model, ids = super().build(device, ckpt=ckpt, seed=seed)
        for b in self.blocks(model):
            b.forward = selective(b.forward)
        return model, ids


def one_step(w: HF, device: torch.device, how: str) -> tuple[str, dict[str, int]]:
    """One step of ``w`` kept or selective, from its seed: the step's digest and what its blocks saved."""
    model, ids = (Selective.of(w) if how == "selective" else w).build(device)
    blocks = w.blocks(model)
    counted, policy_saves = BlockSaves(model, blocks), PolicySaves()
    torch.manual_seed(1)  # dropout's masks: both ways draw the same
    with policy_saves if how == "selective" else contextlib.nullcontext():
        loss = w.objective(w.forward(model, ids))
    counted.close()
    loss.backward()
    own = sum(policy_saves.bytes.values())
    return step_digest(loss, model), {"saved_bytes": sum(counted.bytes.values()) + own, "policy_bytes": own}


def measure(w: HF, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    kept_digest, kept = one_step(w, device, "kept")
    sel_digest, sel = one_step(w, device, "selective")
    inputs = sel["saved_bytes"] - sel["policy_bytes"]
    out: dict[str, Any] = {
        "kept_MiB": round(kept["saved_bytes"] / 2**20, 2),
        "selective_MiB": round(sel["saved_bytes"] / 2**20, 2),
        "whole_MiB": round(inputs / 2**20, 2),
        "selective_frees": round(1 - sel["saved_bytes"] / kept["saved_bytes"], 3),
        "whole_frees": round(1 - inputs / kept["saved_bytes"], 3),
        "bit_exact": kept_digest == sel_digest,
    }
    if device.type == "cuda":  # common.run: the median step and its peak above the start
        out.update(kept=run(w, "none", steps, warmup, {}, device),
                   selective=run(Selective.of(w), "none", steps, warmup, {}, device),
                   whole=run(w, "checkpoint", steps, warmup, {}, device))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=[c for c in CELLS if c.endswith("-wide")], choices=list(CELLS),
                   metavar="CELL", help="zoo cells (default: the wide ones)")
    p.add_argument("--tiny", action="store_true", help="each cell's architecture at hf.tiny's size (float32)")
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/selective.py: no CUDA device; --device cpu measures the bytes alone")
        return 2
    sizes = {k: v for k, v in (("layers", args.layers), ("batch", args.batch), ("seq", args.seq)) if v}
    results: dict[str, Any] = {"cells": {}}
    for name in args.cells:
        w = tiny(CELLS[name].arch, **sizes) if args.tiny else dataclasses.replace(CELLS[name], **sizes)
        results["cells"][name] = r = measure(w, device, args.steps, args.warmup)
        write(args.out, results, device)
        print(f"{name:15} kept {r['kept_MiB']:9.1f} MiB  selective {r['selective_MiB']:9.1f} "
              f"({r['selective_frees']:.0%} freed)  whole {r['whole_MiB']:8.1f} ({r['whole_frees']:.0%})  "
              f"bit-exact {r['bit_exact']}" + "".join(f"  {h} {r[h].get('step_ms')} ms {r[h].get('peak_extra_GiB')} GiB"
                                                      for h in ("kept", "selective", "whole") if h in r),
              flush=True)
    return 0 if all(r["bit_exact"] for r in results["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
