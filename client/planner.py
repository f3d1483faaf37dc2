"""``storm.plan``: keep saved activations under a GPU-memory budget at the least step time,
choosing per block of the model: keep on the device, offload, or recompute in backward, and
whether offloaded tensors go raw or compressed (frames).

    plan = storm.plan(model.blocks, budget="1GiB")  # or a fraction of a step's activation bytes
    plan = storm.plan(model.blocks, peak="6GiB")    # or: the step's peak above its start (CUDA)
    for x in data:
        with plan.step():
            loss = model(x).sum()
        loss.backward()
    print(plan.explain())

Trace. The first step offloads everything, raw, and records per block the bytes it saves
(what offloading or recomputing it removes from the device), how many tensors (each
offloaded one costs host time, measured in the same step: the median block's, as a
process's first offload also sets up the pinned pool), which of them a frame codec would
put in frames (CUDA bf16 storages of at least FRAME_MIN_BYTES, as transfer.Mover.put
decides) with their bytes and their frames' bytes, and its input's bytes (what
recomputing keeps); where the store refused some (a full pool), what it took, which
plans then do not offload beyond. The second recomputes every block and offloads
nothing, and records each block's recompute time in backward (what recomputing it costs),
with events on the compute stream on CUDA, so a launch-bound model's host time counts as it
does in training, and as each block starts in forward how far the host is ahead of the
stream. The planner calls no block beyond the step's own calls and their recomputes. With peak=
(CUDA) and the reentrant form, a third recomputes every block again without Recompute's
hand-over of saved tensors, so that each block's backward holds its saves as a kept block's
does, to measure what a kept block's backward holds beyond a recomputed one's
(``kept_extra``). Each is the least-memory step of its kind. Pinned copy bandwidth
each way is measured once per trace, and, when some tensor would be framed, the training thread's time to encode and
decode one frame (the median of a few on a FRAME_MIN_BYTES bf16 tensor) and the device's
time to encode and decode a GiB (on a FRAME_DEVICE_BYTES one).

Plan. Offloading takes the earliest saves, which backward needs last: the first k
blocks. It costs host time per tensor beyond what the compute stream's lag hides (a
tensor's pack, half its time, behind how far the host had got ahead of the stream by
block k in the compute trace, nothing at the step's start; its unpack behind forward's
slack), and link time: forward stalls while more than the copy queue (one block, or
everything sent) waits for the link during the first k blocks; what is still on the device when forward
ends goes out during backward, and everything comes back during backward (about twice
forward). Offloading compressed (storm.offload codec "ancf_exp") is considered beside raw
whenever some offloaded tensor would be framed: the link then carries the frames instead
of those tensors, which is the same model at a bandwidth scaled by raw bytes over carried
bytes; each framed tensor adds its measured encode and decode time to the host's, and its
bytes the codec's device time, in full: its kernels share the GPU with the step's (a
GPU-bound step, W2 on the lent H100, ran 10 ms slower compressed than raw where a model
without it predicted 6 ms faster).
A codec given in the storm.offload options is kept: a frame codec allows compressed plans
only, another raw ones only. Recomputing block i costs its forward time. For each k, queue
size and raw or compressed, other blocks are recomputed until the predicted peak fits:
each moment of backward over the budget, in the order they come, by the blocks before it
that cost the least time per byte recomputing removes; then those the fit no longer
needs, the dearest first, are kept. The predicted peak is the largest
of backward's start (kept blocks, inputs of recomputed ones, offloaded bytes still on the
device, the prefetch window, and for compressed plans the largest offloaded block's frames, which the host
holds while it encodes or decodes) and each block's backward (what
the blocks before it keep and its own saves, kept, rebuilt or fetched; with ``peak``, also
the parameter gradients backward has allocated by then, traced as those that were None
before the step, and where the block is kept, ``kept_extra``). The fitting plan of least
predicted cost wins; where none fits, the one of least peak, with a warning. When block 0
is called with other input shapes than those traced, the next step traces again.

Measure. The model counts saves and gradients; a step also holds activations' gradients,
temporaries and, when it offloads, copies and fetches whose timing the model only
approximates. On CUDA the compute trace's peak GPU memory above its start, less its
prediction, gives what a step holds besides (``besides``), and each new plan's first
step is measured the same way as its backward ends. Its target is ``peak``, or with
``budget`` its own prediction plus the besides plus the budget its saves leave unused.
Over it, what the step took beyond its prediction becomes a margin that plans of its
kind (offloading, or not) must leave, and the next step plans again, up to three times.
Those steps reset the device's peak-memory statistics (torch.cuda.reset_peak_memory_stats).
The second planned step that offloads also has its packs' host time per tensor read: where
it is over the trace's by more than half, the trace takes it and the next step plans
again, once per trace (_check_host).

Try. The model's costs are approximate, offloading's host time most (W1 on a lent H100:
block 0 offloaded cost 6.0 ms a step where it said 1.2, bench/plan_costs.py). So where
the best plan that offloads and the best that does not both fit, once the chosen one's peak
is settled, the two run in alternation, TRIAL_STEPS steps each (up to TRIAL_MAX_STEPS
while they are within TRIAL_CLOSE of each other), timed on the compute stream from the
step's start to backward's end, and the faster in the median of its differences with the
step beside it is kept (the other only if its first step stayed within its target); once
per trace, and ``explain`` says what each took. Then, where the plan kept recomputes in the
reentrant form, the same plan recomputing with torch's non-reentrant checkpoint is tried the
same way (_other_form says why neither form is faster everywhere). ``settled`` says when no
more measuring, correcting or trying will come.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from typing import Any, Callable, Iterable

import torch
from torch import nn

from storm.kernels.frame import decode_frame, encode_frame, frame_nbytes
from stormd.wire.sizes import parse_size

from .hooks import Offload, parse_budget
from .policy import Keep
from .recompute import Recompute
from .transfer import FRAME_CODECS, FRAME_MIN_BYTES, frameable

log = logging.getLogger("storm")

MiB = 1 << 20
GiB = 1 << 30
FRAME_DEVICE_BYTES = 64 * MiB  # large enough that the codec's kernels, not their launches, set its device time
MAX_CHECKS = 4  # planned steps measured after a trace: the first plan and up to three corrections
HOST_CHECK_STEP = 2  # the planned step that offloads whose host time per tensor is checked (the first warms up)
HOST_CHECK_TOLERANCE = 1.5  # measured over traced by more than this: plan with the measured (not noise)
# A compute trace whose forward took this many times the blocks' own recomputes (and FIRST_CALL_MS more)
# paid first calls: traced again, once
FIRST_CALL_RATIO = 2.0
FIRST_CALL_MS = 1.0
# steps of each of the two plans tried in alternation. A lent H100's host has bursts that slow a
# few steps in a row: W1's trial at b6ab0c9 took a median of 3 steps recomputing 7 blocks at
# 37.73 ms and kept the plan beside it (32.50), which the frontier's duel then timed at 39.36
# where checkpointing took 39.95 (frontier-w1-h100-2026-11-26-b6ab0c9.json). So 5 steps each,
# compared by the median of the differences of steps run one after the other, which a slow
# stretch of the host moves less than it moves either plan's own median
TRIAL_STEPS = 5
# plans closer than this fraction are within a step's noise (W1's form trial at c4b34d3 kept the
# non-reentrant form by 0.9%, 30.84 against 31.12 ms): then up to TRIAL_MAX_STEPS each decide
TRIAL_CLOSE = 0.02
TRIAL_MAX_STEPS = 9


@dataclasses.dataclass
class BlockTrace:
    """One block in the traced steps."""

    saved_bytes: int = 0     # offloadable bytes its forward saved: what offloading or recomputing it removes
    tensors: int = 0         # how many storages that was
    input_bytes: int = 0     # tensors it was called with: what recomputing it keeps
    forward_ms: float = 0.0  # what recomputing it costs
    grad_bytes: int = 0      # parameter gradients its backward allocates (none where they outlive the step)
    framed: int = 0          # of its storages, how many a frame codec puts in frames
    framed_bytes: int = 0    # their bytes
    frame_bytes: int = 0     # and their frames': what the link carries for them when compressed


@dataclasses.dataclass
class Trace:
    """What the plan is made from."""

    blocks: list[BlockTrace]
    before_bytes: int = 0           # offloadable bytes saved before the first block (e.g. embeddings)
    after_bytes: int = 0            # and after the last (e.g. the loss)
    offloaded_before: list[int] = dataclasses.field(default_factory=list)  # bytes offloaded when block i started
    host_ms_per_tensor: float = 0.0  # pack + unpack on the training thread, per offloaded tensor
    frame_host_ms_per_tensor: float = 0.0  # and what encoding and decoding its frame adds, per framed tensor
    frame_device_ms_per_GiB: float = 0.0   # the device's time encoding and decoding frames, per GiB framed
    forward_host_ms: float = 0.0     # forward of the blocks, on the host, nothing offloaded
    forward_device_ms: float = 0.0   # and on the compute stream
    lead_ms: list[float] = dataclasses.field(default_factory=list)  # host ahead of the stream at block i, at the end
    d2h_GBps: float = 0.0
    h2d_GBps: float = 0.0
    store_bytes: int | None = None   # what the store took of the offload trace's saves when it refused some

    @property
    def total_bytes(self) -> int:
        return self.before_bytes + sum(b.saved_bytes for b in self.blocks) + self.after_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    offloaded: int                 # blocks[:offloaded] (and the saves before them) are offloaded
    recomputed: frozenset[int]     # these blocks are recomputed in backward
    offload_budget: int | None     # storm.offload(budget=...) that offloads exactly those saves; None: all
    max_held_bytes: int            # storm.offload's copy queue and prefetch window for the plan
    prefetch_bytes: int
    predicted_peak: int            # saved bytes (with gradients, when choose() counted them) at the peak
    predicted_cost_ms: float       # step time over no offload
    fits: bool
    in_flight_bytes: int = 0       # offloaded bytes (and frames) the peak counts as still on the device
    compressed: bool = False       # offloaded tensors go in frames where they can (codec "ancf_exp")
    reentrant: bool = True         # recomputed blocks in Recompute's reentrant form, else torch's non-reentrant


def kept_bytes(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int]) -> list[int]:
    """Per block, what it keeps on the device from forward to its backward: nothing offloaded,
    a recomputed block's inputs, a kept block's saves."""
    return [0 if i < offloaded else b.input_bytes if i in recomputed else b.saved_bytes
            for i, b in enumerate(trace.blocks)]


def predicted_peak(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int,
                   grads: bool = True, kept_extra: int = 0) -> int:
    """Saved bytes (and with ``grads`` parameter gradients) on the device at the worst moment of
    backward when blocks[:offloaded] are offloaded and ``recomputed`` are recomputed; a kept
    block's backward also holds ``kept_extra``."""
    return max(_moments(trace, offloaded, recomputed, in_flight_bytes, grads, kept_extra))


