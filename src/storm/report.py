"""Memory over one training step, with and without STORM, as a picture (``--plot``).

What the curve is: the bytes torch's allocator has handed out on the step's
device, relative to the start of the step, at every allocation and free, as
torch's profiler records them (``profile_memory=True``). On CUDA that is what
``torch.cuda.memory_allocated`` counts; on CPU it is the same count for the
CPU allocator, which torch exposes only through the profiler. Either way it
covers every tensor of the process (activations, gradients, temporaries),
not an estimate of the saved ones, and it does not count STORM's pool, which
lives in the daemon's shared memory (or, embedded, in a mapping of its own):
what offload takes out of the process is what the curve shows going away.
The profiler slows the step down, so the time axis is the profiled run's,
not the step time.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

FORWARD, BACKWARD = "storm:forward", "storm:backward"  # spans the step function marks, drawn as phases
_DEVICE_TYPE = {"cpu": 0, "cuda": 1}  # "Device Type" of the profiler's [memory] events


@dataclass
class Timeline:
    label: str
    ms: list[float]          # time since the step started
    mib: list[float]         # allocated on the device, relative to the step's start
    backward_ms: float | None  # when backward began, if the step marked it

    @property
    def peak_mib(self) -> float:
        return max(self.mib, default=0.0)


def memory_timeline(label: str, step: Callable[[], None], device: torch.device) -> Timeline:
    """Run ``step`` once under the profiler and read the device's allocated bytes from its trace.

    ``step`` marks its forward with ``record_function(FORWARD)`` and its
    backward with ``record_function(BACKWARD)`` so the plot shows where backward starts.
    """
    if device.type not in _DEVICE_TYPE:
        raise ValueError(f"memory timelines are drawn for cpu and cuda devices, not {device.type}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    wanted = _DEVICE_TYPE[device.type]
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == wanted
                 and (device.index is None or e["args"].get("Device Id") in (device.index, -1)))
    if not mem:
        raise RuntimeError(f"the profiler recorded no allocation on {device}; nothing to draw")
    spans = {e["name"]: e["ts"] for e in events if e.get("name") in (FORWARD, BACKWARD) and e.get("ph") == "X"}
    t0 = spans.get(FORWARD, mem[0][0])
    base = mem[0][1]
    return Timeline(label, [(ts - t0) / 1e3 for ts, _ in mem], [(b - base) / 2**20 for _, b in mem],
                    (spans[BACKWARD] - t0) / 1e3 if BACKWARD in spans else None)


def plot_memory(timelines: list[Timeline], path: str | Path, title: str,
                size_px: tuple[int, int] = (1200, 600)) -> None:
    """Draw the timelines into a PNG of ``size_px`` pixels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, and none on a training node
    import matplotlib.pyplot as plt

    dpi = 100
    fig, ax = plt.subplots(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi)
    for t in timelines:
        line, = ax.step(t.ms, t.mib, where="post", label=f"{t.label} (peak {t.peak_mib:.1f} MiB)")
        if t.backward_ms is not None:
            ax.axvline(t.backward_ms, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("time in the profiled step (ms); dotted: backward starts")
    ax.set_ylabel("allocated on the device since the step began (MiB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


@contextlib.contextmanager
def progress(total: int, label: str, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """Yields ``advance(line)``: prints a line (unless ``quiet``) and moves a bar one unit of ``total``.

    rich draws the bar (it is already a dependency, for stormctl's tables) with the
    lines scrolling above it; there is no bar when stdout is not a terminal (a log
    file or a pipe gets the plain lines) or when ``quiet``.
    """
    if quiet or not sys.stdout.isatty():
        yield (lambda line: None) if quiet else print
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task(label, total=total)

        def advance(line: str) -> None:
            bar.console.print(line, markup=False, highlight=False)
            bar.advance(task)
        yield advance
