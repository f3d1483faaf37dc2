"""What the benchmarks share: the workloads, the device they measure on, the link's speed, a
stormd for one run, one method's training steps, and results written with their provenance.

A script run as ``python bench/<name>.py`` has bench/ on its path and imports this as ``common``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch._functorch.config
import xxhash
from torch import nn
from torch.utils.checkpoint import checkpoint

import storm
from stormd.launch import start_stormd
from stormd.limits import cgroup_room, meminfo

GiB = 1 << 30
MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


# The workloads: W1 and W2 from ../shared/reference/anchors_w1_w2.py, so STORM's figures sit beside
# the anchors; TINY for smoke runs of the scripts on CPU.

class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        a, _ = self.attn(y, y, y, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, layers: int, d: int, h: int, ckpt: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


@dataclass(frozen=True)
class Workload:
    """A Net of ``layers`` Blocks on a random bf16 input; its loss is the mean square of the output,
    taken after the method's context (what the method offloads is the Net's alone)."""

    name: str
    layers: int
    d: int
    heads: int
    batch: int
    seq: int

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[Net, torch.Tensor]:
        torch.manual_seed(seed)
        model = Net(self.layers, self.d, self.heads, ckpt).to(device, torch.bfloat16)
        x = torch.randn(self.batch, self.seq, self.d, device=device, dtype=torch.bfloat16)
        return model, x

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList:
        """What storm.plan plans over and a per-block compile compiles."""
        return model.blocks

    @staticmethod
    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What runs inside the method's context."""
        return model(x)

    @staticmethod
    def objective(y: torch.Tensor) -> torch.Tensor:
        """The scalar that backward starts from, computed from forward's output outside the context."""
        return y.float().pow(2).mean()


W1 = Workload("W1", 12, 1024, 16, 8, 1024)
W2 = Workload("W2", 24, 4096, 32, 2, 2048)
TINY = Workload("tiny", layers=2, d=64, heads=2, batch=2, seq=32)


@dataclass(frozen=True)
class Shape:
    """A transformer's sizes and a step's tokens (``batch`` sequences of ``seq``), as the Hugging Face
    workloads here (Llama, hf.HF) are built from."""

    name: str
    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


@dataclass(frozen=True)
class Llama(Shape):
    """Issue 40's workload: a Hugging Face LlamaForCausalLM built from a config (random weights, no
    hub access), trained on random tokens given as both input_ids and labels, so its loss (logits
    and cross-entropy included) runs inside the method's context. Its blocks are the decoder layers;
    ``ckpt`` is Hugging Face's own non-reentrant gradient checkpointing, of the first ``ckpt_blocks``
    layers only where that is set."""

    attn: str = "sdpa"
    ckpt_blocks: int | None = None

    def model(self, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM  # the bench extra: W1/W2 runs need none of it

        cfg = LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.mlp,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, max_position_embeddings=self.seq,
                          use_cache=False)  # training: no KV cache kept beside what autograd saves
        cfg._attn_implementation = self.attn
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).to(device, dtype)

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        model = self.model(device, seed=seed)
        first = self.layers if ckpt else self.ckpt_blocks
        if first:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            for layer in model.model.layers[first:]:
                layer.gradient_checkpointing = False
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=torch.Generator().manual_seed(seed + 1))
        return model, ids.to(device)

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    @staticmethod
    def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    @staticmethod
    def objective(loss: torch.Tensor) -> torch.Tensor:
        return loss


# 16 layers, hidden 2048, MLP 5632, 16 heads / 4 KV heads, batch 4 x 2048. W3L: no offload's peak grows
# by about 3.4 GiB a sample, so 24 samples (about 83 GiB of activations) do not fit an 80 GB GPU
# without help and leave a 128 GiB host room for all of them.
W3 = Llama("W3", layers=16, hidden=2048, mlp=5632, heads=16, kv_heads=4, vocab=32000, batch=4, seq=2048)
W3L = dataclasses.replace(W3, name="W3L", batch=24)
W3_TINY = Llama("W3-tiny", layers=2, hidden=64, mlp=128, heads=4, kv_heads=2, vocab=256, batch=2, seq=32)
WORKLOADS = {w.name: w for w in (W1, W2, TINY, W3, W3L, W3_TINY)}


