"""storm.enable across a zoo of Hugging Face architectures: per cell (an architecture at a shape),
the methods users pick and STORM's one-line API at every memory cap they span.

    python bench/zoo.py --list                                                      # the cells
    python bench/zoo.py --out bench/results/zoo-h100-<date>-<commit>.json --resume  # CUDA: every cell
    python bench/zoo.py --cells mistral-wide gemma2-long --out ... --resume         # CUDA: these cells
    python bench/zoo.py --quick --cells llama-wide --out /tmp/zoo.json              # smoke run
    python bench/zoo.py --summary bench/results/zoo-....json [--markdown]           # any machine
    python bench/zoo.py --merge GPU0.json GPU1.json --out RUN.json                  # any machine

On a machine of several GPUs, a process per GPU measures its own cells into its own file
(``CUDA_VISIBLE_DEVICES=0 python bench/zoo.py --cells A B --out GPU0.json --resume &
CUDA_VISIBLE_DEVICES=1 python bench/zoo.py --cells C D --out GPU1.json --resume; wait``: each GPU
its own link), and --merge makes them one run's file: it refuses cells measured at two commits
or on two kinds of device, and a cell found in two files.

A cell is one architecture of bench/hf.py (random weights from a config, bf16, random tokens)
at one of two shapes: "wide", a large batch of short sequences, and "long", one or two long
sequences. Per cell, in one process, with common.run (median step of --steps steps after
--warmup, peak GPU memory above the step's start): no offload, Hugging Face's gradient
checkpointing (non-reentrant), torch's save_on_cpu(pin_memory=True), torchtune's
OffloadActivations alone and over that checkpointing, ``storm.enable(model)`` (every forward
offloaded), and ``storm.enable(model, peak=X)`` at each cap X: every one of those methods'
measured peaks, and three caps between checkpointing's and no offload's (a quarter, a half and
three quarters of the way; caps within 0.5% of one another are one, the least). Then, where the
plan's peak came within 1% of X, the plan and the fastest other method that fits X are built side
by side and timed in alternation (common.alternate: --rounds rounds of --round-steps steps, each
round in a shuffled order; at the least cap checkpointing too), and so are full offload and
torchtune's: ratios come from those, since the lent machines drift within a run.

The verdicts (``zoo_verdicts.verdicts``, recomputed by --summary from a results JSON): at every cap the plan's
peak fits X and its step is at most 1.00x the best other that fits X; at the least peak any
method reaches, it fits within 1% at most 1.10x checkpointing's step; full offload's peak within
1% of torchtune's at most 0.65x its step; and each plan's predicted step peak within 3% (or 64
MiB) of its measured peak. Every row and duel records its error (OOM, a missing import) instead
of ending the run; the JSON is rewritten after each row, so --resume goes on where a time limit
cut a run (one cell per device call, a run spanning calls). A run's rows compare only at one
commit: to go on with one while the code moves, measure from an export of its commit (``git
archive COMMIT | tar -x -C .base-COMMIT``, then ``cd .base-COMMIT && STORM_COMMIT=COMMIT python
bench/zoo.py ... --resume``). Without CUDA it exits 2, except --list and --summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import torch
from hf import ARCHS, HF

from common import (
    GiB,
    Trainer,
    Variant,
    alternate,
    cuda_device,
    failure,
    fresh_dynamo,
    host_available,
    link_bandwidth,
    meta,
    plan_summary,
    run,
    write,
)
from storm.blocks import block_lists
from stormd.wire.sizes import parse_size
from summary import peak_bytes, ratio_interval
from zoo_verdicts import OTHERS, best_other, caps, merge, table, verdicts

MiB = 1 << 20


def pair(arch: str, wide: tuple[int, int], long: tuple[int, int], **sizes: int) -> list[HF]:
    """``arch``'s two cells: (batch, seq) of the wide shape and of the long one."""
    return [HF(f"{arch}-{shape}", arch=arch, batch=b, seq=s, **sizes)
            for shape, (b, s) in (("wide", wide), ("long", long))]


