"""What a zoo cell's forward saves for backward, by kind, and how few bytes a lossless codec of
each kind could send: the measurement a codec for a link-bound model is chosen from.

One training forward of a bench/zoo.py cell (random weights, train mode) under
torch.autograd.graph.saved_tensors_hooks; each storage autograd saves is counted once, its
parameters left out (an offloader never moves those). Each save falls in one kind:

- ``mask``: two values at most, one of them 0 (dropout's mask: bool on CUDA, the input's dtype
  on the CPU, where dropout saves its scaled noise); a bit each is enough;
- ``upcast``: float32 whose low 16 bits are all 0, a bfloat16 value widened (a loss's or a
  norm's ``.float()``): its high half holds it all;
- ``float32``, ``bfloat16``, ``float16``: the rest, by dtype; ``other``: integers and the like.

Per kind: the bytes, their share, and a bound on what an exponent codec sends (sign and exponent
coded at their empirical entropy per tensor, the mantissa's bits sent as they are: what a codec
of the ancf_exp family can reach, not what one does). The bound for all saves, as a fraction of
their bytes, says whether such codecs can shrink a link-bound step's bytes as far as it needs.
Beside it, ``auto_x``: what ``codec="auto"`` sends of each kind on CUDA (storm/frames.py), each
save encoded in the frame it would take, and where that frame overflows in the next one, as a
step after the first sends (a save's size is the cell's own batch's for the 4 MiB threshold).
And ``sizes``: the saves per band of storage size (under ``min_bytes``'s default of 64 KiB, to
1 MiB, to 16 MiB, over), all and those made inside a block, with their share of the bytes: what
``min_bytes`` could move (sizes follow the batch: measure them at the cell's own, with --layers
to fit the CPU). Banded by storage: ``min_bytes`` tests each save's view, so a small view of a
large storage, where no larger view of it is saved, is kept whole by it.

    python bench/saves.py --cell t5-wide --batch 1 --out bench/results/saves-t5-cpu-<date>-<commit>.json

On the CPU, use --batch (and --layers) to fit; shares per kind do not depend on the batch, but
dropout's masks are the input's dtype there and bool on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict

import torch
from hf import HF
from zoo import CELLS

from common import write
from storm.frames import KINDS, frame_codec
from storm.kernels.frame_layout import complete
from storm.saved import producer_of

MiB = 1 << 20
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
FIELD = {torch.float32: (torch.int32, 23), torch.bfloat16: (torch.int16, 7), torch.float16: (torch.int16, 10)}


def kind(t: torch.Tensor) -> str:
    """The kind of a saved tensor (module docstring)."""
    if t.dtype == torch.bool:
        return "mask"
    if not t.dtype.is_floating_point or t.numel() == 0:
        return "other"
    top = t.abs().amax()
    if bool(((t == 0) | (t.abs() == top)).all()):
        return "mask"
    if t.dtype == torch.float32 and not bool((t.contiguous().view(torch.int32) & 0xFFFF).any()):
        return "upcast"
    return str(t.dtype).removeprefix("torch.") if t.dtype in MANTISSA else "other"


def bound_bits(t: torch.Tensor, k: str) -> float:
    """Bits an exponent codec of the ancf_exp family sends at best for ``t`` (module docstring)."""
    n = t.numel()
    if k == "mask":
        return float(n)
    if k == "other" or t.dtype not in FIELD:
        return float(t.numel() * t.element_size() * 8)
    as_int, shift = FIELD[t.dtype]
    mantissa = MANTISSA[t.dtype] - (16 if k == "upcast" else 0)
    top = (t.contiguous().view(as_int).to(torch.int64) >> shift) & ((1 << (t.element_size() * 8 - shift)) - 1)
    counts = torch.bincount(top.flatten()).double()
    p = counts[counts > 0] / n
    entropy = float(-(p * p.log2()).sum())
    return n * (entropy + mantissa)


def sent_by_auto(t: torch.Tensor, producer: str, scale: float) -> int:
    """The bytes codec auto sends of ``t``'s storage on CUDA in a step after the first: the frame
    it takes, or the next where that one overflows, or its bytes (frames.frame_codec; the 4 MiB
    threshold read at ``scale`` times the storage's size)."""
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    dtype, refused = str(t.dtype).removeprefix("torch."), set()
    while (codec := frame_codec("auto", "cuda", dtype, int(nbytes * scale), producer, refused)) is not None:
        frame = torch.empty(KINDS[codec].nbytes(nbytes), dtype=torch.uint8, device=t.device)
        KINDS[codec].encode(raw, frame)
        if complete(frame[:16].cpu()):
            return frame.numel()
        refused.add(codec)
    return nbytes


def saves(w: HF, device: torch.device, scale: float = 1.0) -> dict:
    """One forward of ``w``: per kind, the bytes saved, the exponent codec's bound and what codec
    auto sends (``scale``: the cell's batch over ``w``'s)."""
    model, ids = w.build(device)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, tuple[torch.Tensor, str]] = {}
    in_block: set[int] = set()  # the saves made inside a block (storm.plan's blocks)
    inside = [False]
    for b in w.blocks(model):
        b.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        b.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen[key] = t.detach(), producer_of(t)
            if inside[0]:
                in_block.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = w.forward(model, ids)
    del loss
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "bound_bytes": 0.0,
                                                             "auto_bytes": 0})
    for t, producer in seen.values():
        k = kind(t)
        r = rows[k]
        r["tensors"] += 1
        r["bytes"] += t.untyped_storage().nbytes()
        r["bound_bytes"] += bound_bits(t, k) / 8
        r["auto_bytes"] += sent_by_auto(t, producer, scale)
    total = sum(r["bytes"] for r in rows.values())
    sizes = [(t.untyped_storage().nbytes(), key in in_block) for key, (t, _) in seen.items()]
    bound = sum(r["bound_bytes"] for r in rows.values())
    auto = sum(r["auto_bytes"] for r in rows.values())
    return {"saved_MiB": round(total / MiB, 1), "bound_x": round(bound / total, 3) if total else None,
            "auto_x": round(auto / total, 3) if total else None,
            "kinds": {k: {"tensors": r["tensors"], "MiB": round(r["bytes"] / MiB, 1),
                          "share": round(r["bytes"] / total, 3), "bound_x": round(r["bound_bytes"] / r["bytes"], 3),
                          "auto_x": round(r["auto_bytes"] / r["bytes"], 3)}
                      for k, r in sorted(rows.items(), key=lambda kv: -kv[1]["bytes"])},
            "sizes": size_bands(sizes, total)}


