"""storm.enable(model, peak=X) planning the model's layers against planning each layer's parts:
does a finer unit of recompute and offload reach a lower peak, or the same peak faster?

    python bench/granularity.py --out FILE t5-wide bert-wide    # CUDA; zoo cells (bench/zoo.py --list)

Per zoo cell, in one process (common.run: median of 5 steps after 3 and the planner settled):
checkpointing (Hugging Face's, non-reentrant), torch's save_on_cpu (whose peak is the least a
method reaches on the zoo's cells), and ``storm.enable(peak=X)`` at X = save_on_cpu's peak with
the layers find_blocks finds ("layers") and with their parts ("parts": under each layer, the
highest submodules its forward calls, in the order it calls them: T5's self-attention, cross
attention and feed-forward layers, a Llama layer's two norms, attention and MLP), then the parts at
checkpointing's peak. Where a parts plan fits its cap (within 1%), it and checkpointing are
built side by side and timed in alternation (common.alternate, 4 rounds of 3 steps). The JSON
is rewritten after each row. Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any, Iterator

import torch
from torch import nn
from zoo import CELLS

import common
from common import Trainer, alternate, cuda_device, failure, plan_summary, run, write
from storm.blocks import find_blocks


def parts(model: nn.Module, blocks: list[nn.Module], forward: Any) -> list[nn.Module]:
    """Under each of ``blocks``, the highest submodules that ``forward()`` calls (a container that
    is not called itself, such as T5's ``layer`` list, gives its called children), in the order of
    their first call."""
    order: list[nn.Module] = []
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(m))
             for b in blocks for m in b.modules() if m is not b]
    with torch.no_grad():
        forward()
    for h in hooks:
        h.remove()
    called = {id(m) for m in order}

    def cover(m: nn.Module) -> Iterator[nn.Module]:
        for c in m.children():
            yield from [c] if id(c) in called else cover(c)

    units = {id(c) for b in blocks for c in cover(b)}
    return list({id(m): m for m in order if id(m) in units}.values())


class PartsTrainer(Trainer):
    """common.Trainer, where opts' ``blocks="parts"`` plans the model's layers' parts."""

    def __init__(self, w: Any, method: str, opts: dict, device: torch.device):
        if opts.get("blocks") != "parts":
            super().__init__(w, method, opts, device)
            return
        super().__init__(w, "none", {}, device)  # the model, its inputs and optimizer, nothing enabled
        self.method, self.opts = method, opts
        units = parts(self.model, find_blocks(self.model).blocks, lambda: w.forward(self.model, self.x))
        self.handle = common.storm.enable(self.model, **{**opts, "blocks": units})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cells", nargs="+", choices=sorted(CELLS))
    ap.add_argument("--out", required=True, help="results JSON, rewritten after each row")
    args = ap.parse_args()
    device = cuda_device("granularity.py")
    if device is None:
        return 2
    common.Trainer = PartsTrainer  # type: ignore[misc]  # common.run builds its rows' trainers by this name
    results: dict = {"cells": {}}
    for name in args.cells:
        w = CELLS[name]
        rows = results["cells"][name] = {}

        def row(label: str, method: str, opts: dict) -> dict:
            rows[label] = r = run(w, method, 5, 3, opts, device)
            print(name, label, {k: r.get(k) for k in ("step_ms", "peak_bytes", "error")}, flush=True)
            write(args.out, results, device)
            return r

        least = row("save_on_cpu", "save_on_cpu", {}).get("peak_bytes")
        ckpt = row("checkpoint", "checkpoint", {}).get("peak_bytes")
        if least is None or ckpt is None:
            continue
        row("layers@least", "enable", {"peak": least})
        caps = {"parts@least": least, "parts@checkpoint": ckpt}
        for label, cap in caps.items():
            row(label, "enable", {"peak": cap, "blocks": "parts"})
        for label, cap in caps.items():
            if "step_ms" not in rows[label] or rows[label]["peak_bytes"] > 1.01 * cap:
                continue
            trainers: list[Trainer] = []
            try:
                trainers = [PartsTrainer(w, "enable", {"peak": cap, "blocks": "parts"}, device),
                            PartsTrainer(w, "checkpoint", {}, device)]
                for t in trainers:
                    t.warm(3)
                times = alternate(trainers, 4, 3, random.Random(0))
                ms = [statistics.median(s for r in rs for s in r) * 1e3 for rs in times]
                assert trainers[0].planner is not None
                rows["duel " + label] = {"ms": ms, "x_checkpoint": ms[0] / ms[1],
                                         "plan": plan_summary(trainers[0].planner)}
            except Exception as e:  # out of memory: the duel says so and the run goes on
                rows["duel " + label] = failure(e)
            finally:
                for t in trainers:
                    t.close()
            write(args.out, results, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