def workloads(names: list[str], batch: int | None = None, layers: int | None = None) -> list[Workload | Llama]:
    """The WORKLOADS named, at another batch or depth where given, the name saying so (W1_B256, W3_L4)."""
    chosen = [WORKLOADS[name] for name in names]
    if batch:  # e.g. W1 at a batch whose activations do not fit on the GPU
        chosen = [dataclasses.replace(w, name=f"{w.name}_B{batch}", batch=batch) for w in chosen]
    if layers:  # e.g. a smoke run of W3 on fewer layers
        chosen = [dataclasses.replace(w, name=f"{w.name}_L{layers}", layers=layers) for w in chosen]
    return chosen


@dataclass(frozen=True)
class Variant:
    """A workload built another way: compiled as one graph (``compile="graph"``:
    torch.compile(model), with storm.partitioner(**``partitioner``) where given) or block by block
    (``"blocks"``: each block's .compile(); ``"planner"``: none, storm.enable's compile_blocks compiles
    them), at torch's activation_memory_budget ``memory_budget``
    (through the partitioner's own ``memory_budget``, nothing offloaded unless ``partitioner`` says:
    a global config change is not part of dynamo's cache key, so a second model of the same class,
    compiled under another budget while the first's graph is cached, would run the first's graph),
    and/or checkpointed (``ckpt``). Whoever builds rows of it clears dynamo's compiled code first
    (fresh_dynamo)."""

    base: Workload | Llama
    ckpt: bool = False
    compile: str | None = None
    memory_budget: float | None = None
    partitioner: dict | None = None  # compiled as one graph with storm.partitioner(**partitioner)

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def batch(self) -> int:
        return self.base.batch

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
        model, x = self.base.build(device, ckpt=ckpt or self.ckpt, seed=seed)
        options = {}
        if self.partitioner is not None or self.memory_budget is not None:
            opts = self.partitioner if self.partitioner is not None else {"mode": "embedded", "budget": 0}
            if self.memory_budget is not None:
                opts = {**opts, "memory_budget": self.memory_budget}
            options = {"custom_partitioner_fn": storm.partitioner(**opts)}
        if self.compile == "graph":
            model = torch.compile(model, options=options)
        elif self.compile == "blocks":
            for block in self.base.blocks(model):
                block.compile(options=options)
        return model, x

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return self.base.blocks(getattr(model, "_orig_mod", model))  # torch.compile's wrapper holds the model

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.base.forward(model, x)

    def objective(self, y: torch.Tensor) -> torch.Tensor:
        return self.base.objective(y)


def fresh_dynamo(ws: Iterable[object]) -> None:
    """Clear torch._dynamo's compiled code where any of ``ws`` is a compiled Variant: every row
    compiles the same code again, and dynamo keeps only a few compiled versions of one function
    (later ones run uncompiled). Once before a row's or a duel's models are built, not between
    them: a model built before a reset compiles again at its next step, inside the timed rounds."""
    if any(isinstance(w, Variant) and w.compile for w in ws):
        torch._dynamo.reset()


# The device and the link

