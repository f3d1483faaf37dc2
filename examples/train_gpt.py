"""Train a small byte-level GPT with STORM offloading its saved activations.

    storm-train-gpt --steps 20            # CPU, or CUDA when present
    python -m storm.examples.train_gpt --mode daemon --socket /run/stormd/stormd.sock

The first step runs twice from the same state, without and with offload, and
every gradient is compared bit for bit; the program exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import copy
import logging
import resource
import sys
import time
from pathlib import Path

import torch

import storm
from storm.examples.models import GPT, same_bits


def corpus(device: torch.device) -> torch.Tensor:
    """Real text to learn: the source files of this package, as bytes."""
    root = Path(__file__).resolve().parent.parent
    text = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")) if ".venv" not in p.parts)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device=device, dtype=torch.long)


def batch(data: torch.Tensor, size: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (size,), generator=gen)
    idx = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return idx[:, :-1], idx[:, 1:]


def grads_after_step(model: GPT, x: torch.Tensor, y: torch.Tensor, seed: int,
                     offload: storm.Offload | None) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # the same dropout masks in both runs
    if offload is None:
        loss = model.loss(x, y)
    else:
        with offload:
            loss = model.loss(x, y)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def check_first_step(model: GPT, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> int:
    """Gradients without and with offload from identical copies; returns how many differ."""
    plain, offloaded = copy.deepcopy(model), copy.deepcopy(model)
    g0 = grads_after_step(plain, x, y, args.seed, None)
    g1 = grads_after_step(offloaded, x, y, args.seed, make_offload(args))
    names = [n for n, _ in model.named_parameters()]
    bad = [n for n, a, b in zip(names, g0, g1) if not same_bits(a, b)]
    for n in bad:
        print(f"gradient of {n} differs with offload", file=sys.stderr)
    print(f"first step: {len(names) - len(bad)}/{len(names)} gradients bit-identical with and without offload")
    return len(bad)


def make_offload(args: argparse.Namespace) -> storm.Offload:
    return storm.offload(mode=args.mode, socket=args.socket, min_bytes=args.min_bytes)


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB"
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mode", default="auto", choices=["auto", "daemon", "embedded"])
    p.add_argument("--socket", default=None, help="stormd socket (default: $STORMD_SOCKET or the runtime dir)")
    p.add_argument("--min-bytes", type=int, default=64 << 10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the bit-exact first-step comparison")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = GPT(seq_len=args.seq, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = corpus(device)
    gen = torch.Generator().manual_seed(args.seed)

    x, y = batch(data, args.batch, args.seq, gen)
    if not args.no_check and check_first_step(model, x, y, args):
        return 1

    total_bytes = total_tensors = 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        with make_offload(args) as off:
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
        st = off.stats
        total_bytes += st.offloaded_bytes
        total_tensors += st.offloaded
        print(f"step {step:4d}  loss {loss.item():.4f}  {ms:7.1f} ms  offloaded {st.offloaded} tensors "
              f"{st.offloaded_bytes / 2**20:.1f} MiB  kept {sum(st.kept.values())}  "
              f"fetch wait {st.fetch_wait_s * 1e3:.1f} ms")
        x, y = batch(data, args.batch, args.seq, gen)
    print(f"done: {args.steps} steps through {off.backend_name}; offloaded {total_tensors} tensors, "
          f"{total_bytes / 2**20:.1f} MiB in all; {peak_memory(device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