def _moments(trace: Trace, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int,
             grads: bool, kept_extra: int = 0) -> list[int]:
    """What the device holds as backward reaches each block i (what the blocks before i keep,
    block i's own saves, kept, rebuilt or fetched, and the gradients of blocks i.. by then,
    plus ``kept_extra`` where block i is kept: autograd holds a kept block's saves until each
    node that saved them ends, beside the node's temporaries, where a recomputed or offloaded
    block's are handed over and dropped as the node takes them), and last at backward's start
    (every kept save, offloaded bytes still in flight)."""
    blocks, n = trace.blocks, len(trace.blocks)
    kept = kept_bytes(trace, offloaded, recomputed)
    grad = [b.grad_bytes * grads for b in blocks]
    before = trace.before_bytes * (offloaded == 0) + in_flight_bytes
    start = before + sum(kept) + trace.after_bytes * (offloaded < n) + grad[-1]
    allocated = sum(grad)
    held = []
    for i, b in enumerate(blocks):
        held.append(before + b.saved_bytes + allocated + kept_extra * (i >= offloaded and i not in recomputed))
        before += kept[i]
        allocated -= grad[i]
    return held + [start]


@dataclasses.dataclass(frozen=True)
class _Offloading:
    """What offloading blocks[:k] (raw or compressed) with a copy queue of ``held`` bytes costs and
    leaves on the device."""

    sent: int
    held: int
    host_ms: float
    link_ms: float
    leftover: int      # offloaded bytes still on the device when forward ends
    frames: int = 0    # frame buffers the peak counts beside them
    compressed: bool = False
    codec_ms: float = 0.0  # the codec's kernels on the device

    @property
    def cost_ms(self) -> float:
        return self.host_ms + self.link_ms + self.codec_ms

    @staticmethod
    def of(trace: Trace, k: int, held: int | None, compressed: bool = False) -> list["_Offloading"]:
        """Per copy queue size to consider (``held``, or: one block, and everything sent)."""
        blocks, n = trace.blocks, len(trace.blocks)
        sent = trace.before_bytes * (k > 0) + sum(b.saved_bytes for b in blocks[:k]) + trace.after_bytes * (k == n)
        if not sent:
            return [_Offloading(0, 0, 0.0, 0.0, 0)]
        offloaded = blocks[:k] if compressed else []
        # the link carries frames instead of the framed tensors: the same model, in raw bytes
        # (what the copy queue and the device hold) per ms of link. The saves before and after
        # the blocks (embeddings, the loss: few tensors) are counted raw.
        carried = sent - sum(b.framed_bytes - b.frame_bytes for b in offloaded)
        d2h, h2d = (g * 1e6 * sent / carried for g in (trace.d2h_GBps, trace.h2d_GBps))  # raw bytes per ms
        fwd_ms = sum(b.forward_ms for b in blocks)
        # half of a tensor's host time is its pack, as the first k blocks are launched: the GPU hides
        # it only as far as the host has got ahead of it by then (nothing at the step's start). The
        # other half, its unpack, comes at backward's end, behind as much as forward's slack
        slack_ms = max(0.0, trace.forward_device_ms - trace.forward_host_ms)
        lead_ms = max(0.0, trace.lead_ms[k]) if k < len(trace.lead_ms) else 0.0
        half = (sum(b.tensors for b in blocks[:k]) * trace.host_ms_per_tensor
                + sum(b.framed for b in offloaded) * trace.frame_host_ms_per_tensor) / 2
        host_ms = max(0.0, half - lead_ms) + max(0.0, half - slack_ms)
        # a frame being encoded or decoded sits beside its tensor. Kept simple: the largest block's
        # frames, an upper bound (the caching allocator counts a frame only until the host has
        # queued its copy or decoding and let go of it)
        frames = max((b.frame_bytes for b in offloaded), default=0)
        codec_ms = sum(b.framed_bytes for b in offloaded) / GiB * trace.frame_device_ms_per_GiB
        out = []
        for h in ([held] if held is not None else sorted({min(sent, max(b.saved_bytes for b in blocks[:k])), sent})):
            # forward waits while more than `h` bytes wait for the link, until the first k blocks are done
            stall = max(0.0, (sent - h) / d2h - sum(b.forward_ms for b in blocks[:k]))
            leftover = int(max(0.0, min(h, sent - d2h * (fwd_ms + stall))))
            # what forward did not carry, and all of it back, during backward (about twice forward)
            link = stall + max(0.0, leftover / d2h + sent / h2d - 2 * fwd_ms)
            out.append(_Offloading(sent, h, host_ms, link, leftover, frames, compressed, codec_ms))
        return out