# Sizes for an 80 GB H100: no offload's peak of order 10 to 20 GiB above the start (estimated on the CPU
# from the bytes autograd saves, SDPA's taken as flash attention's), a step of order 0.1 s. The wide and
# long shapes of a model take as many tokens (T5 excepted, whose position bias and attention masks grow
# with seq x seq: its long shape takes half), so that what differs between them is attention's
# (seq x seq) part and the masks.
LLAMA = {"layers": 16, "hidden": 2048, "mlp": 5632, "heads": 16, "kv_heads": 4, "vocab": 32000}
CELLS = {w.name: w for w in [
    *pair("llama", (16, 512), (1, 8192), **LLAMA),
    *pair("mistral", (16, 512), (1, 8192), **LLAMA, window=2048),
    *pair("gemma2", (8, 512), (1, 4096), layers=6, hidden=2304, mlp=9216, heads=8, kv_heads=4, vocab=256000,
          window=2048),
    *pair("phi3", (16, 512), (1, 8192), layers=10, hidden=3072, mlp=8192, heads=32, kv_heads=32, vocab=32064),
    *pair("gpt-neox", (16, 512), (1, 8192), layers=16, hidden=2048, mlp=8192, heads=16, kv_heads=16, vocab=50304),
    *pair("mixtral", (16, 512), (1, 8192), layers=12, hidden=1024, mlp=3584, heads=16, kv_heads=8, vocab=32000),
    *pair("t5", (16, 512), (1, 4096), layers=10, hidden=1024, mlp=2816, heads=16, kv_heads=16, vocab=32128),
    *pair("bert", (32, 512), (2, 8192), layers=24, hidden=1024, mlp=4096, heads=16, kv_heads=16, vocab=30522),
]}

FULL = ("torchtune", "storm-enable")  # --full-only: full offload against torchtune, and their duel
PLAN = "enable-peak"


def contender(w: HF, row: dict, storm_opts: dict) -> tuple[HF | Variant, str, dict]:
    """What common.run (or a Trainer) needs for a row: workload, method as run names it, options."""
    if row["method"] == "torchtune-checkpoint":
        return Variant(w, ckpt=True), "torchtune", {}
    if row["method"] == "storm-enable":
        return w, "enable", {**storm_opts, **({"codec": row["codec"]} if "codec" in row else {})}
    if row["method"] == PLAN:
        return w, "enable", {**storm_opts, "peak": row["cap_bytes"]}
    return w, row["method"], {}


def predicted_step_peak(planner: object) -> tuple[int | None, str]:
    """The plan's predicted peak above the step's start, and how it was read: the planner's own
    figure where it has one, else what a planned step's measured peak is held against: the
    besides (what a step holds beside its saves) plus the saves and gradients at the plan's
    predicted peak (Planner.step_peak, called _step_peak before)."""
    public = getattr(planner, "predicted_step_peak", None)
    if public is not None:
        return int(public() if callable(public) else public), "planner.predicted_step_peak"
    plan, besides = getattr(planner, "plan", None), getattr(planner, "besides", None)
    if plan is None or besides is None:
        return None, "none: no plan, or no compute trace measured (besides None)"
    if getattr(plan, "full", False):
        return None, "none: full offload's peak is its room's, measured and not predicted"
    name = "step_peak" if callable(getattr(planner, "step_peak", None)) else "_step_peak"
    return besides + getattr(planner, name)(plan), f"planner.besides + planner.{name}(planner.plan)"


def read_more(t: Trainer) -> dict:
    """What a row keeps beyond common.run's: the model's size and block lists (no offload's row),
    where storm.enable found the blocks, and a plan's predicted and self-measured step peaks."""
    out: dict = {}
    if t.method == "none":
        out.update(params=sum(p.numel() for p in t.model.parameters()), block_lists=block_lists(t.model))
    if t.handle is not None:
        out.update(blocks_at=t.handle.where or None, blocks=t.handle.blocks and len(t.handle.blocks))
    if t.planner is not None:
        predicted, how = predicted_step_peak(t.planner)
        out.update(predicted_step_peak_bytes=predicted, predicted_from=how,
                   planner_measured_peak_bytes=t.planner.measured_peak)
    return out


def duel(specs: list[tuple[HF | Variant, str, dict]], args: argparse.Namespace, device: torch.device,
         order: random.Random) -> dict:
    """Each spec's Trainer, all on the device at once, warmed (a plan until it settles), then timed
    in alternation (common.alternate): medians of all their steps, the first's over each other's
    with its 95% interval over rounds, and the first's plan where it has one (planned afresh: it
    may differ from its row's). An error (OOM) is recorded, not raised."""
    trainers: list[Trainer] = []
    try:
        fresh_dynamo(w for w, _, _ in specs)
        for spec in specs:
            trainers.append(Trainer(*spec, device))
            trainers[-1].warm(args.warmup)
        times = alternate(trainers, args.rounds, args.round_steps, order)
        ms = [round(statistics.median(s for r in rs for s in r) * 1e3, 2) for rs in times]
        out: dict = {"ms": ms, "rounds": args.rounds, "round_steps": args.round_steps,
                     "first_over": [round(ms[0] / m, 3) for m in ms[1:]],
                     "first_over_95": [[round(v, 3) for v in ratio_interval(times[0], rs)] for rs in times[1:]]}
        if trainers[0].planner is not None:
            out["chosen"] = plan_summary(trainers[0].planner)
        return out
    except Exception as e:  # a method that cannot run here, or out of memory: the duel says why and the run goes on
        return failure(e)
    finally:
        for t in trainers:
            t.close()


