"""What the benchmarks share: the workloads, the device they measure on, the link's speed, a
stormd for one run, one method's training steps, and results written with their provenance.

A script run as ``python bench/<name>.py`` has bench/ on its path and imports this as ``common``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import storm
from stormd.launch import start_stormd

GiB = 1 << 30
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


W1 = Workload("W1", 12, 1024, 16, 8, 1024)
W2 = Workload("W2", 24, 4096, 32, 2, 2048)
TINY = Workload("tiny", layers=2, d=64, heads=2, batch=2, seq=32)


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

def start_daemon(workdir: Path, pool_size: str, *flags: str, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A stormd for this benchmark (stormd.launch.start_stormd): the process and its endpoint."""
    return start_stormd(workdir, pool_size, *flags, log=log)


def stop_daemon(proc: subprocess.Popen) -> None:
    """Say BYE for this process's sessions, then stop ``proc``: a session still holding keys makes
    stormd wait out its drain deadline before it stops."""
    storm.close_all()
    proc.terminate()
    proc.wait(30)


# One method's training steps

def train_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, method: str, opts: dict,
               planner: storm.Planner | None = None) -> storm.Offload | None:
    """One step of ``method``: "none" or "checkpoint" (the model was built so), "save_on_cpu",
    "storm" (storm.offload(**opts)) or "plan" (``planner``'s step)."""
    ctx = None
    if method == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            y = model(x)
    elif method == "storm":
        with storm.offload(**opts) as ctx:
            y = model(x)
    elif method == "plan":
        with planner.step() as ctx:
            y = model(x)
    else:
        y = model(x)
    y.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ctx


class Trainer:
    """One method's model, optimizer and (for "plan") planner on the device, stepped by train_step."""

    def __init__(self, w: Workload, method: str, opts: dict, device: torch.device):
        self.method, self.opts, self.device = method, opts, device
        self.model, self.x = w.build(device, ckpt=(method == "checkpoint"))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.planner = storm.plan(self.model.blocks, **opts) if method == "plan" else None
        self.last: storm.Offload | None = None

    def warm(self, steps: int) -> None:
        """``steps`` steps, and as many more (up to 50) as storm.plan needs to settle: it traces
        two steps (three with peak=), plans at the next, on CUDA measures planned steps until one
        is within its target (up to 4), resetting the peak statistics, reads a second offloading
        step's host time, and tries its plan against the best of the other kind, then in the
        other recompute form, in alternation (10 to 18 steps each trial)."""
        for _ in range(steps):
            self.step()
        for _ in range(50):
            if self.planner is None or self.planner.settled:
                break
            self.step()

    def step(self) -> float:
        """One training step, GPU work included: seconds."""
        t0 = time.perf_counter()
        self.last = train_step(self.model, self.x, self.opt, self.method, self.opts, self.planner)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()
        del self.model, self.x, self.opt, self.last
        torch.cuda.empty_cache()


def plan_summary(pl: storm.Planner) -> dict:
    """What a storm.plan chose and predicted, for a results row."""
    p = pl.plan
    return {"offloaded_blocks": p.offloaded, "recomputed_blocks": sorted(p.recomputed),
            "inputs_offloaded_blocks": p.inputs_offloaded, "compressed": p.compressed,
            "predicted_peak_GiB": round(p.predicted_peak / GiB, 3), "predicted_cost_ms": p.predicted_cost_ms,
            "fits": p.fits, "reentrant": p.reentrant, "settled": pl.settled,
            "target_GiB": pl.target and round(pl.target / GiB, 3),
            "besides_GiB": pl.besides and round(pl.besides / GiB, 3), "kept_extra_GiB": round(pl.kept_extra / GiB, 3),
            "trial": "; ".join(t.describe() for t in pl.trials) or None}


def run(w: Workload, method: str, steps: int, warmup: int, opts: dict, device: torch.device) -> dict:
    """``method`` on ``w`` (a Trainer) on CUDA: the median step and its peak above the start, and
    for an offloading method what moved; {"error": "OOM"} where it ran out of memory."""
    t = Trainer(w, method, opts, device)
    try:
        t.warm(warmup)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        times = [t.step() for _ in range(steps)]
        r = {"step_ms": round(statistics.median(times) * 1e3, 2),
             "step_ms_min": round(min(times) * 1e3, 2),
             "samples_per_s": round(w.batch / statistics.median(times), 2),
             "peak_extra_GiB": round((torch.cuda.max_memory_allocated(device) - base) / GiB, 3)}
        if method == "none":  # forward alone: how many bytes its duration could carry to the host
            fwd = []
            for _ in range(3):
                t0 = time.perf_counter()
                y = t.model(t.x)
                torch.cuda.synchronize(device)
                fwd.append(time.perf_counter() - t0)
                del y
            r["forward_ms"] = round(statistics.median(fwd) * 1e3, 2)
        if t.last is not None:
            t.last.synchronize()
            st = t.last.stats
            ratio = st.offloaded_bytes / st.stored_bytes if st.stored_bytes else 1.0
            # fetched_bytes counts tensors' sizes; each comes back as it was stored
            r.update(to_host_GiB=round(st.stored_bytes / GiB, 3), to_device_GiB=round(st.fetched_bytes / ratio / GiB, 3),
                     offloaded_GiB=round(st.offloaded_bytes / GiB, 3), ratio=round(ratio, 3),
                     frame_overflows=st.frame_overflows, offloaded_tensors=st.offloaded, kept=dict(st.kept),
                     fetch_wait_ms=round(st.fetch_wait_s * 1e3, 2), backend=t.last.backend_name)
        if t.planner is not None:
            r.update(plan=plan_summary(t.planner), explain=t.planner.explain())
    except torch.OutOfMemoryError:
        r = {"error": "OOM"}
    t.close()
    return r


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 to 1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# Results with their provenance

def commit() -> str:
    """$STORM_COMMIT when set (the lent GPU machine gets a copy of the tree whose .git, if any, is
    not this checkout's), else the checkout's HEAD, else "unknown"."""
    if os.environ.get("STORM_COMMIT"):
        return os.environ["STORM_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 and git.stdout.strip() else "unknown"


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
    out.write_text(json.dumps({**results, "meta": meta(device, **extra)}, indent=1) + "\n")