SIZE_BANDS = (("under 64 KiB", 64 << 10), ("64 KiB to 1 MiB", MiB), ("1 to 16 MiB", 16 * MiB),
              ("16 MiB and over", None))


def size_bands(sizes: list[tuple[int, bool]], total: int) -> dict:
    """Per band of storage size (``min_bytes``'s default, 64 KiB, is the first edge): the saves
    in it, all and those made inside a block, and their share of the bytes: how far raising
    or lowering ``min_bytes`` moves what a step offloads, in bytes and in tensors (each costs
    host time)."""
    out, low = {}, 0
    for band, high in SIZE_BANDS:
        inside = [(n, b) for n, b in sizes if low <= n and (high is None or n < high)]
        out[band] = {"tensors": len(inside), "in_blocks": sum(b for _, b in inside),
                     "MiB": round(sum(n for n, _ in inside) / MiB, 2),
                     "share": round(sum(n for n, _ in inside) / total, 5) if total else None}
        low = high or low
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", nargs="+", default=["t5-wide", "bert-wide"], choices=list(CELLS))
    ap.add_argument("--batch", type=int, help="the cell's batch instead of its own (the CPU's memory)")
    ap.add_argument("--layers", type=int, help="the cell's layers instead of its own")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="results JSON")
    args = ap.parse_args()
    out = {}
    for name in args.cell:
        cell = CELLS[name]
        changes = {k: v for k, v in (("batch", args.batch), ("layers", args.layers)) if v is not None}
        w = dataclasses.replace(cell, **changes)
        out[name] = {"batch": w.batch, "seq": w.seq, "layers": w.layers,
                     **saves(w, torch.device(args.device), cell.batch / w.batch)}
        r = out[name]
        print(f"{name} (batch {w.batch}, {w.layers} layers): {r['saved_MiB']} MiB saved, exponent-codec bound "
              f"{r['bound_x']} of the bytes, codec auto sends {r['auto_x']}", flush=True)
        for k, v in r["kinds"].items():
            print(f"  {k:9s} {v['tensors']:5d} tensors {v['MiB']:10.1f} MiB  share {v['share']:.3f}  "
                  f"bound {v['bound_x']:.3f}  auto {v['auto_x']:.3f}", flush=True)
        for band, v in r["sizes"].items():
            print(f"  {band:16s} {v['tensors']:5d} tensors ({v['in_blocks']} in blocks) {v['MiB']:10.2f} MiB  "
                  f"share {v['share']}", flush=True)
    if args.out:
        write(args.out, {"cells": out}, torch.device(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