HOST_SHARE = 0.9  # of the host memory available, what a duel's methods may take together: the rest is the process's
PROCESS = uuid.uuid4().hex  # names the rows this process measured: what they kept, it still holds (host_short)
KEPT: collections.Counter[str] = collections.Counter()  # per process: GiB of the host its rows kept, so far


def host_short(rows: list[dict], available: int | None, process: str = PROCESS) -> str | None:
    """Why a duel of ``rows``' methods would not fit the host, or None: each row recorded the host
    memory its method took (page-locked copies, a pool), one trainer at a time, and a duel holds
    them all at once (t5-long's torchtune and full offload each pin what a step saves, and the
    host killed the process). What ``process`` (this one) kept after a row it measured
    (``host_kept_GiB``: the embedded store's pool, which its later stores use again) is out of
    ``available`` already and counts no more; a row measured by an earlier process (--resume)
    counts whole, as its memory went with that process, and with what that process had kept
    before the row began (``host_held_GiB``): a plan's row grew a pool that the full-offload row
    before it had grown, and this process would grow it from nothing (t5-long's least cap, which
    took the host). Rows that did not record it (from before, no /proc) count nothing, and none
    counts less than nothing (memory freed while its row ran)."""
    def need(r: dict) -> float:
        took = r.get("host_GiB") or 0.0
        if r.get("process") == process:
            return max(0.0, took - max(0.0, r.get("host_kept_GiB") or 0.0))
        return max(0.0, took) + max(0.0, r.get("host_held_GiB") or 0.0)

    need_bytes = sum(need(r) for r in rows) * GiB
    if available is None or need_bytes <= HOST_SHARE * available:
        return None
    return (f"host memory: {' + '.join(r['label'] for r in rows)} need {need_bytes / GiB:.1f} GiB more of the host at "
            f"once (what their rows took, less what this process kept of it), over the {HOST_SHARE:.0%} of the "
            f"{available / GiB:.1f} GiB available a duel may take; so the duel was not run")


def done_duel(d: dict | None, rounds: int) -> bool:
    """Whether a resumed cell keeps duel ``d``: run (or failed) with these rounds, not left out
    for the host's memory."""
    return d is not None and d.get("rounds") == rounds and not d.get("host_short")


def plan_label(cap: int) -> str:
    return f"enable peak={cap / GiB:.3f}GiB"


