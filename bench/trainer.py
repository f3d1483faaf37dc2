"""A Hugging Face model trained through ``transformers.Trainer``, with and without STORM's one line.

    python bench/trainer.py --out bench/results/trainer.json                # CUDA: through a stormd
    python bench/trainer.py --device cpu --tiny --out /tmp/trainer.json     # smoke run

A LlamaForCausalLM built from a config (random weights, no hub access) trains --steps steps
on random tokens three times from the same seed, with the Trainer's ``full_determinism`` (its
deterministic kernels): without STORM twice (the second says whether this device's training is
deterministic at all, without which no comparison means anything),
and with ``callbacks=[StormCallback(...)]`` (storm.integrations.transformers) through a stormd
started for the run (``--mode daemon``) or the embedded store. Per run: the loss of every step,
the step time (median), the peak memory above the start (CUDA: torch.cuda.max_memory_allocated),
and whether every parameter after training is bit-identical to the first run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import storm
from common import W3, W3_TINY, cuda_device, start_daemon, stop_daemon, write
from storm.integrations.transformers import StormCallback

GiB = 1 << 30


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """common.py's W3 (issue 40's Llama) with --layers, or its tiny variant; bf16 on CUDA with
    --attn, float32 and eager attention on the CPU."""
    w = W3_TINY if args.tiny else dataclasses.replace(W3, layers=args.layers)
    w = dataclasses.replace(w, seq=args.seq, attn=args.attn if device.type == "cuda" else "eager")
    return w.model(device, torch.bfloat16 if device.type == "cuda" else torch.float32)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock:
    """Step times and the loss of each step, from the Trainer's own callbacks."""

    def __init__(self, device: torch.device, storm_callback: StormCallback | None):
        self.device, self.times, self.losses, self._t = device, [], [], 0.0
        self.storm, self.offloaded = storm_callback, 0

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class Timed(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if clock.device.type == "cuda":
                    torch.cuda.synchronize(clock.device)
                clock._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if clock.device.type == "cuda":
                    torch.cuda.synchronize(clock.device)
                clock.times.append(time.perf_counter() - clock._t)
                last = clock.storm.handle.last if clock.storm is not None and clock.storm.handle else None
                clock.offloaded += last.stats.offloaded if last is not None else 0

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    clock.losses.append(logs["loss"])

        return Timed()


def train(args: argparse.Namespace, device: torch.device, storm_options: dict | None) -> tuple[dict, list]:
    from transformers import Trainer, TrainingArguments

    model = build(args, device)
    data = Tokens(args.batch * args.steps, args.seq, model.config.vocab_size)
    storm_callback = StormCallback(**storm_options) if storm_options is not None else None
    clock = Clock(device, storm_callback)
    callbacks = [clock.callback()] + ([storm_callback] if storm_callback is not None else [])
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
                                  logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-4,
                                  use_cpu=device.type == "cpu", seed=0, data_seed=0, dataloader_num_workers=0,
                                  disable_tqdm=True, full_determinism=args.deterministic)
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        trainer.train()
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    params = [p.detach().clone() for p in model.parameters()]
    row = {"losses": clock.losses, "step_ms": round(statistics.median(clock.times[1:] or clock.times) * 1e3, 2),
           "peak_extra_GiB": None if peak is None else round(peak / GiB, 3), "offloaded_tensors": clock.offloaded}
    del model, trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, params


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a two-layer model (smoke runs, CPU)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--mode", default="daemon", choices=["daemon", "embedded"])
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention on CUDA (CPU: eager)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="TrainingArguments(full_determinism=...): deterministic kernels, without which two runs "
                        "of the same training differ and no comparison is bit for bit (default on)")
    p.add_argument("--budget", default=None, help="StormCallback(budget=...) (a plan); default: offload everything")
    p.add_argument("--pool-size", default="32GiB", help="the stormd's (or embedded store's) pool")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.device == "cuda":
        device = cuda_device("trainer.py", " (--device cpu --tiny runs on the CPU)")
        if device is None:
            return 2
    else:
        device = torch.device("cpu")
    options: dict = {"mode": args.mode, "min_bytes": 0 if args.tiny else 1 << 20}
    if args.budget is not None:
        options["budget"] = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    proc = None
    with tempfile.TemporaryDirectory() as work:
        if args.mode == "daemon":
            proc, endpoint = start_daemon(Path(work), args.pool_size)
            options["socket"] = endpoint
        else:
            options["pool_size"] = args.pool_size
        try:
            reference, ref_params = train(args, device, None)
            again, again_params = train(args, device, None)
            with_storm, storm_params = train(args, device, options)
        finally:
            storm.close_all()
            if proc is not None:
                stop_daemon(proc)
    again["bit_identical"] = same(ref_params, again_params) and again["losses"] == reference["losses"]
    with_storm["bit_identical"] = same(ref_params, storm_params) and with_storm["losses"] == reference["losses"]
    results = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "storm_options": {
        k: v for k, v in options.items() if k != "socket"}, "without": reference, "without_again": again,
        "with_storm": with_storm}
    print({k: {m: r[m] for m in ("step_ms", "peak_extra_GiB") if m in r} | {"bit_identical": r.get("bit_identical")}
           for k, r in results.items() if isinstance(r, dict) and "losses" in r})
    write(args.out, results, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