def choose(trace: Trace, budget: int, held_bytes: int | None = None, prefetch_bytes: int | None = None,
           offload_margin: int = 0, grads: bool = False, codec: str | None = None,
           offload: bool | None = None, kept_extra: int = 0) -> Plan | None:
    """The plan of least predicted cost whose predicted peak (of saves, and with ``grads`` of
    parameter gradients too) is at most ``budget`` bytes, less
    ``offload_margin`` for plans that offload (what such plans were measured to take beyond
    their prediction); the least-peak plan, fits=False, when none is. ``held_bytes`` and ``prefetch_bytes``: the
    user's storm.offload options when given, else the plan picks them: a copy queue of one
    block or of everything offloaded; a prefetch window of one block when no kept block
    follows the offloaded ones, else none (prefetch then runs as far ahead as the room the
    planner's hooks report as backward reaches each block). Offloaded tensors go raw or
    compressed, whichever costs less (raw on ties); ``codec``, the user's storm.offload option
    when given, allows only the one it means (compressed for a frame codec). ``offload``: only
    plans that offload (True) or that do not (False); None where there is none (every offload
    more than the store took). ``kept_extra``: what a kept block's backward holds beyond a
    recomputed one's (_moments)."""
    blocks, n = trace.blocks, len(trace.blocks)
    best: Plan | None = None
    lowest: Plan | None = None
    lowest_over = 0  # its predicted peak, margin included, over the budget
    allowed = (False, True) if codec is None else (codec in FRAME_CODECS,)
    for k in range(n + 1) if offload is None else range(1, n + 1) if offload else range(1):
        block = max((b.saved_bytes for b in blocks[:k]), default=0)
        # compressed where allowed and the link would carry fewer bytes (else it is raw by another name)
        frameable = any(b.frame_bytes < b.framed_bytes for b in blocks[:k])
        offloading = [off for compressed in sorted({c and frameable for c in allowed})
                      for off in _Offloading.of(trace, k, held_bytes, compressed)]
        for off in offloading:
            if trace.store_bytes is not None and off.sent > trace.store_bytes:
                continue  # more than the store took: the rest would stay on the device
            room = budget - (offload_margin if off.sent else 0)
            if prefetch_bytes is not None or not off.sent:
                window = prefetch_bytes if off.sent else 0  # nothing offloaded: nothing to fetch
                recomputed, peak, cost = _recompute_until(trace, k, room, off, window, grads, kept_extra)
            else:  # no window while kept blocks follow: backward frees them before it needs the offloaded ones
                window = 0
                recomputed, peak, cost = _recompute_until(trace, k, room, off, 0, grads, kept_extra)
                if all(i in recomputed for i in range(k, n)):
                    window = block
                    recomputed, peak, cost = _recompute_until(trace, k, room, off, block, grads, kept_extra)
            plan = Plan(k, frozenset(recomputed), None if k == n else (trace.offloaded_before[k] if k else 0),
                        off.held, window, peak, round(cost, 3), peak <= room, off.leftover + off.frames + window,
                        off.compressed)
            if plan.fits and (best is None or plan.predicted_cost_ms < best.predicted_cost_ms):
                best = plan
            if lowest is None or peak - room < lowest_over:
                lowest, lowest_over = plan, peak - room
    return best or lowest


def _recompute_until(trace: Trace, k: int, budget: int, off: _Offloading, window: int,
                     grads: bool, kept_extra: int = 0) -> tuple[set[int], int, float]:
    """Blocks past the first k to recompute until the predicted peak fits; with the peak and
    cost reached. Recomputing block j lowers what every later moment holds (the start of
    backward, and each block i > j as backward reaches it) by its saves less its input, and
    no earlier one: so the moments are met in the order backward's blocks come (block 0's,
    then 1's, ..., then backward's start), each by the cheapest blocks in forward ms per byte
    removed (earlier blocks on ties) among those before it. Picking the cheapest anywhere
    first can spend them where no moment over the budget gains (W2's 24 like blocks, with
    later ones 0.2% cheaper each, recomputed 23 where 7 fit). A kept block's own moment also
    holds ``kept_extra``, which recomputing it removes: for that moment it is a candidate too.
    Meeting each moment in turn can leave blocks that later choices made unneeded (like blocks
    traced 1% apart, as noise makes them: 2 recomputed where 1 fit, tests/test_planner.py; W1
    on a lent H100 recomputed 8 where checkpointing the first 7 fit the same cap,
    frontier-w1-h100-2026-11-26-de00e7c.json); those go after, the dearest first, while the
    peak still fits."""
    blocks, n = trace.blocks, len(trace.blocks)
    in_flight = off.leftover + off.frames + window
    gain = [b.saved_bytes - b.input_bytes for b in blocks]
    order = sorted((j for j in range(k, n) if gain[j] > 0), key=lambda j: (blocks[j].forward_ms / gain[j], j))
    # block i's, for i < n (every block past k kept, so each with kept_extra), then backward's start
    moments = _moments(trace, k, set(), in_flight, grads, kept_extra)
    recomputed: set[int] = set()
    for i, held in enumerate(moments):
        lowered = held - sum(gain[j] for j in recomputed if j < i) - kept_extra * (i in recomputed)
        for j in order:
            if lowered <= budget:
                break
            if j <= i and j not in recomputed and (j < i or kept_extra):
                recomputed.add(j)
                lowered -= gain[j] if j < i else kept_extra
    peak = predicted_peak(trace, k, recomputed, in_flight, grads, kept_extra)
    if peak <= budget:
        for j in sorted(recomputed, key=lambda j: (-blocks[j].forward_ms, -j)):
            without = predicted_peak(trace, k, recomputed - {j}, in_flight, grads, kept_extra)
            if without <= budget:
                recomputed.discard(j)
                peak = without
    return recomputed, peak, off.cost_ms + sum(blocks[j].forward_ms for j in recomputed)


