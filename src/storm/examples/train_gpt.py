"""Train a small byte-level GPT with STORM offloading its saved activations.

    storm-train-gpt --steps 20            # CPU, or CUDA when present
    python -m storm.examples.train_gpt --mode daemon --socket /run/stormd/stormd.sock
    storm-train-gpt --plot memory.png     # memory over one step, without and with STORM

The first step runs twice from the same state, without and with offload, and
every gradient is compared bit for bit; the program exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import record_function

import storm
from storm.examples.models import GPT, same_bits
from storm.hooks import parse_budget
from storm.report import BACKWARD, FORWARD, memory_timeline, plot_memory, progress
from storm.saved import DEFAULT_MAX_HELD_BYTES
from stormd.wire.sizes import format_size, parse_size


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


def check_first_step(model: GPT, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> tuple[int, float]:
    """Gradients without and with offload from identical copies; returns how many differ, and the
    peak memory (MiB, as peak_mib) by the end of the step without offload."""
    plain, offloaded = copy.deepcopy(model), copy.deepcopy(model)
    g0 = grads_after_step(plain, x, y, args.seed, None)
    without = peak_mib(x.device)
    if x.device.type == "cuda":  # from here on, the peak is that of steps with STORM
        torch.cuda.reset_peak_memory_stats(x.device)
    g1 = grads_after_step(offloaded, x, y, args.seed, make_offload(args))
    names = [n for n, _ in model.named_parameters()]
    bad = [n for n, a, b in zip(names, g0, g1) if not same_bits(a, b)]
    for n in bad:
        print(f"gradient of {n} differs with offload", file=sys.stderr)
    print(f"first step: {len(names) - len(bad)}/{len(names)} gradients bit-identical with and without offload")
    return len(bad), without


def plan_budget(text: str) -> int | float:
    """argparse type of --plan: a fraction in (0, 1] of a step's saves, written with a decimal point
    (0.3), or a size with a unit (64MiB). A bare number is refused: as bytes, "2" is surely not meant."""
    accepted = "must be a size with a unit (such as 64MiB) or a fraction in (0, 1] with a decimal point (such as 0.3)"
    try:
        fraction = float(text)
    except ValueError:
        try:
            return parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{accepted}; got {text!r} ({e})") from None
    if "." not in text:
        raise argparse.ArgumentTypeError(f"{accepted}; got {text!r}")
    try:
        return parse_budget(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{accepted}; got {text!r}") from None


def make_offload(args: argparse.Namespace) -> storm.Offload:
    return storm.offload(mode=args.mode, socket=args.socket, min_bytes=args.min_bytes,
                         max_held_bytes=args.max_held_bytes)


def plot_step(model: GPT, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> str:
    """One step without and one with STORM, on copies of the model, drawn into args.plot; returns a summary."""
    def step(offload: storm.Offload | None) -> Callable[[], None]:
        m = copy.deepcopy(model)

        def run() -> None:
            with record_function(FORWARD), (offload or contextlib.nullcontext()):
                loss = m.loss(x, y)
            with record_function(BACKWARD):
                loss.backward()
        return run

    device = x.device
    off = make_offload(args)
    without = memory_timeline("without STORM", step(None), device)
    with_storm = memory_timeline("with STORM", step(off), device)
    with_storm.label = f"with STORM ({off.backend_name.split(' (')[0]})"
    plot_memory([without, with_storm], args.plot,
                f"{'GPU' if device.type == 'cuda' else 'CPU'} memory allocated by torch over one step: GPT "
                f"{args.layers} layers, d_model {args.d_model}, batch {args.batch} x {args.seq}")
    return (f"plot: {args.plot} (peak {without.peak_mib:.1f} MiB without STORM, "
            f"{with_storm.peak_mib:.1f} MiB with)")


def peak_mib(device: torch.device) -> float:
    """The peak so far: of GPU memory allocated by torch on CUDA (since its last reset), else of
    the process's RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def peak_memory(device: torch.device, without: float | None) -> str:
    """The run's peak, beside the one of the first step without STORM where the check ran it."""
    if device.type == "cuda":
        text = f"peak GPU memory {peak_mib(device):.1f} MiB with STORM"
        return text + ("" if without is None else f", {without:.1f} MiB in the first step without it")
    text = f"peak RSS {peak_mib(device):.1f} MiB"
    # the process's peak cannot be reset: the figure after the step without STORM is the peak up to then
    return text + ("" if without is None else f" ({without:.1f} MiB by the end of the first step without "
                                             f"STORM; on the CPU the host pool STORM offloads to is the same "
                                             f"memory, so STORM lowers no CPU peak: it is for GPU memory)")


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def size(text: str) -> int:
    """argparse type: bytes, as a number or with a unit (64KiB, 8MiB, 1GB), as the Python API takes them."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> torch.device:
    """argparse type: a device torch names (cpu, cuda, cuda:1)."""
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (use cpu, cuda or cuda:N)") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=positive, default=20, help="training steps")
    p.add_argument("--batch", type=positive, default=8, help="sequences a step")
    p.add_argument("--seq", type=positive, default=128, help="tokens a sequence")
    p.add_argument("--layers", type=positive, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=positive, default=128, help="model width, a multiple of --heads")
    p.add_argument("--heads", type=positive, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (SGD)")
    p.add_argument("--mode", default="auto", choices=["auto", "daemon", "embedded"],
                   help="auto: a running stormd, else the embedded store; daemon: fail without one")
    p.add_argument("--socket", default=None,
                   help="stormd socket (None: $STORMD_SOCKET, else the per-user runtime directory, which must "
                        "be yours and 0700)")
    p.add_argument("--min-bytes", type=size, default="64KiB",
                   help="smaller saved tensors stay on the device (bytes or a size such as 64KiB)")
    p.add_argument("--max-held-bytes", type=size, default=format_size(DEFAULT_MAX_HELD_BYTES),
                   help="bytes whose copy may still be running before a save waits (a size such as 64MiB; "
                        "0: every save waits)")
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to train: cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's weights and data")
    p.add_argument("--no-check", action="store_true", help="skip the bit-exact first-step comparison")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw memory over one step without and with STORM (needs matplotlib: "
                        "pip install matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines and no progress bar")
    p.add_argument("--plan", metavar="BUDGET", default=None, type=plan_budget,
                   help="train with storm.plan: the GPU memory saved activations may take, a size (e.g. 64MiB) "
                        "or a fraction of a step's (e.g. 0.3); blocks are kept, offloaded or recomputed")
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # say so now, not after training
        p.error("--plot draws with matplotlib, which is not installed: pip install matplotlib "
                "(from a checkout of STORM: pip install '.[plot]')")
    if args.plot and not Path(args.plot).absolute().parent.is_dir():  # say so now, not after training
        p.error(f"--plot {args.plot}: there is no directory {Path(args.plot).absolute().parent}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA device (use --device cpu)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return train(args)
    except storm.StormError as e:  # no daemon with --mode daemon, or one that refused: the message says which
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 1


def train(args: argparse.Namespace) -> int:
    """The run main() parsed: the first step checked (1 if a gradient differs), then training."""
    device = args.device
    torch.manual_seed(args.seed)
    model = GPT(seq_len=args.seq, d_model=args.d_model, n_heads=args.heads, n_layers=args.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = corpus(device)
    gen = torch.Generator().manual_seed(args.seed)

    x, y = batch(data, args.batch, args.seq, gen)
    without = None
    if not args.no_check:
        bad, without = check_first_step(model, x, y, args)
        if bad:
            return 1

    if args.plot:
        print(plot_step(model, x, y, args))

    planner = None
    if args.plan is not None:  # its own copy queue and prefetch window: --max-held-bytes is not passed
        planner = storm.plan(model.blocks, budget=args.plan, mode=args.mode, socket=args.socket,
                             min_bytes=args.min_bytes)
    total_bytes = total_tensors = 0
    with progress(args.steps, "training", quiet=args.quiet) as advance:
        for step in range(args.steps):
            ms, loss, off = train_step(model, opt, x, y, planner.step() if planner else make_offload(args))
            st = off.stats
            total_bytes += st.offloaded_bytes
            total_tensors += st.offloaded
            advance(f"step {step:4d}  loss {loss:.4f}  {ms:7.1f} ms  offloaded {st.offloaded} tensors "
                    f"{st.offloaded_bytes / 2**20:.1f} MiB  kept {sum(st.kept.values())}  "
                    f"fetch wait {st.fetch_wait_s * 1e3:.1f} ms")
            x, y = batch(data, args.batch, args.seq, gen)
    print(f"done: {args.steps} steps through {off.backend_name}; offloaded {total_tensors} tensors, "
          f"{total_bytes / 2**20:.1f} MiB in all; {peak_memory(device, without)}")
    if planner is not None:
        print(planner.explain())
        planner.close()
    return 0


def train_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               off: storm.Offload) -> tuple[float, float, storm.Offload]:
    """One optimizer step with offload; returns its time (ms), its loss and its storm.Offload."""
    device = x.device
    t0 = time.perf_counter()
    with off:
        loss = model.loss(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, loss.item(), off


if __name__ == "__main__":
    sys.exit(main())
