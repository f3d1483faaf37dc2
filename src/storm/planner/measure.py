"""What the planner measures on the device: a step's peak memory, the link's bandwidth, what
frames cost and which storages a frame codec would frame; and what it makes of a planned step's
measurements (margins, the host time of its packs). docs/planner.md ("Margins") explains why.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import torch

from storm.kernels.frame import decode_frame, encode_frame, frame_nbytes

from ..frames import FRAME_MIN_BYTES, frame_bytes, frame_codec
from ..stats import OffloadStats
from .records import Trace

if TYPE_CHECKING:  # wiring.py's hooks are handed in: measure.py needs their type alone
    from .wiring import BlockHooks

MiB = 1 << 20
GiB = 1 << 30
FRAME_DEVICE_BYTES = 64 * MiB  # large enough that the codec's kernels, not their launches, set its device time
MAX_CHECKS = 4  # planned steps measured after a trace: the first plan and up to three corrections
# where no plan is predicted to fit, as many planned steps measure the plans of least peak in turn: their
# copy queue and prefetch window move a peak the model misjudges, so that the four lowest can be variants
# of one plan measured alike while a plan that offloads a block's inputs fewer measures lower
MAX_SEARCH = 8
# with peak=, once the model predicted a plan measured within the target long, a cheaper plan predicted over
# the target by as much, up to this share of the target (1/100), is measured too (near_slack)
NEAR_SHARE = 100
HOST_CHECK_STEP = 2  # the planned step that offloads whose host time per tensor is checked (the first warms up)
HOST_CHECK_TOLERANCE = 1.5  # measured over traced by more than this: plan with the measured (not noise)


def checks_for(plan_fits: bool) -> int:
    """How many planned steps a trace may measure: MAX_CHECKS, or MAX_SEARCH where the plan in
    question was predicted not to fit."""
    return MAX_CHECKS if plan_fits else MAX_SEARCH


class PeakMemory(Protocol):
    """A step's peak GPU memory above its start: what a Planner's ``memory=`` gives."""

    available: bool  # whether peak() reads anything

    def start(self) -> None:
        """The step starts now: its peak is counted from here."""

    def restart(self) -> None:
        """From now on peak() reads the peak since now (still above the step's start): backward
        has reached the blocks. Optional: without it the planner reads one peak for the whole
        step, and plans count backward's start as a block's backward."""

    def peak(self) -> int | None:
        """The peak since start() (or the last restart()), above what was allocated at start();
        None where not available."""


class CudaPeakMemory:
    """PeakMemory from the CUDA caching allocator (resetting its peak statistics at each start);
    elsewhere not available."""

    def __init__(self, device: torch.device):
        self.device, self.available, self._base = device, device.type == "cuda", 0

    def start(self) -> None:
        if self.available:
            self.restart()
            self._base = torch.cuda.memory_allocated(self.device)

    def restart(self) -> None:
        if self.available:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) - self._base if self.available else None


class StepPeak:
    """A step's peak memory, reset now and read as backward reaches each block and when the
    step's backward ends (before the optimizer and whatever else the caller does between steps):
    ``measured``; apart (``parts``) until backward reached the blocks (forward, the loss's and the
    head's backward) and from there; and ``moments``, laid out as held.moments predicts them: per
    block i, the peak from backward reaching it until it reaches the next block (block 0's until
    backward ends), then the part before the blocks, which ends as backward reaches the last block
    (a block reached before it, of blocks listed in another order than they run, has no moment of
    its own). ``moments`` None for a step of several forwards, whose blocks' backwards interleave
    otherwise than the model adds them up; ``measured`` None where backward never reached the
    blocks or peaks cannot be measured; ``parts`` and ``moments`` None too for a memory= without
    restart(). Without ``each_block`` (a step timed in a trial, which needs its peak alone) the
    blocks' part is read once, not at each block, and ``moments`` is None."""

    def __init__(self, memory: PeakMemory, hooks: BlockHooks, each_block: bool = True):
        self.measured: int | None = None
        self.parts: tuple[int, int] | None = None
        self.moments: list[int | None] | None = None
        if not memory.available:
            return
        memory.start()
        if getattr(memory, "restart", None) is None:  # a memory= of a user's without restart(): one figure
            def whole() -> None:
                self.measured = memory.peak()

            hooks.at_backward_end(whole)
            return
        n = len(hooks.blocks)
        peaks: list[int | None] = [None] * (n + 1)  # held.moments' layout: backward's start last
        now = n  # the part the step is in: before the blocks until backward reaches the last one

        def close() -> None:
            peak = memory.peak()
            memory.restart()
            if peak is not None:
                peaks[now] = max(peak, peaks[now] or 0)

        def reached(i: int) -> None:
            nonlocal now
            if now == n and i != n - 1:
                return  # backward's start runs on until the last block: as at_backward_end reads it
            close()
            now = i

        def read() -> None:
            close()
            blocks = [p for p in peaks[:n] if p is not None]
            start = peaks[n]
            if start is not None and blocks:
                self.parts = (start, max(blocks))
                self.measured = max(self.parts)
                self.moments = peaks if each_block and max(hooks.calls) <= 1 else None
            else:
                self.measured = max(blocks, default=start)

        if each_block:
            hooks.at_each_backward(reached)
            hooks.at_backward_end(read)
        else:
            hooks.at_backward_end(read, lambda: reached(n - 1))


def widened_margin(margin: int, beyond: int, target: int) -> int:
    """The margin plans of one kind leave after a step of that kind took ``beyond`` bytes more
    than its prediction and went over ``target``: at least that and a little more, as copy
    timing varies between steps, and more than before, so corrections always move the plan."""
    return max(margin + MiB, beyond + max(MiB, target // 200))


def near_slack(target: int, long_by: int) -> int:
    """How far over ``target`` (peak=) a plan may be predicted and still be measured, once the model
    predicted a plan that measured within it ``long_by`` bytes over its measured peak: by as much,
    up to NEAR_SHARE of the target (the model's miss differs from plan to plan, and the step
    measured could go over by it); 0 where the model was not long."""
    return max(0, min(long_by, target // NEAR_SHARE))


def packs_ms_per_tensor(stats: OffloadStats) -> tuple[float | None, float | None]:
    """A step's host time per offloaded tensor, pack and unpack as a trace counts it (unpacks
    cost about what packs do): of those sent raw, and of those sent in frames; each None where
    the step sent none of that kind."""
    raw = stats.packs - stats.framed
    return (2e3 * (stats.pack_s - stats.frame_pack_s) / raw if raw > 0 else None,
            2e3 * stats.frame_pack_s / stats.framed if stats.framed else None)


def host_from_packs(trace: Trace, stats: OffloadStats,
                    tolerance: float = HOST_CHECK_TOLERANCE) -> tuple[float | None, float | None]:
    """What a planned step's packs say of the trace's host figures where they cost more: per
    tensor sent raw (host_ms_per_tensor), and what a frame adds to a tensor's (beyond the raw
    figure: frame_host_ms_per_tensor, which the trace takes from a microbenchmark of one frame's
    kernels, not from a step); each None where the step says nothing dearer of it. A frame's is
    weighed only where the trace framed saves of the blocks (the model charges frames there alone)
    and against the raw figure the model will charge beside it."""
    raw, framed = packs_ms_per_tensor(stats)
    host = raw if raw is not None and dearer_packs(raw, trace.host_ms_per_tensor, tolerance) else None
    frame = None
    if framed is not None and any(b.framed for b in trace.blocks):
        beyond = framed - (host if host is not None else trace.host_ms_per_tensor)
        frame = beyond if dearer_packs(beyond, trace.frame_host_ms_per_tensor, tolerance) else None
    return host, frame


def dearer_packs(measured: float, traced: float, tolerance: float = HOST_CHECK_TOLERANCE) -> bool:
    """Whether a planned step's packs cost enough more than the trace's (over ``tolerance``
    times: not noise) to plan with them: the offload trace's median block leaves out what an
    offloading step pays at its first block, and all its saves go. Not where they cost less: a
    plan of fewer offloads must not bring back a dearer one."""
    return measured > tolerance * traced


def link_bandwidth(device: torch.device, nbytes: int = 256 * MiB) -> tuple[float, float]:
    """GB/s to the host and back, pinned, measured now (machines drift). On CPU: a copy's speed."""
    if device.type != "cuda":
        a = torch.empty(nbytes // 4, dtype=torch.uint8)
        b = torch.empty_like(a)
        b.copy_(a)
        t0 = time.perf_counter()
        b.copy_(a)
        gbps = nbytes // 4 / (time.perf_counter() - t0) / 1e9
        return gbps, gbps
    g = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for fn in (lambda: h.copy_(g, non_blocking=True), lambda: g.copy_(h, non_blocking=True)):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        out.append(3 * nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return out[0], out[1]


def frames_of(saves: Iterable[Any], setting: str = "auto") -> tuple[int, int, int]:
    """Of these offloaded storages (session.Stored: device, dtype, nbytes), how many codec ``setting``
    (a frame codec) puts in frames (frames.frame_codec, as the mover decides), their bytes, and their
    frames' bytes. Float32 saves count at their float32 frames' size, upcasts (.float() of bf16) too:
    whether one is an upcast its bytes say, and those are not read here."""
    framed = [(codec, s.nbytes) for s in saves
              if (codec := frame_codec(setting, s.device.type, str(s.dtype).removeprefix("torch."), s.nbytes))]
    return len(framed), sum(b for _, b in framed), sum(frame_bytes(codec, b) for codec, b in framed)


def frame_costs(device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """What frames cost, measured now, the median of ``repeats``: the training thread's ms per
    framed tensor, the host side of encoding and decoding one FRAME_MIN_BYTES bf16 tensor
    (buffers and kernel launches; the device's work runs on the mover's codec streams); and the
    device's ms per GiB framed, encoding and decoding a FRAME_DEVICE_BYTES one. (0, 0) off CUDA,
    where nothing is framed."""
    if device.type != "cuda":
        return 0.0, 0.0
    # a generator of its own: the default one's draws are the program's (its dropout masks), and
    # a trace measured between a seed and the step it seeds would change what the step draws
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    small, large = (torch.randn(n // 2, dtype=torch.bfloat16, device=device, generator=gen)
                    for n in (FRAME_MIN_BYTES, FRAME_DEVICE_BYTES))

    def code(t: torch.Tensor) -> None:
        frame = torch.empty(frame_nbytes(t.numel()), dtype=torch.uint8, device=device)
        encode_frame(t, frame)
        decode_frame(frame, t.numel())

    host, dev = [], []
    for _ in range(repeats + 1):  # the first also compiles the kernels
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        code(small)
        host.append(time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        code(large)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end))
    return statistics.median(host[1:]) * 1e3, statistics.median(dev[1:]) * GiB / FRAME_DEVICE_BYTES