def measure_cell(w: HF, cell: dict, args: argparse.Namespace, device: torch.device, save: Callable[[], None],
                 measure_row: Callable[..., dict] = run, dueling: Callable[..., dict] = duel,
                 host: Callable[[], int | None] = host_available, process: str = PROCESS) -> dict:
    """One cell's rows, caps, plan rows and duels into ``cell`` (rows already there, from a run
    cut off, are kept), ``save()`` after each; then its verdicts. Each row records the host memory
    its method took (``host``: what is available), and a duel whose methods took more together
    than the host has is recorded as not run (host_short) rather than run until the host kills
    the process."""
    storm_opts = {"mode": "embedded", "min_bytes": args.min_bytes, "pool_size": args.pool_size,
                  **({"codec": args.codec} if args.codec else {})}
    mode = run_mode(args)
    if cell.get("rows") and cell.get("mode", mode) != mode:
        raise SystemExit(f"zoo.py: {w.name} was measured as a {cell['mode']} run in this --out; resume it with the "
                         f"same options, or measure this {mode} run into another --out")
    done = {r["label"]: r for r in cell.get("rows", [])}
    cell.update(workload=dataclasses.asdict(w), why=w.spec.why, rows=[], mode=mode)
    start = time.perf_counter()

    def add(row: dict) -> dict:
        if row["label"] not in done:
            workload, method, opts = contender(w, row, storm_opts)
            before = host()

            def taken() -> float | None:  # GiB of the host taken since the row began
                now = host()
                return None if before is None or now is None else round((before - now) / GiB, 3)

            def more(t: Trainer) -> dict:  # while its trainer holds what it took
                return {**read_more(t), "host_GiB": taken()}

            held = round(KEPT[process], 3)  # what the rows before it left this process: a pool it may grow
            row.update(measure_row(workload, method, args.steps, args.warmup, opts, device, more=more))
            # its trainer closed: what the process keeps of it (an embedded store's pool)
            row.update(host_kept_GiB=taken(), process=process, host_held_GiB=held)
            KEPT[process] += max(0.0, row["host_kept_GiB"] or 0.0)
            row["peak_GiB"] = row.pop("peak_extra_GiB", None)
            print(f"{w.name} {row['label']}: {_brief(row)}", flush=True)
        cell["rows"].append(done.get(row["label"], row))
        save()
        return cell["rows"][-1]

    if args.codecs:  # full offload in each codec, no other method
        for codec in args.codecs:
            add({"label": f"storm-enable codec={codec}", "method": "storm-enable", "codec": codec})
    for method in () if args.codecs or args.caps else FULL if args.full_only else OTHERS:
        add({"label": method, "method": method})
    if args.caps:  # the plan at these caps alone: nothing fits beside it, so no duel
        cell["caps"] = [{"cap_bytes": int(c * GiB), "sources": ["--caps"]} for c in sorted(args.caps)]
    else:
        cell["caps"] = [] if args.full_only or args.codecs else caps(cell["rows"])
    for c in cell["caps"]:
        c["plan"] = plan_label(c["cap_bytes"])  # named before its row is measured: add() saves the cell
        add({"label": c["plan"], "method": PLAN, "cap_bytes": c["cap_bytes"]})
    rows, order = cell["rows"], random.Random(0)

    def duel_of(these: list[dict]) -> dict:
        short = host_short(these, host(), process)
        # a duel not run for the host's memory is tried again on resume (another host may hold it)
        return {"error": short, "host_short": True} if short else \
            dueling([contender(w, r, storm_opts) for r in these], args, device, order)

    old = {d["cap_bytes"]: d for d in cell.get("duels", []) if done_duel(d, args.rounds)}
    cell["duels"] = []
    for i, c in enumerate(cell["caps"]):
        mine, other = next(r for r in rows if r["label"] == c["plan"]), best_other(rows, c["cap_bytes"])
        if "step_ms" not in mine or peak_bytes(mine) > 1.01 * c["cap_bytes"] or other is None:
            continue  # a plan that missed its cap fails it however fast: no need to time it
        if c["cap_bytes"] in old:
            cell["duels"].append(old[c["cap_bytes"]])
            continue
        versus = [other] + [r for r in rows if i == 0 and r["method"] == "checkpoint" and r is not other]
        d = duel_of([mine, *versus])
        d.update(cap_bytes=c["cap_bytes"], plan=mine["label"], versus=[r["label"] for r in versus], rounds=args.rounds)
        print(f"{w.name} duel at {c['cap_bytes'] / GiB:.3f} GiB: {_brief(d)}", flush=True)
        cell["duels"].append(d)
        save()
    full = {r["method"]: r for r in rows if r["method"] in ("storm-enable", "torchtune") and "step_ms" in r}
    if len(full) == 2 and not done_duel(cell.get("full_duel"), args.rounds):
        d = duel_of([full["storm-enable"], full["torchtune"]])
        cell["full_duel"] = {**d, "versus": ["torchtune"], "rounds": args.rounds}
        print(f"{w.name} full offload against torchtune: {_brief(cell['full_duel'])}", flush=True)
    by_codec = [r for r in rows if "codec" in r and "step_ms" in r]
    if len(by_codec) > 1 and not done_duel(cell.get("codec_duel"), args.rounds):
        d = duel_of(by_codec)
        cell["codec_duel"] = {**d, "versus": [r["label"] for r in by_codec[1:]], "rounds": args.rounds}
        print(f"{w.name} full offload's codecs: {_brief(cell['codec_duel'])}", flush=True)
    cell["seconds"] = round(time.perf_counter() - start, 1)  # this call's time: a resumed cell ran in earlier ones too
    cell["complete"] = True
    cell["verdicts"] = verdicts(cell)
    save()
    return cell


