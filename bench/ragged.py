"""storm.enable(peak=) on batches padded to their longest sequence (a data collator's dynamic
padding), against no offload and Hugging Face's checkpointing on the same batches.

    python bench/ragged.py --cells llama-wide --out bench/results/ragged-h200-<date>-<commit>.json

Zoo cells of causal language models (bench/zoo.py's CELLS: each its batch size, its seq as the
longest a sequence may be).
Each sequence's length is the longest with probability --at-max, else uniform from --shortest up;
each batch is padded to its longest, with its attention mask and labels of -100 on the padding. The
same --steps batches, in the same order, for every method, each from a fresh model: no offload,
checkpointing, and storm.enable(peak=X) at each --caps fraction of the way from checkpointing's
largest peak to no offload's (0: checkpointing's). Per step: its length, time and peak above its
start; per method, the step its plan settled at, how often it traced again, how many steps it read
no phase of (smaller inputs than traced), the largest peak, and the steps' total time after
--settle-by against the same steps of checkpointing's. The rows run one after another, not in
alternation: their times compare within a run only. Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from hf import HF
from zoo import CELLS

import storm
from common import GiB, cuda_device, failure, fresh_dynamo, plan_summary, write


def batches(w: HF, steps: int, at_max: float, shortest: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``w.batch`` sequences, each padded to its longest: (ids, mask) on the host."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = [w.seq if rng.random() < at_max else rng.randrange(shortest, w.seq) for _ in range(w.batch)]
        longest = max(lengths)
        ids = torch.zeros(w.batch, longest, dtype=torch.long)
        mask = torch.zeros(w.batch, longest, dtype=torch.long)
        for i, k in enumerate(lengths):
            ids[i, :k] = torch.randint(1, w.vocab, (k,), generator=g)
            mask[i, :k] = 1
        out.append((ids, mask))
    return out


def measure(w: HF, method: str, opts: dict, data: list, device: torch.device) -> dict:
    """Every batch of ``data`` through ``method``: per step its length, ms and peak above its start."""
    fresh_dynamo([w])
    model, _ = w.build(device, ckpt=method == "checkpoint")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    handle = storm.enable(model, **opts) if method == "enable" else None
    rows, settled_at = [], None
    try:
        for step, (ids, mask) in enumerate(data):
            ids, mask = ids.to(device), mask.to(device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            rows.append({"length": ids.shape[1], "ms": round((time.perf_counter() - t0) * 1e3, 2),
                         "peak_bytes": torch.cuda.max_memory_allocated(device) - base})
            if handle is not None and settled_at is None and handle.planner.settled:
                settled_at = step
        r: dict = {"steps": rows, "peak_GiB": round(max(s["peak_bytes"] for s in rows) / GiB, 3)}
        if handle is not None:
            planner = handle.planner
            # getattr: a planner before 0707e5e, which traced again at every new shape, has no smaller_steps
            r.update(settled_at=settled_at, replans=planner.replans,
                     smaller_steps_unread=getattr(planner, "smaller_steps", None),
                     plan=plan_summary(planner) if planner.plan is not None else None, explain=planner.explain())
        return r
    except Exception as e:  # the row says why (OOM, a method that cannot run here)
        return failure(e)
    finally:
        if handle is not None:
            handle.disable()
        del model, opt
        torch.cuda.empty_cache()


CAUSAL = sorted(name for name, w in CELLS.items() if w.spec.inputs == "causal")  # fed ids, mask and labels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", default=["llama-wide"], choices=CAUSAL)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--settle-by", type=int, default=40, help="steps left out of the time totals")
    ap.add_argument("--at-max", type=float, default=0.03, help="a sequence's chance of the longest length")
    ap.add_argument("--shortest", type=int, default=128)
    ap.add_argument("--caps", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = cuda_device("bench/ragged.py")
    if device is None:
        return 2
    results: dict = {"cells": {}}
    for name in args.cells:
        cell(CELLS[name], args, results, device)
    return 0


def cell(w: HF, args: argparse.Namespace, results: dict, device: torch.device) -> None:
    """One cell's rows into results["cells"][w.name], the JSON written after each."""
    data = batches(w, args.steps, args.at_max, args.shortest, args.seed)
    rows: dict = {}
    results["cells"][w.name] = {"lengths": [ids.shape[1] for ids, _ in data], "rows": rows}

    def row(name: str, method: str, opts: dict) -> dict:
        r = rows[name] = measure(w, method, opts, data, device)
        write(args.out, results, device)
        return r

    none, ckpt = row("none", "none", {}), row("checkpoint", "checkpoint", {})
    if "error" not in none and "error" not in ckpt:
        low, high = (max(s["peak_bytes"] for s in r["steps"]) for r in (ckpt, none))  # not peak_GiB: rounded
        tail = slice(args.settle_by, None)
        for f in args.caps:
            cap = int(low + f * (high - low))
            r = row(f"enable-peak-{f:g}", "enable", {"peak": cap})
            if "error" not in r:
                r.update(cap_GiB=round(cap / GiB, 3),
                         within_cap=max(s["peak_bytes"] for s in r["steps"][tail]) <= cap,
                         time_vs_checkpoint=round(sum(s["ms"] for s in r["steps"][tail])
                                                  / sum(s["ms"] for s in ckpt["steps"][tail]), 3))
                write(args.out, results, device)
    for name, r in rows.items():
        print(w.name, name, {k: v for k, v in r.items() if k not in ("steps", "explain", "plan")}, flush=True)


if __name__ == "__main__":
    sys.exit(main())