def cuda_device(script: str, hint: str = "") -> torch.device | None:
    """The CUDA device a benchmark that measures only there runs on; None, having said so on
    stderr (naming ``script``, then ``hint``), where torch sees none."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    print(f"bench/{script} measures on CUDA and torch sees no CUDA device here{hint}", file=sys.stderr)
    return None


def link_bandwidth(device: torch.device, nbytes: int = GiB, tries: int = 3) -> dict[str, float]:
    """Pinned D2H and H2D GB/s, measured here, now (machines drift): the best of ``tries``, each
    direction, as the link's speed is what the lower bounds need and a lent host's first
    measurement can come in low."""
    d2h, h2d = (max(v) for v in zip(*(storm.planner.link_bandwidth(device, nbytes) for _ in range(tries))))
    return {"d2h_GBps": round(d2h, 1), "h2d_GBps": round(h2d, 1)}


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's name where ``device`` is CUDA (default: where torch sees one), else "cpu"."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# A stormd for one run

def start_daemon(workdir: Path, pool_size: str, *flags: str, log: Path | None = None,
                 python_args: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """A stormd for this benchmark (stormd.launch.start_stormd; ``python_args`` before ``-m stormd``, such
    as a profiler's): the process and its endpoint."""
    return start_stormd(workdir, pool_size, *flags, log=log, python_args=python_args)


def stop_daemon(proc: subprocess.Popen) -> None:
    """Say BYE for this process's sessions, then stop ``proc``: a session still holding keys makes
    stormd wait out its drain deadline before it stops."""
    storm.close_all()
    proc.terminate()
    proc.wait(30)


# One method's training steps

def torchtune_offload() -> type:
    """torchtune's OffloadActivations (torchtune.training), imported without running the ``__init__``
    of torchtune and of torchtune.training: those import torchtune's datasets, models and
    checkpointing (Hugging Face datasets, torchdata, ...), which OffloadActivations does not use.
    ImportError, saying what is missing, where torchtune or its torchao is not installed."""
    import importlib.util

    for name in ("torchtune", "torchtune.training"):
        if name not in sys.modules:
            spec = importlib.util.find_spec(name)
            if spec is None:
                raise ImportError(f"{name} is not installed (bench/on_device.sh installs the wheels in .whl/)")
            sys.modules[name] = importlib.util.module_from_spec(spec)  # its package path, its __init__ not run
    return importlib.import_module("torchtune.training._activation_offloading").OffloadActivations


def method_context(method: str, opts: dict, planner: storm.Planner | None = None) -> Any:
    """The context ``method``'s forward runs in: torch's save_on_cpu(pin_memory=True), torchtune's
    OffloadActivations(**opts), storm.offload(**opts), ``planner``'s step; none for "none",
    "checkpoint" (the model was built so) and "enable" (storm.enable's hooks enter STORM's)."""
    if method == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    if method == "torchtune":
        return torchtune_offload()(**opts)
    if method == "storm":
        return storm.offload(**opts)
    if method == "plan":
        return planner.step()
    return contextlib.nullcontext()


def train_step(w: Workload | Llama | Variant, model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer,
               method: str, opts: dict, planner: storm.Planner | None = None) -> storm.Offload | None:
    """One step of ``method`` on ``w``'s model: its forward in method_context, backward from
    w.objective, an SGD step. The storm.Offload of a "storm" or "plan" step, else None."""
    with method_context(method, opts, planner) as ctx:
        y = w.forward(model, x)
    w.objective(y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ctx if method in ("storm", "plan") else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_digest(loss: torch.Tensor, model: nn.Module) -> str:
    """A hash of a step's loss and every gradient of ``model``, byte for byte, as the optimizer sees
    them (FSDP2: this rank's shards): two steps are bit-identical where their digests are equal."""
    h = xxhash.xxh3_64()
    for t in [loss.detach(), *(p.grad for p in model.parameters())]:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


class Trainer:
    """One method's model, optimizer and (for "plan") planner on the device, stepped by train_step.
    Method "enable" is ``storm.enable(model, **opts)``, as a user turns STORM on: its handle's
    planner (with budget= or peak=) is the Trainer's, and the handle is disabled at close()."""

    def __init__(self, w: Workload | Llama | Variant, method: str, opts: dict, device: torch.device):
        self.w, self.method, self.opts, self.device = w, method, opts, device
        self.model, self.x = w.build(device, ckpt=(method == "checkpoint"))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.handle = storm.enable(self.model, **opts) if method == "enable" else None
        self._plan = storm.plan(w.blocks(self.model), **opts) if method == "plan" else None
        self.last: storm.Offload | None = None

    @property
    def planner(self) -> storm.Planner | None:
        """storm.plan's, or the handle's, read each time: storm.enable makes its planner again where
        the first forward runs the model's block lists otherwise than found (storm/blocks.py)."""
        return self.handle.planner if self.handle is not None else self._plan

    def warm(self, steps: int) -> None:
        """``steps`` steps, and as many more (up to 160) as storm.plan needs to settle: it traces
        two steps (three with peak=), plans at the next, on CUDA measures planned steps until one
        is within its target (up to 4), resetting the peak statistics, reads a second offloading
        step's host time, and tries its plan against the best of the other kind, then in the
        other recompute form, in alternation (10 to 18 steps each trial)."""
        for _ in range(steps):
            self.step()
        for _ in range(160):  # a planner compiling the blocks traces each budget and tries those near the least
            if self.planner is None or self.planner.settled:
                break
            self.step()

    def step(self) -> float:
        """One training step, device work included: seconds."""
        t0 = time.perf_counter()
        self.last = train_step(self.w, self.model, self.x, self.opt, self.method, self.opts, self.planner)
        if self.handle is not None:
            self.last = self.handle.last
        synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.handle is not None:
            self.handle.disable()  # closes its planner
        elif self.planner is not None:
            self.planner.close()
        del self.model, self.x, self.opt, self.last
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            empty_host_cache()


def host_available() -> int | None:
    """Bytes of host memory this process may still take: /proc/meminfo's MemAvailable, or what
    its memory cgroup may still charge where that is less (a container's limit, whose OOM killer
    acts before the host's); None where neither is known."""
    try:
        available = meminfo().get("MemAvailable")
    except OSError:
        available = None
    known = [n for n in (available, cgroup_room()) if n is not None]
    return min(known, default=None)


def empty_host_cache() -> None:
    """Give back the page-locked host memory torch's host caching allocator keeps after its tensors
    are freed: save_on_cpu's and torchtune's copies are such tensors, and a row that offloads a long
    sequence's saves would otherwise leave its pages cached beside the next row's, until the host
    runs out (the zoo's t5-long cell was killed so). torch.accelerator.empty_host_cache where this
    torch has it, else the CUDA binding it wraps."""
    gc.collect()  # tensors kept alive only by reference cycles (a closed trainer's graph) go first
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def alternate(trainers: Sequence[Trainer], rounds: int, steps: int, order: random.Random) -> list[list[list[float]]]:
    """``rounds`` rounds of ``steps`` steps of each of ``trainers``, side by side on the device, each
    round in an order shuffled by ``order`` (so that none always runs after the same one): per
    trainer, per round, its steps' seconds. The lent machines drift by 10 to 40% within a run, and
    rows measured minutes apart would compare that drift too."""
    times: list[list[list[float]]] = [[] for _ in trainers]
    for _ in range(rounds):
        turns = list(zip(times, trainers))
        order.shuffle(turns)
        for r, trainer in turns:
            r.append([trainer.step() for _ in range(steps)])
    return times


def plan_summary(pl: storm.Planner) -> dict:
    """What a storm.plan chose and predicted, for a results row."""
    p = pl.plan
    return {"full_offload": p.full, "offloaded_blocks": p.offloaded, "recomputed_blocks": sorted(p.recomputed),
            "inputs_offloaded_blocks": p.inputs_offloaded, "compressed": p.compressed,
            "max_held_bytes": p.max_held_bytes, "prefetch_bytes": p.prefetch_bytes,
            "predicted_peak_GiB": round(p.predicted_peak / GiB, 3), "predicted_cost_ms": p.predicted_cost_ms,
            "fits": p.fits, "reentrant": p.reentrant, "settled": pl.settled,
            # where the planner compiles the blocks (compile_blocks): their partitioner's budget, kept
            # of the budgets it traced (planners before it had none)
            "block_budget": getattr(pl, "block_budget", None),
            "budgets_weighed": [{"budget": t.budget, "cost_ms": round(t.cost_ms, 3), "fits": t.fits}
                                for t in getattr(getattr(pl, "search", None), "tried", [])],
            "target_GiB": pl.target and round(pl.target / GiB, 3),
            "besides_GiB": pl.besides and round(pl.besides / GiB, 3), "kept_extra_GiB": round(pl.kept_extra / GiB, 3),
            "start_extra_GiB": round(pl.start_extra / GiB, 3),
            "trial": "; ".join(t.describe() for t in pl.trials) or None,
            # the blocks' forward and backward on the compute stream, as the traces timed them: the
            # link model takes backward as twice forward (model.Offloading.of), which these tell
            "blocks_forward_ms": round(pl.trace.blocks_forward_ms, 3),
            "blocks_backward_ms": pl.trace.backward_device_ms and round(pl.trace.backward_device_ms, 3),
            # bytes this plan's own measured step went over (under) its target; None: not measured. As
            # the planner recorded it: the plan in force may be a trial's alternative applied as made
            "over_bytes": pl.state.measured.get(p.shape, p).measured_over,
            # the plans whose step the planner measured, in order, and what each went over (under) its target:
            # where no plan fits, the search's course
            "measured": [{"full_offload": m.full, "offloaded_blocks": m.offloaded,
                          "inputs_offloaded_blocks": m.inputs_offloaded,
                          "recomputed": len(m.recomputed), "compressed": m.compressed,
                          "max_held_MiB": round(m.max_held_bytes / MiB, 1),
                          "prefetch_MiB": round(m.prefetch_bytes / MiB, 1),
                          "over_MiB": round(m.measured_over / MiB, 1)}
                         for m in pl.state.measured.values()],
            # per moment (each block's backward, then backward's start), what the model predicted the
            # step holds and what the plan's first measured step (and the compute trace's) held there
            "moments_MiB": moments_mib(pl.peak_moments()), "traced_moments_MiB": moments_mib(pl.traced_moments())}


def moments_mib(at: list[tuple[int, int | None]] | None) -> dict | None:
    """Planner.peak_moments' pairs as two lists of MiB, predicted and measured."""
    if at is None:
        return None
    return {"predicted": [round(p / MiB, 1) for p, _ in at],
            "measured": [None if m is None else round(m / MiB, 1) for _, m in at]}


def run(w: Workload | Llama | Variant, method: str, steps: int, warmup: int, opts: dict, device: torch.device,
        more: Callable[[Trainer], dict] | None = None) -> dict:
    """``method`` on ``w`` (a Trainer) on CUDA: the median step and its peak above the start, and
    for an offloading method what moved, and what ``more`` reads from the Trainer after its steps;
    {"error": "OOM"} where it ran out of memory, and the exception's type and message where it
    raised another."""
    t = None
    warned = WarningLog()
    logging.getLogger("storm").addHandler(warned)
    try:
        fresh_dynamo([w])
        t = Trainer(w, method, opts, device)
        t.warm(warmup)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        times = [t.step() for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(device) - base
        r = {"step_ms": round(statistics.median(times) * 1e3, 2),
             "step_ms_min": round(min(times) * 1e3, 2),
             "samples_per_s": round(w.batch / statistics.median(times), 2),
             "peak_extra_GiB": round(peak / GiB, 3), "peak_bytes": peak}
        if method == "none":  # forward alone: how many bytes its duration could carry to the host
            fwd = []
            for _ in range(3):
                t0 = time.perf_counter()
                y = w.forward(t.model, t.x)
                torch.cuda.synchronize(device)
                fwd.append(time.perf_counter() - t0)
                del y
            r["forward_ms"] = round(statistics.median(fwd) * 1e3, 2)
        if t.last is not None:
            t.last.synchronize()
            st = t.last.stats
            ratio = st.offloaded_bytes / st.stored_bytes if st.stored_bytes else 1.0
            # fetched_bytes counts tensors' sizes; each comes back as it was stored
            r.update(to_host_GiB=round(st.stored_bytes / GiB, 3),
                     to_device_GiB=round(st.fetched_bytes / ratio / GiB, 3),
                     offloaded_GiB=round(st.offloaded_bytes / GiB, 3), ratio=round(ratio, 3),
                     frame_overflows=st.frame_overflows, offloaded_tensors=st.offloaded, kept=dict(st.kept),
                     fetch_wait_ms=round(st.fetch_wait_s * 1e3, 2), backend=t.last.backend_name,
                     # the training thread's time in packs, against offloaded_tensors: across a run's plans,
                     # what a step pays once and what each tensor pays (storm.plan's host time per tensor)
                     pack_ms=round(st.pack_s * 1e3, 3))
        if t.planner is not None:
            r.update(plan=plan_summary(t.planner), explain=t.planner.explain())
        if more is not None:
            r.update(more(t))
    except Exception as e:  # a method that cannot run here (torchtune missing, a compile failing): the row says why
        r = failure(e)
    finally:
        logging.getLogger("storm").removeHandler(warned)
        if t is not None:
            t.close()
    if warned.messages:
        r["warnings"] = warned.messages
    return r


def failure(e: Exception) -> dict:
    """What a row (or a duel) that raised ``e`` records: {"error": "OOM"} where it ran out of
    memory, else the exception's type and message."""
    return {"error": "OOM" if isinstance(e, torch.OutOfMemoryError) else f"{type(e).__name__}: {e}"}


class WarningLog(logging.Handler):
    """STORM's warnings while a row ran, each once, for its results: a row may be judged by
    whether it warned (a model compiled as one graph)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# Results with their provenance

def commit(repo: Path = REPO) -> str:
    """$STORM_COMMIT when set (the lent GPU machine gets a copy of the tree whose .git, if any, is
    not this checkout's), else the checkout's HEAD, with "+uncommitted" where tracked files differ
    from it (code that no commit holds: on the lent machine, a .git older than the tree it was
    copied with), else "unknown"."""
    if os.environ.get("STORM_COMMIT"):
        return os.environ["STORM_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    head = git.stdout.strip()
    if git.returncode != 0 or not head:
        return "unknown"
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=repo, capture_output=True).returncode
    return head + "+uncommitted" * (changed != 0)


def meta(device: torch.device | str | None = None, **extra: object) -> dict:
    """Which code, where and how: the device, torch, the date (UTC), the commit, the command and
    $CUBLAS_WORKSPACE_CONFIG (which decides whether cuBLAS is deterministic)."""
    return {"device": device_name(device), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), **extra}


def write(out: str | Path, results: dict, device: torch.device | str | None = None, **extra: object) -> None:
    """``results`` as JSON at ``out``, with their ``meta`` (meta(device, **extra)); rewritten as a
    run goes, so what is done survives a time limit."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")  # a run killed mid-write leaves the last whole file to --resume from
    part.write_text(json.dumps({**results, "meta": meta(device, **extra)}, indent=1) + "\n")
    part.replace(out)