class Planner:
    """Keeps the tensors saved in ``blocks`` (the model's repeated layers, run in this order)
    under ``budget`` (bytes such as "8GiB", or a fraction in (0, 1] of a step's offloadable
    bytes), or keeps the step's peak GPU memory above its start under ``peak`` (bytes; CUDA),
    planning from traced steps. Each step: ``with planner.step(): ...``. ``reentrant``: how
    blocks are recomputed (Recompute); False for training that calls torch.autograd.grad or
    backward(inputs=...). ``clock``: what steps and blocks are timed by (Clock: the compute
    stream's, else the host's). Other options go to storm.offload."""

    def __init__(self, blocks: Iterable[nn.Module], budget: int | float | str | None = None, *,
                 peak: int | str | None = None, reentrant: bool = True, clock: Clock | None = None,
                 **offload_options: Any):
        self.blocks = list(blocks)
        self.reentrant = reentrant
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise TypeError("storm.plan needs the model's blocks: a non-empty list (or ModuleList) of modules")
        if "budget" in offload_options or (budget is None) == (peak is None):
            raise TypeError("storm.plan takes one of budget= (the GPU memory saved activations may take: bytes or "
                            "a fraction of a step's) and peak= (the step's peak GPU memory above its start, bytes); "
                            "it sets storm.offload's budget itself")
        self._budget = parse_budget(budget)
        self._peak = None if peak is None else _parse_peak(peak)
        self._memory = _PeakMemory(_device_of(self.blocks))
        self.clock = clock or Clock(_device_of(self.blocks))  # what the traces and trials are timed by
        if self._peak is not None and not self._memory.available:
            raise ValueError("storm.plan's peak= is measured with the CUDA caching allocator and these blocks are "
                             "not on a CUDA device; give budget= (the bytes saved activations may take)")
        checked = Offload(**offload_options)._options  # refuse bad options now, not at the first step
        self._options = {k: checked[k] for k in offload_options}  # the given ones, sizes read ("512MiB")
        self.trace: Trace | None = None
        self.plan: Plan | None = None
        # what a step holds besides its saves (activations' gradients, temporaries) at a recomputed
        # or offloaded block's backward, measured on CUDA in the compute trace; None before it
        self.besides: int | None = None
        self._kept_besides: int | None = None  # the same where each block's saves stay to their nodes' ends
        self.measured_peak: int | None = None  # the last measured planned step's peak above its start
        self._margins = {False: 0, True: 0}    # measured peak beyond predicted, for plans that (do not) offload
        self._checks = 0                       # planned steps measured since the last trace
        self._checking = False                 # the next planned step is measured
        self._phase = "trace-offload"
        self._pending: Callable[[], None] | None = None  # finishes reading the last step
        self._hooks: list[Any] = []
        self._recomputing: set[int] = set()
        self._signature: tuple | None = None
        self._stale = False
        self._ctx: Offload | None = None  # the planned step running now
        self._measured: int | None = None  # the measured step's peak, read as its backward ended
        self._offloading_steps = 0         # planned steps that offloaded, since the last trace
        self.traced_host_ms_per_tensor: float | None = None  # the trace's, where a planned step measured more
        self._alternative: Plan | None = None  # the best fitting plan of the other kind (offloading or not)
        self._trial: _Trial | None = None      # the plan and the alternative, tried in alternation
        self.trials: list[_Trial] = []         # this trace's trials, decided, in order
        self._end_hooks: list[Any] = []        # on the last block (_at_backward_end), until their step's forward ends
        self.replans = 0
        self._traced_again = False  # a compute trace that paid first calls was repeated (_trace_compute)

    @property
    def trial(self) -> _Trial | None:
        """The last trial decided since the last trace."""
        return self.trials[-1] if self.trials else None

    @property
    def kept_extra(self) -> int:
        """What a kept block's backward holds beyond a recomputed one's: autograd keeps a kept
        block's saves until each node that saved them ends, beside the node's temporaries (W1: a
        bias gradient's reduction buffer; 52 MiB more in all), where Recompute hands them over and
        they go as the node takes them. Measured with peak= in the reentrant form (the second
        compute trace, without the hand-over); else 0."""
        if self.besides is None or self._kept_besides is None:
            return 0
        return max(0, self._kept_besides - self.besides)

    @property
    def settled(self) -> bool:
        """True once a plan is in force that no further step will measure or change (until the
        inputs' shapes change). Reading it between steps finishes reading the last step."""
        self._finish_last_step()
        return (self._phase == "planned" and not self._checking and not self._stale and not self._host_check_due()
                and self._trial is None and self._alternative is None)

    def _host_check_due(self) -> bool:
        """A planned step that offloads is yet to be read (_check_host); not after a trial, whose
        step times decided."""
        return (self.plan is not None and self.plan.offloaded > 0 and self.traced_host_ms_per_tensor is None
                and self._offloading_steps < HOST_CHECK_STEP and self.trial is None)

    # --- each step ----------------------------------------------------------

    def step(self) -> Offload:
        """The storm.offload context of the next step, with the plan (or the trace) applied."""
        self._finish_last_step()
        self._remove_end_hooks()  # the last step's, where it never ran a backward
        if self._stale:
            self._stale, self._phase, self.plan = False, "trace-offload", None
            self._margins, self._checks, self._checking = {False: 0, True: 0}, 0, False
            self.besides, self._kept_besides = None, None
            self._offloading_steps, self.traced_host_ms_per_tensor = 0, None
            self._alternative, self._trial, self.trials = None, None, []
            self.replans += 1
        if self._phase == "trace-offload":
            return self._trace_offload()
        if self._phase == "trace-compute":
            return self._trace_compute(hand_over=True)
        if self._phase == "trace-compute-kept":
            return self._trace_compute(hand_over=False)
        if self._trial is None and self._alternative is not None and not self._checking \
                and not self._host_check_due():
            self._trial, self._alternative = _Trial((self.plan, self._alternative)), None
        if self._trial is not None and self._trial.next_plan() is not self.plan:
            self._apply(self._trial.next_plan())
        p = self.plan
        # where frames were weighed, the plan says which (a daemon's codec setting could frame a raw
        # plan's tensors); a codec of the user's comes first, as choose() knew
        framing = p.compressed or any(b.framed for b in self.trace.blocks)
        codec = {"codec": "ancf_exp" if p.compressed else "raw"} if framing else {}
        ctx = Offload(**{"max_held_bytes": p.max_held_bytes, "prefetch_bytes": p.prefetch_bytes, **codec,
                         **self._options}, budget=p.offload_budget)
        self._ctx = ctx
        after: list[Callable[[], None]] = []
        if self._checking:
            self._measure_this_step()
            after.append(self._check)
        if self._host_check_due() and self._trial is None:
            self._offloading_steps += 1
            if self._offloading_steps == HOST_CHECK_STEP:
                after.append(functools.partial(self._check_host, ctx))
        if self._trial is not None:
            after.append(self._time_trial_step())
        if after:
            def finish() -> None:
                for f in after:
                    f()
            self._pending = finish
        return ctx

    def _check_host(self, ctx: Offload) -> None:
        """After a planned step that offloaded: where its packs took more host time per tensor
        than the offload trace's (whose median block's leaves out what an offloading step pays
        at its first block, and whose saves all go: W1 on a lent H100 with block 0 offloaded,
        205 us a pack against 75, bench/plan_costs.py), that becomes the trace's, and the next
        step plans again; once per trace. Not where they took less: a plan of fewer offloads
        must not bring back a dearer one."""
        st = ctx.stats
        if not st.offloaded or self.plan is None or self._stale:
            return
        measured = 2e3 * st.pack_s / st.offloaded  # pack and unpack, as the trace counts it
        if measured <= HOST_CHECK_TOLERANCE * self.trace.host_ms_per_tensor:
            return
        log.info("storm.plan: a planned step took %.0f us of host time per offloaded tensor against %.0f traced; "
                 "planning with it", measured * 1e3, self.trace.host_ms_per_tensor * 1e3)
        self.traced_host_ms_per_tensor = self.trace.host_ms_per_tensor
        self.trace.host_ms_per_tensor = measured
        self._make_plan()

    def _measure_this_step(self) -> None:
        """Reset the peak statistics now and read them when this step's backward ends (before
        the optimizer and whatever else the caller does between steps)."""
        self._measured = None
        if not self._memory.available:
            return
        self._memory.start()

        def read() -> None:
            self._measured = self._memory.peak()

        self._at_backward_end(read)

    def _at_backward_end(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` as this step's backward ends: queued on the autograd engine from the
        gradient of the last block's output, which is ready as backward starts."""
        def at_output(m: nn.Module, args: Any, out: Any) -> None:
            handle.remove()  # once: not again when a checkpointed last block is rebuilt
            t = _first_tensor(out)
            if t is not None and t.requires_grad:
                t.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(fn))

        handle = self.blocks[-1].register_forward_hook(at_output)
        self._end_hooks.append(handle)

    def _remove_end_hooks(self) -> None:
        for h in self._end_hooks:
            h.remove()
        self._end_hooks = []

    def _time_trial_step(self) -> Callable[[], None]:
        """Time this trial step, forward and backward on the compute stream (host-bound gaps
        included; CPU: the host clock); the first step of the alternative is measured against its
        target too. Returns what reads it after the step, and decides the trial once it can
        (_Trial.decided)."""
        trial, clock = self._trial, self.clock
        turn, marks = trial.turn, [clock.mark()]
        self._at_backward_end(lambda: marks.append(clock.mark()))
        measured = turn == 1 and self._memory.available
        if measured:
            self._measure_this_step()

        def read() -> None:
            trial.turn += 1
            if len(marks) < 2 or self._stale or self._trial is not trial:  # no backward, or traced again
                return
            trial.ms[turn % 2].append(clock.elapsed_ms(*marks))
            if measured and self._measured is not None and self._measured > self.target:
                trial.over = self._measured
                self._decide_trial()
            elif trial.decided:
                self._decide_trial()

        return read

    def _decide_trial(self) -> None:
        """Keep the plan of the two whose steps took less (the alternative only if it stayed within
        its target)."""
        trial, self._trial = self._trial, None
        self.trials.append(trial)
        keep = trial.plans[1] if trial.over is None and trial.gain_ms > 0 else trial.plans[0]
        trial.kept = keep
        if keep is not self.plan:
            self._apply(keep)
        log.info("storm.plan: %s", trial.describe())
        self._alternative = self._other_form(keep)

    def _finish_last_step(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def _trace_offload(self) -> Offload:
        """Everything offloaded, raw: bytes, tensors and those a frame codec would frame per block,
        host time per tensor (raw: what frames add is measured apart)."""
        self._recompute(set())
        ctx = Offload(**{**self._options, "codec": "raw"})
        n = len(self.blocks)
        # (pack s, storages offloaded) when each block started and ended. The step's storages, in
        # saving order, give each block's bytes and which a frame codec would frame: not the
        # offloaded-bytes counter, which a store's refusal (a full pool) takes back later
        marks: list[tuple[float, int]] = []
        inputs, grads = [0] * n, [0] * n

        def mark() -> None:
            marks.append((ctx.stats.pack_s, len(ctx._step.order)))

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            mark()
            inputs[i] = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
            # gradients already there (not set to None between steps) are not allocated by the step
            grads[i] = sum(q.numel() * q.element_size() for q in m.parameters() if q.requires_grad and q.grad is None)
            if i == 0:
                self._signature = _signature(args)

        self._hook_blocks(pre, lambda i, m, args, out: mark())

        def collect() -> None:
            self._unhook()
            st = ctx.stats
            if len(marks) != 2 * n:
                log.warning("storm.plan: the traced step did not run every block once; tracing again")
                return
            ctx.synchronize()  # every copy settled: the store's refusals are counted
            order = ctx._step.order
            offset = [0]  # bytes saved before each storage of the step
            for stored in order:
                offset.append(offset[-1] + stored.nbytes)
            blocks = []
            for i in range(n):
                s0, s1 = marks[2 * i][1], marks[2 * i + 1][1]
                framed, framed_bytes, frame_bytes = frames_of(order[s0:s1])
                blocks.append(BlockTrace(offset[s1] - offset[s0], s1 - s0, inputs[i], grad_bytes=grads[i],
                                         framed=framed, framed_bytes=framed_bytes, frame_bytes=frame_bytes))
            device = _device_of(self.blocks)
            d2h, h2d = link_bandwidth(device)
            # frames are timed only where some tensor would be framed: their kernels compile at first use
            frame_ms, frame_device_ms = frame_costs(device) if any(b.framed for b in blocks) else (0.0, 0.0)
            # the median block's: the first offload of a process also sets up the pinned pool
            per_tensor = [(marks[2 * i + 1][0] - marks[2 * i][0]) / b.tensors for i, b in enumerate(blocks) if b.tensors]
            host_s = statistics.median(per_tensor) if per_tensor else st.pack_s / max(1, st.offloaded)
            store_bytes = None
            if st.offloaded_bytes < offset[-1]:  # the store refused some (pool full, quota): plans stay within
                store_bytes = st.offloaded_bytes
                log.warning("storm.plan: the store took %.1f of the %.1f MiB the traced step offloaded (%s); plans "
                            "offload at most that. A larger pool_size (or stormd pool) lets them offload more",
                            store_bytes / MiB, offset[-1] / MiB, ", ".join(f"{v} {k}" for k, v in st.kept.items()
                                                    if k in (Keep.POOL_FULL, Keep.QUOTA, Keep.STORE_ERROR)))
            self.trace = Trace(blocks, offset[marks[0][1]], offset[-1] - offset[marks[-1][1]],
                               [offset[marks[2 * i][1]] for i in range(n)], 2e3 * host_s, frame_ms, frame_device_ms,
                               d2h_GBps=d2h, h2d_GBps=h2d, store_bytes=store_bytes)
            self._phase = "trace-compute"

        self._pending = collect
        return ctx

    def _trace_compute(self, hand_over: bool) -> Offload:
        """Every block recomputed in the planner's form, nothing offloaded: forward time per
        block, and what a step holds besides its saves. With peak=, where the reentrant form is
        the planner's, a second traced step recomputes without Recompute's hand-over of saved
        tensors (``hand_over=False``): each block's backward then holds its saves as a kept
        block's does, and what it holds besides them gives ``kept_extra``."""
        device = _device_of(self.blocks)
        # each recompute form's first call in a process sets up its machinery (torch's checkpoint, the
        # non-reentrant form, imports torch._dynamo): paid now on a function of STORM's own, or the
        # traced forward, or the form trial's first non-reentrant step, would look that much slower
        if hand_over:  # the first compute trace: the second times nothing
            warm = torch.zeros(1, device=device, requires_grad=True)
            for reentrant in {self.reentrant, False}:
                Recompute(lambda t: t * 2, device, reentrant)(warm).sum().backward()
        self._recompute(set(range(len(self.blocks))), hand_over)
        clock = self.clock
        n = len(self.blocks)
        starts: list[Any] = [None] * n
        ends: list[Any] = [None] * n
        host = [0.0] * (n + 1)  # as each block starts, and as the last ends
        # each block's last call, its recompute in backward: what recomputing it costs (see _timing)
        recomputes: list[tuple[Any, Any] | None] = [None] * n
        untimed = [b.forward.forward for b in self.blocks]
        if hand_over:
            for i, b in enumerate(self.blocks):
                b.forward.forward = _timing(untimed[i], clock, recomputes, i)

        def pre(i: int, m: nn.Module, args: Any, kwargs: dict) -> None:
            host[i] = clock.host()
            starts[i] = clock.mark()

        def post(i: int, m: nn.Module, args: Any, out: Any) -> None:
            ends[i] = clock.mark()
            if i == n - 1:
                host[n] = clock.host()

        self._hook_blocks(pre, post)
        self._measure_this_step()

        def collect() -> None:
            self._unhook()
            for b, forward in zip(self.blocks, untimed):
                b.forward.forward = forward
            if any(s is None for s in starts + ends):
                log.warning("storm.plan: the traced step did not run every block once; tracing again")
                return
            trace = self.trace
            if hand_over:  # the times of the form plans take
                for b, marks in zip(trace.blocks, recomputes):
                    b.forward_ms = clock.elapsed_ms(*marks)
                trace.forward_host_ms = (host[n] - host[0]) * 1e3
                trace.forward_device_ms = clock.elapsed_ms(starts[0], ends[-1])
                recomputing_ms = sum(b.forward_ms for b in trace.blocks)
                if (clock.first_calls_load and not self._traced_again
                        and trace.forward_device_ms > FIRST_CALL_RATIO * recomputing_ms + FIRST_CALL_MS):
                    # The traced forward was the blocks' first calls in the recompute form (no autograd in
                    # the reentrant one): kernels loaded then, not in later steps, which would make the host
                    # look as slow as the stream and hide its lead. The planner calls no block of its own
                    # to warm them (a block may have side effects), so the next step traces again.
                    self._traced_again = True
                    log.info("storm.plan: the traced forward took %.2f ms against %.2f ms of recomputes "
                             "(first calls); tracing again", trace.forward_device_ms, recomputing_ms)
                    return
                # the stream's time from block 0 to block i less the host's: how far ahead the host
                # is (at least: the stream may start block 0 after the host reached it)
                trace.lead_ms = [clock.elapsed_ms(starts[0], starts[i]) - (host[i] - host[0]) * 1e3
                                 for i in range(n)]
                trace.lead_ms.append(trace.forward_device_ms - trace.forward_host_ms)
            if self._measured is not None:  # what the model leaves out: activations' gradients, temporaries
                besides = max(0, self._measured - predicted_peak(trace, 0, set(range(n)), 0))
                if hand_over:
                    self.besides = besides
                else:
                    self._kept_besides = besides
            if hand_over and self.reentrant and self._peak is not None and self._measured is not None:
                self._phase = "trace-compute-kept"
            else:
                self._make_plan()

        self._pending = collect
        return Offload(**self._options, budget=0)

    def _saved_budget(self) -> int:
        """What plans are held to: with ``peak``, the peak less the besides, for saves and
        parameter gradients together; with ``budget``, the budget, for saves alone."""
        if self._peak is not None:
            return max(0, self._peak - self.besides)
        return self._budget if isinstance(self._budget, int) else int(self._budget * self.trace.total_bytes)

    def _step_peak(self, plan: Plan) -> int:
        """The plan's saves and parameter gradients on the device at its predicted peak."""
        return predicted_peak(self.trace, plan.offloaded, plan.recomputed, plan.in_flight_bytes,
                              kept_extra=self.kept_extra)

    @property
    def target(self) -> int | None:
        """The step peak (bytes above the step's start) a planned step is measured against:
        ``peak``; with ``budget``, the besides plus the plan's predicted saves and gradients at
        its peak plus what of the budget its saves leave unused. None before the compute trace
        and where peaks cannot be measured (not CUDA)."""
        if self.besides is None or self.plan is None:
            return None
        if self._peak is not None:
            return self._peak
        return self.besides + self._step_peak(self.plan) + max(0, self._saved_budget() - self.plan.predicted_peak)

    def _plans_budget(self) -> int:
        """What choose() holds plans to: the saved budget, less the margin every plan leaves."""
        return self._saved_budget() - self._margins[False]

    def _choose(self, offload: bool | None = None) -> Plan | None:
        plan = choose(self.trace, self._plans_budget(), self._options.get("max_held_bytes"),
                      self._options.get("prefetch_bytes"), self._margins[True] - self._margins[False],
                      grads=self._peak is not None, codec=self._options.get("codec"), offload=offload,
                      kept_extra=self.kept_extra)
        return plan and dataclasses.replace(plan, reentrant=self.reentrant)

    def _other_form(self, plan: Plan) -> Plan | None:
        """``plan`` with its blocks recomputed by torch's non-reentrant checkpoint, to be tried
        once per trace beside the reentrant form. Neither is faster everywhere: the reentrant form
        costs the host less (W1, host-bound: 34.55 against 39.97 ms a step, 11 blocks recomputed,
        bench/recompute.py), the non-reentrant one stops each recompute at the block's last saved
        tensor and skips what follows (a transformer block's last matmul and residual add; W2,
        GPU-bound: checkpointing the first 8 blocks took 268.0 ms a step where the reentrant plan
        recomputing 7 took 272.7, frontier-w2-h100-2026-11-26-ac0286b.json)."""
        tried = any(t.plans[0].reentrant != t.plans[1].reentrant for t in (*self.trials, self._trial) if t)
        if tried or not plan.fits or not plan.recomputed or not plan.reentrant:
            return None
        return dataclasses.replace(plan, reentrant=False)

    def _make_plan(self) -> None:
        """The plan of least predicted cost; where none fits, the one of least peak."""
        self.plan = self._choose()
        if not self.plan.fits:
            log.warning("storm.plan: no plan keeps the %s under %.1f MiB; the lowest predicted is %.1f MiB",
                        "saved activations" if self._peak is None else "saves and gradients, from peak=,",
                        self._plans_budget() / MiB, self.plan.predicted_peak / MiB)
        # a plan that cannot fit is not measured: no margin would make it
        self._checking = self.plan.fits and self.target is not None and self._checks < MAX_CHECKS
        # the model's costs are approximate (offloading's host time most): where a plan of the other
        # kind fits too, both are tried in alternation once this one's peak is settled
        self._alternative = None
        if self.plan.fits and self.trial is None and self._trial is None:
            other = self._choose(offload=not self.plan.offloaded)
            if other is not None and other.fits and bool(other.offloaded) != bool(self.plan.offloaded):
                self._alternative = other
        if self._alternative is None and self._trial is None:
            self._alternative = self._other_form(self.plan)
        self._apply(self.plan)
        self._phase = "planned"

    def _apply(self, plan: Plan) -> None:
        """Put ``plan`` in force from the next step: its recomputed blocks and its hooks."""
        self.plan = plan
        self._unhook()
        self._recompute(set(plan.recomputed), reentrant=plan.reentrant)

        def check(m: nn.Module, args: Any) -> None:  # a new input shape: the trace no longer holds
            if _signature(args) != self._signature:
                self._stale = True

        self._hooks.append(self.blocks[0].register_forward_pre_hook(check))
        if plan.offloaded:
            self._hook_later_blocks()

    def _check(self) -> None:
        """After a measured planned step: over the target, what the step took beyond the plan's
        prediction (and a little more, as copy timing varies between steps) becomes the margin
        of plans of its kind, and the next step plans again."""
        self._checks += 1
        self.measured_peak = self._measured
        target = self.target
        if self.measured_peak is None or self.measured_peak <= target or self._stale:  # None: no backward
            self._checking = False
            return
        if self._checks >= MAX_CHECKS:
            self._checking = False
            log.warning("storm.plan: a planned step peaked %.1f MiB over its target of %.1f MiB after %d "
                        "corrections; keeping this plan", (self.measured_peak - target) / MiB, target / MiB,
                        self._checks)
            return
        beyond = self.measured_peak - self.besides - self._step_peak(self.plan)
        kind = self.plan.offloaded > 0
        self._margins[kind] = max(self._margins[kind] + MiB, beyond + max(MiB, target // 200))
        self._make_plan()

    def _hook_later_blocks(self) -> None:
        """Past the offloaded blocks STORM's saves only mark about every 64 MiB: too coarse to
        let go of the tensors whose copy has finished in time, or to see backward make room
        at the plan's peak. So after
        each later block's forward the host waits until the copies still running fit in what
        the blocks after it will keep (the host runs ahead of the GPU, and the caching
        allocator counts memory on the host's clock), and a hook on each block's output (whose
        gradient is ready when the block's backward starts) allows prefetch what the plan's
        peak leaves free there: the peak, less what the blocks before keep, the block's own
        saves or the largest rebuild still to come, and (where the plan's peak counts them,
        with peak=) the parameter gradients allocated from there on, so fetches start as
        early as memory allows and hold back as gradients grow."""
        p, blocks = self.plan, self.trace.blocks
        grads = [b.grad_bytes * (self._peak is not None) for b in blocks]  # in the plan's peak with peak= only
        room = [0] * len(blocks)
        kept = kept_bytes(self.trace, p.offloaded, p.recomputed)
        rebuild = 0  # the largest saves of a recomputed block before i: rebuilt later in backward
        for i, b in enumerate(blocks):
            # block i's own saves (kept, rebuilt or fetched) are alive through its backward
            in_use = max(b.saved_bytes, rebuild)
            room[i] = max(0, p.predicted_peak - sum(kept[:i]) - in_use - sum(grads[i:]))
            if i in p.recomputed:
                rebuild = max(rebuild, b.saved_bytes)
        # after block i, the copies still running may use what the blocks after the next will
        # keep (they stay until the next block's end, while it allocates its own saves), plus
        # what the plan counts as still in flight when forward ends. Not the plan's slack at
        # that moment: backward's start also holds the loss's and the last block's temporaries,
        # which the model leaves out (W2 on the H100 went 0.12 GiB over its cap with them)
        limit = [p.in_flight_bytes + sum(kept[i + 2:]) for i in range(len(blocks))]

        def reached(i: int, m: nn.Module, args: Any, out: Any) -> None:
            ctx = self._ctx
            if ctx is None:
                return
            if i >= p.offloaded:
                ctx.drain(limit[i])
            elif i == p.offloaded - 1:  # the later blocks' saves stay: no hooks for them to pass through
                ctx.stop_offloading()
            t = _first_tensor(out)
            if t is not None and t.requires_grad:
                t.register_hook(lambda grad: ctx.allow_prefetch(room[i]))

        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_hook(functools.partial(reached, i)))

    # --- applying -----------------------------------------------------------

    def _hook_blocks(self, pre: Callable, post: Callable) -> None:
        self._unhook()
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(functools.partial(pre, i), with_kwargs=True))
            self._hooks.append(b.register_forward_hook(functools.partial(post, i)))

    def _unhook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _recompute(self, which: set[int], hand_over: bool = True, reentrant: bool | None = None) -> None:
        """Make exactly the blocks in ``which`` recompute in backward (Recompute, set as their
        forward, in the planner's form unless ``reentrant`` says; ``hand_over``: see Recompute)."""
        reentrant = self.reentrant if reentrant is None else reentrant
        for i in which - self._recomputing:
            if "forward" in vars(self.blocks[i]):
                raise RuntimeError(f"storm.plan: block {i} ({type(self.blocks[i]).__name__}) already has its own "
                                   "forward attribute; storm.plan recomputes a block by setting it")
        for i in self._recomputing - which:
            del self.blocks[i].forward  # back to the class's forward
        for i in which:
            b = self.blocks[i]
            if i not in self._recomputing or (b.forward.hand_over, b.forward.reentrant) != (hand_over, reentrant):
                b.forward = Recompute(type(b).forward.__get__(b), _device_of([b]), reentrant, hand_over)
        self._recomputing = set(which)

    def close(self) -> None:
        """Restore the blocks' own forwards and remove STORM's hooks from them."""
        self._unhook()
        self._remove_end_hooks()  # a step begun but never run leaves its hook waiting
        self._recompute(set())
        self._pending = None

    # --- explaining ---------------------------------------------------------

    def explain(self) -> str:
        """Per block what was measured and what the plan does with it, and the predicted totals."""
        if self.plan is None or self.trace is None:
            return f"storm.plan: {self._phase.replace('-', ' ')} step next; no plan yet"
        t, p = self.trace, self.plan
        want = (f"peak {self._peak / MiB:.1f} MiB above the step's start" if self._peak is not None
                else f"budget {_describe_budget(self._budget, t.total_bytes)}")
        host = f"host {t.host_ms_per_tensor * 1e3:.0f} us per offloaded tensor" + (
            "" if self.traced_host_ms_per_tensor is None
            else f" (measured in a planned step; traced {self.traced_host_ms_per_tensor * 1e3:.0f})")
        lines = [f"storm.plan: {want}; link {t.d2h_GBps:.1f} GB/s to host, {t.h2d_GBps:.1f} back; {host}; "
                 f"forward {t.forward_host_ms:.2f} ms host, {t.forward_device_ms:.2f} ms compute stream",
                 f"{'block':>5} {'saved MiB':>10} {'tensors':>7} {'input MiB':>10} {'forward ms':>10}  decision"]
        for i, b in enumerate(t.blocks):
            what = "offload" if i < p.offloaded else "recompute" if i in p.recomputed else "keep"
            lines.append(f"{i:>5} {b.saved_bytes / MiB:>10.1f} {b.tensors:>7} {b.input_bytes / MiB:>10.1f} "
                         f"{b.forward_ms:>10.3f}  {what}")
        lines.append(f"before the blocks {t.before_bytes / MiB:.1f} MiB ({'offload' if p.offloaded else 'keep'}), "
                     f"after {t.after_bytes / MiB:.1f} MiB "
                     f"({'offload' if p.offloaded == len(t.blocks) else 'keep'})")
        lines.append(f"copy queue {p.max_held_bytes / MiB:.1f} MiB, prefetch window {p.prefetch_bytes / MiB:.1f} MiB"
                     + (" (given)" if {"max_held_bytes", "prefetch_bytes"} & self._options.keys() else ""))
        if p.recomputed:
            lines.append(self._explain_recompute())
        if t.store_bytes is not None:
            lines.append(f"the store took {t.store_bytes / MiB:.1f} of the {t.total_bytes / MiB:.1f} MiB traced: "
                         "plans offload at most that")
        lines.append(self._explain_codec())
        lines.append(f"predicted: {p.predicted_peak / MiB:.1f} MiB saved on the device at the peak "
                     f"({'fits' if p.fits else 'does NOT fit'}), {p.predicted_cost_ms:.2f} ms over no offload; "
                     f"re-planned {self.replans} times")
        lines += [t.describe() for t in self.trials]
        if self.besides is not None:
            measured = "not yet" if self.measured_peak is None else f"{self.measured_peak / MiB:.1f} MiB"
            lines.append(f"measured: step peak {measured} against a target of {self.target / MiB:.1f} MiB "
                         f"(besides the saves {self.besides / MiB:.1f} MiB, and {self.kept_extra / MiB:.1f} more "
                         f"while a kept block's backward runs); margins {self._margins[False] / MiB:.1f} "
                         f"MiB, plus {self._margins[True] / MiB:.1f} MiB for plans that offload, after "
                         f"{self._checks} measured steps")
        return "\n".join(lines)

    def _explain_recompute(self) -> str:
        if self.plan.reentrant:
            return "recomputed in the reentrant form (storm.recompute)"
        if self.reentrant:
            return "recomputed with torch's non-reentrant checkpoint, faster here in its trial"
        return "recomputed with torch's non-reentrant checkpoint (reentrant=False)"

    def _explain_codec(self) -> str:
        """Whether offloaded tensors go raw or compressed, and the predicted times that chose it."""
        t, p = self.trace, self.plan
        if not p.offloaded:
            return "nothing offloaded: no codec"
        offloaded, given = t.blocks[:p.offloaded], " (codec given)" if "codec" in self._options else ""
        framed_bytes, frame_bytes = sum(b.framed_bytes for b in offloaded), sum(b.frame_bytes for b in offloaded)
        if frame_bytes >= framed_bytes:
            return (f"offloaded tensors go raw{given}: none would be framed (frames are for CUDA bf16 tensors of "
                    f"at least {FRAME_MIN_BYTES / MiB:g} MiB)")
        raw, compressed = (_Offloading.of(t, p.offloaded, p.max_held_bytes, c)[0] for c in (False, True))
        framed = sum(b.framed for b in offloaded)
        return (f"offloaded tensors go {'compressed' if p.compressed else 'raw'}{given}: predicted link "
                f"{compressed.link_ms:.2f} ms compressed against {raw.link_ms:.2f} ms raw ({framed_bytes / MiB:.1f} "
                f"MiB in {framed} tensors would cross as {frame_bytes / MiB:.1f} MiB of frames), host "
                f"{compressed.host_ms - raw.host_ms:+.2f} ms ({t.frame_host_ms_per_tensor * 1e3:.0f} us per frame, "
                f"less what the compute stream hides), codec kernels +{compressed.codec_ms:.2f} ms on the device "
                f"({t.frame_device_ms_per_GiB:.2f} ms per GiB framed)")


@dataclasses.dataclass
class _Trial:
    """The plan chosen and an alternative (the best fitting plan of the other kind, offloading or
    not, or the same plan in the other recompute form), tried in alternation: step times per
    plan, and which was kept."""

    plans: tuple[Plan, Plan]
    ms: tuple[list[float], list[float]] = dataclasses.field(default_factory=lambda: ([], []))
    turn: int = 0
    over: int | None = None  # the alternative's measured peak, where it went over its target
    kept: Plan | None = None

    def next_plan(self) -> Plan:
        return self.plans[self.turn % 2]

    def median(self, i: int) -> float:
        return statistics.median(self.ms[i]) if self.ms[i] else float("inf")

    @property
    def gain_ms(self) -> float:
        """How much less the alternative's step took than the chosen plan's step before it, in
        the median over such pairs."""
        return statistics.median(a - b for a, b in zip(*self.ms)) if all(self.ms) else 0.0

    @property
    def decided(self) -> bool:
        """Both plans have TRIAL_STEPS steps and differ by more than TRIAL_CLOSE of the chosen
        plan's median step, or both have TRIAL_MAX_STEPS."""
        steps = min(map(len, self.ms))
        if steps < TRIAL_STEPS:
            return False
        return abs(self.gain_ms) > TRIAL_CLOSE * self.median(0) or steps >= TRIAL_MAX_STEPS

    def describe(self) -> str:
        names = [_plan_name(p) for p in self.plans]
        if self.over is not None:
            return (f"tried {names[1]} beside {names[0]}: it peaked at {self.over / MiB:.1f} MiB, over its target; "
                    f"kept {names[0]}")
        times = ", ".join(f"{name} {self.median(i):.2f} ms" for i, name in enumerate(names))
        n = min(map(len, self.ms))
        return (f"tried in alternation, forward and backward a step (median of {n}): {times}, the second "
                f"{abs(self.gain_ms):.2f} ms {'faster' if self.gain_ms > 0 else 'slower'} in the median of {n} "
                f"pairs; kept {_plan_name(self.kept)}")


def _plan_name(p: Plan) -> str:
    parts = ([f"offload {p.offloaded}"] if p.offloaded else []) + ([f"recompute {len(p.recomputed)}"]
                                                                    if p.recomputed else [])
    form = "" if p.reentrant or not p.recomputed else " non-reentrant"
    return " and ".join(parts) + " blocks" + form if parts else "keep every block"


def _timing(forward: Callable[..., Any], clock: Clock, marks: list[Any], i: int) -> Callable[..., Any]:
    """``forward`` (a recomputed block's own), each call's start and end on ``clock`` kept in
    ``marks[i]``: the last call of a step is the block's recompute in backward (the non-reentrant
    form's stops early, by raising, where the block's last saved tensor is rebuilt), which is what
    recomputing it costs. Timing the recompute rather than forward's call, which runs without
    autograd, leaves out what a process's first such call loads (kernels that grad-mode steps
    never used) and needs no extra call of the block to pay that beforehand: a block with a side
    effect (a KV cache, running statistics) must run exactly as training runs it."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock.mark()
        try:
            return forward(*args, **kwargs)
        finally:
            marks[i] = (start, clock.mark())

    return timed


class Clock:
    """Where storm.plan's timings come from: marks on the compute stream (CUDA events) or the
    host clock (CPU), and the host clock. A Planner takes another (``clock=``) so that tests
    decide its trials by the timings they give, never by how fast a loaded machine ran."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @property
    def first_calls_load(self) -> bool:
        """Whether a block's first call may take far longer than its next ones: a GPU loads kernels
        then, and a compute trace that paid that is repeated. On the host clock a loaded machine's
        noise would look the same, and there is nothing to load."""
        return self.cuda

    def host(self) -> float:
        """The host's time, in seconds."""
        return time.perf_counter()

    def mark(self) -> Any:
        if not self.cuda:
            return self.host()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


class _PeakMemory:
    """A step's peak GPU memory above its start, from the CUDA caching allocator; elsewhere
    not available (peak() is None)."""

    def __init__(self, device: torch.device):
        self.device, self.available, self._base = device, device.type == "cuda", 0

    def start(self) -> None:
        if self.available:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) - self._base if self.available else None


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


def frames_of(saves: Iterable[Any]) -> tuple[int, int, int]:
    """Of these offloaded storages (session.Stored: device, dtype, nbytes), how many a frame codec
    puts in frames (transfer.frameable, as the mover decides), their bytes, and their frames' bytes."""
    framed = [s.nbytes for s in saves if frameable(s.device.type, str(s.dtype).removeprefix("torch."), s.nbytes)]
    return len(framed), sum(framed), sum(frame_nbytes(b // 2) for b in framed)


def frame_costs(device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """What frames cost, measured now, the median of ``repeats``: the training thread's ms per
    framed tensor, the host side of encoding and decoding one FRAME_MIN_BYTES bf16 tensor
    (buffers and kernel launches; the device's work runs on the mover's codec streams); and the
    device's ms per GiB framed, encoding and decoding a FRAME_DEVICE_BYTES one. (0, 0) off CUDA,
    where nothing is framed."""
    if device.type != "cuda":
        return 0.0, 0.0
    small, large = (torch.randn(n // 2, dtype=torch.bfloat16, device=device)
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


def _device_of(blocks: list[nn.Module]) -> torch.device:
    for b in blocks:
        for p in b.parameters():
            return p.device
    return torch.device("cpu")


def _first_tensor(out: Any) -> torch.Tensor | None:
    """A block's output tensor, or the first tensor of its output tuple."""
    if isinstance(out, torch.Tensor):
        return out
    return next((o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)


def _signature(args: Any) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))


def _parse_peak(peak: int | str) -> int:
    bad = ValueError(f"peak must be bytes (an int or a size such as '6GiB'), got {peak!r}")
    if isinstance(peak, (bool, float)):  # a fraction of what? peak is the step's own memory
        raise bad
    try:
        value = parse_size(peak)
    except ValueError:
        raise bad from None
    if value < 0:
        raise bad
    return value


def _describe_budget(budget: int | float, total: int) -> str:
    if isinstance(budget, float):
        return f"{budget:.0%} of {total / MiB:.1f} MiB saved per step"
    return f"{budget / MiB:.1f} MiB of {total / MiB:.1f} MiB saved per step"


def plan(blocks: Iterable[nn.Module], budget: int | float | str | None = None, *, peak: int | str | None = None,
         reentrant: bool = True, clock: Clock | None = None, **offload_options: Any) -> Planner:
    """A Planner (see its docstring and this module's)."""
    return Planner(blocks, budget, peak=peak, reentrant=reentrant, clock=clock, **offload_options)