def run_mode(args: argparse.Namespace) -> str:
    """What a run measures of each cell: every method ("zoo"), or one of the narrower options."""
    return "caps" if args.caps else "codecs" if args.codecs else "full-only" if args.full_only else "zoo"


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("explain", "block_lists", "kept", "label")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS), metavar="CELL",
                   help="<arch>-wide or <arch>-long (--list); default: all")
    p.add_argument("--list", action="store_true", help="print the cells and what each architecture is for")
    p.add_argument("--out", help="results JSON, rewritten after each row (required to measure)")
    p.add_argument("--resume", action="store_true",
                   help="keep what --out holds: skip its complete cells, keep a cut-off cell's rows and duels")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3,
                   help="steps before the timed ones: full offload's first three profile and try its room")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each duel")
    p.add_argument("--round-steps", type=int, default=3, help="steps of each method per round")
    p.add_argument("--pool-size", default=None,
                   help="STORM's embedded pool (default: none, the pool grows on demand within the host's memory, "
                        "as storm.enable's does: a fixed 32 GiB kept t5-long's 54 GB of saves a step off the host)")
    p.add_argument("--min-bytes", type=parse_size, default=1024,
                   help="STORM's min_bytes; the default is torchtune OffloadActivations' min_offload_size")
    p.add_argument("--quick", action="store_true", help="--steps 3 --warmup 1 --rounds 2 --round-steps 2")
    p.add_argument("--codec", help="STORM's codec for its rows (e.g. auto: where the link bounds full offload, "
                                   "fewer bytes are the way under it); unset: storm's default. Its own --out file")
    narrow = p.add_mutually_exclusive_group()  # each measures less of a cell than the whole zoo, in its own way
    narrow.add_argument("--codecs", nargs="+", metavar="CODEC",
                        help="only full offload (storm.enable(model)) in each of these codecs, timed against each "
                             "other in alternation (the first over each other): no torchtune, caps or plans")
    narrow.add_argument("--caps", nargs="+", type=float, metavar="GIB",
                        help="only storm.enable(model, peak=X) at each of these caps (GiB), no other method or duel: "
                             "what the planner keeps and measures there")
    narrow.add_argument("--full-only", action="store_true",
                        help="only torchtune and storm.enable(model) (full offload), and their duel: no caps or "
                             "plans")
    p.add_argument("--summary", metavar="RESULTS.json", help="measure nothing: the tables and verdicts of a run")
    p.add_argument("--merge", nargs="+", metavar="RESULTS.json",
                   help="measure nothing: the cells of these files (one run's, a process per GPU) into --out")
    p.add_argument("--markdown", action="store_true", help="with --summary: docs/results.md's Markdown")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds, args.round_steps = 3, 1, 2, 2
    if args.list:
        for name, w in CELLS.items():
            print(f"{name:<14} {w.layers} layers, hidden {w.hidden}, mlp {w.mlp}, heads {w.heads}/{w.kv_heads}, "
                  f"vocab {w.vocab}, batch {w.batch} x {w.seq}, {ARCHS[w.arch].attn}: {w.spec.why}")
        return 0
    if args.summary:
        cells = json.loads(Path(args.summary).read_text())["cells"]
        for name, cell in cells.items():
            cell["verdicts"] = verdicts(cell)
            print(table(name, cell, args.markdown) + "\n")
        return 0
    if not args.out:
        p.error("--out is required to measure or --merge (or --list, --summary)")
    if args.merge:
        try:
            merged = merge([json.loads(Path(f).read_text()) for f in args.merge], args.merge)
        except ValueError as e:
            p.error(str(e))
        Path(args.out).write_text(json.dumps({**merged, "meta": {"merged_from": args.merge}}, indent=1) + "\n")
        print(f"{len(merged['cells'])} cells of {len(args.merge)} files in {args.out}")
        return 0
    device = cuda_device("zoo.py", "; --summary RESULTS.json prints a run's tables and verdicts on any machine")
    if device is None:
        return 2
    out = Path(args.out)
    results = json.loads(out.read_text()) if args.resume and out.exists() else {}
    results.setdefault("cells", {})
    link = link_bandwidth(device)
    for name in args.cells:
        cell = results["cells"].setdefault(name, {})
        if cell.get("complete"):
            print(f"{name}: in {out} already", flush=True)
            continue
        # a run spans device calls, maybe cards: each cell says where its rows ran, each call that measured it
        cell.update(link=link, meta=meta(device), calls=[*cell.get("calls", []), meta(device)])
        measure_cell(CELLS[name], cell, args, device, lambda: write(out, results, device))
        print(table(name, cell) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
