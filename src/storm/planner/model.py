"""The planner's cost model: arithmetic on a recorded ``Trace``, no device in sight.

A plan offloads the first k blocks (the earliest saves, which backward needs last), recomputes
the next m with their inputs offloaded (nothing of them stays on the device from forward to
their backward), recomputes some of the others in backward and keeps the rest. The saves before
the blocks go with the first that offloads; of those after them (the head's and the loss's),
once the last block's saves or inputs go, those saved before the largest (not that one: a
language model's log-softmax of its logits, which the loss's backward takes at once, so that
offloading it would lower no moment).
held.py's ``predicted_peak`` says what the device holds at backward's worst moment under a plan,
``Offloading.of`` what offloading costs, and ``choose`` the plan of least predicted cost whose
peak fits a budget. docs/planner.md ("How a plan is chosen") explains the model in full.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from typing import Mapping

from ..frames import FRAME_CODECS
from .held import Figures, after_kept, moments_of, offloaded_per_block
from .records import Trace

GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What a step does with each block, and what the cost model predicts of it. Built by keyword:
    the planner's knobs grow (fields with defaults), and a plan made by position would shift."""

    offloaded: int                 # blocks[:offloaded] (and the saves before them) are offloaded
    recomputed: frozenset[int]     # these blocks are recomputed in backward
    offload_budget: int | None     # storm.offload(budget=...) that offloads exactly those saves; None: all
    max_held_bytes: int            # storm.offload's copy queue and prefetch window for the plan
    prefetch_bytes: int
    predicted_peak: int            # saved bytes (with gradients, when choose() counted them) at the peak
    predicted_cost_ms: float       # step time over no offload
    fits: bool
    in_flight_bytes: int = 0       # offloaded bytes (and frames) the peak counts as still on the device
    compressed: bool = False       # offloaded tensors go in frames where they can (codec "auto")
    reentrant: bool = True         # recomputed blocks in Recompute's reentrant form, else torch's non-reentrant
    inputs_offloaded: int = 0      # blocks[offloaded:offloaded + this] (in recomputed) have their inputs offloaded
    # every save offloaded as storm.offload() does it (full_offload): its own copy queue and prefetch
    # window, paced by full offload's room (storm/rooms.py), not by the plan's figures or hooks
    full: bool = False
    # the blocks' partitioner budget the plan was made for, where the planner compiles them (budgets.py);
    # not in its shape: each budget's plans are measured against their own trace (its TraceState)
    block_budget: float | None = None
    # bytes a step of this plan was measured over its target (negative: under); None: not measured.
    # What was learned of the plan, not what it is: plans compare equal without it
    measured_over: int | None = dataclasses.field(default=None, compare=False)

    @property
    def shape(self) -> tuple:
        """What a step of the plan does, as far as its memory goes: the key its measured peak is
        known by (Scenario.measured). Not the recompute form, which the planner sets after choose()."""
        return (self.offloaded, self.inputs_offloaded, self.recomputed, self.compressed, self.max_held_bytes,
                self.prefetch_bytes, self.full)

    @property
    def offloads(self) -> bool:
        """Whether the plan's step offloads anything: blocks' saves or recomputed blocks' inputs."""
        return self.offloaded + self.inputs_offloaded > 0


@dataclasses.dataclass(frozen=True)
class Offloading:
    """What offloading blocks[:k] (raw or compressed), and the inputs of the next m blocks
    (recomputed), with a copy queue of ``held`` bytes costs and leaves on the device."""

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
    def of(trace: Trace, k: int, held: int | None, compressed: bool = False, m: int = 0,
           figures: Figures | None = None) -> list["Offloading"]:
        """Per copy queue size to consider (``held``, or: one block's offloaded bytes, and
        everything sent). ``figures``: the trace's, where already read (a Scenario's)."""
        blocks = trace.blocks
        per_block = offloaded_per_block(trace, k, m)
        once = (figures or Figures.of(trace)).offloaded_once(k, k + m)  # the inputs these blocks alone share
        sent = (trace.before_bytes * (k + m > 0) + sum(per_block) + sum(nbytes for *_, nbytes in once)
                + trace.between_bytes + trace.after_bytes - after_kept(trace, k, m))
        if not sent:
            return [Offloading(0, 0, 0.0, 0.0, 0)]
        offloaded = blocks[:k] if compressed else []
        # the link carries frames instead of the framed tensors: the same model, in raw bytes
        # (what the copy queue and the device hold) per ms of link. The saves before and after
        # the blocks (embeddings, the loss: few tensors) and the inputs are counted raw.
        carried = sent - sum(b.framed_bytes - b.frame_bytes for b in offloaded)
        d2h, h2d = (g * 1e6 * sent / carried for g in (trace.d2h_GBps, trace.h2d_GBps))  # raw bytes per ms
        fwd_ms = trace.blocks_forward_ms
        # half of a tensor's host time is its pack, as the first k + m blocks are launched: the GPU
        # hides it only as far as the host has got ahead of it by then (nothing at the step's start).
        # The other half, its unpack, comes at backward's end, behind as much as forward's slack
        slack_ms = max(0.0, trace.forward_device_ms - trace.forward_host_ms)
        lead_ms = max(0.0, trace.lead_ms[k + m]) if k + m < len(trace.lead_ms) else 0.0
        tensors = sum(b.tensors for b in blocks[:k]) + sum(b.input_tensors for b in blocks[k:k + m]) + len(once)
        framed = sum(b.framed for b in offloaded)
        half = (tensors * trace.host_ms_per_tensor + framed * trace.frame_host_ms_per_tensor) / 2
        host_ms = max(0.0, half - lead_ms) + max(0.0, half - slack_ms)
        # a frame being encoded or decoded sits beside its tensor. Kept simple: the largest block's
        # frames, an upper bound (the caching allocator counts a frame only until the host has
        # queued its copy or decoding and let go of it)
        frames = max((b.frame_bytes for b in offloaded), default=0)
        # in full: the codec's kernels share the GPU with the step's, so a GPU-bound step pays them
        codec_ms = sum(b.framed_bytes for b in offloaded) / GiB * trace.frame_device_ms_per_GiB
        out = []
        for h in ([held] if held is not None else sorted({min(sent, max(per_block)), sent})):
            # forward waits while more than `h` bytes wait for the link, until the first k + m blocks are done
            stall = max(0.0, (sent - h) / d2h - sum(b.forward_ms for b in blocks[:k + m]))
            leftover = int(max(0.0, min(h, sent - d2h * (fwd_ms + stall))))
            # what forward did not carry, and all of it back, during backward (about twice forward)
            link = stall + max(0.0, leftover / d2h + sent / h2d - 2 * fwd_ms)
            out.append(Offloading(sent, h, host_ms, link, leftover, frames, compressed, codec_ms))
        return out


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What choose() chooses a plan for: the trace, the budget its predicted peak must fit (of
    saves, and with ``grads`` of parameter gradients too) and what else the planner knows or was
    given. One object rather than a dozen parameters, so that a knob or a measurement added to
    the planner is one field here, read where it matters, and a seam (the Planner's ``chooser=``)
    keeps its signature.

    - ``held_bytes``, ``prefetch_bytes``: the user's storm.offload options where given, else the
      plan picks them: a copy queue of one block or of everything offloaded; a prefetch window of
      one block when no kept block follows the offloaded ones, else none (prefetch then runs as
      far ahead as the room the planner's hooks report as backward reaches each block).
    - ``offload_margin``: what plans that offload were measured to take beyond their prediction:
      they are held to the budget less it.
    - ``codec``: the user's storm.offload option where given: only the plans it allows (compressed
      for a frame codec); else raw or compressed, whichever costs less (raw on ties).
    - ``offload``: only plans that offload (True) or that do not (False); None: either.
    - ``kept_extra``: what a kept block's backward holds beyond a recomputed one's; ``start_extra``:
      what backward's start holds beyond a block's (moments).
    - ``inputs_offloaded``: whether plans may recompute blocks with their inputs offloaded.
    - ``measured``: per Plan.shape of this trace's measured plans, the bytes its step went over
      its target (negative: under). A measured plan fits and ranks by that, not by the
      prediction: the model's terms come from one traced step, and a plan's own step is the
      better witness of its peak."""

    trace: Trace
    budget: int
    _: dataclasses.KW_ONLY
    held_bytes: int | None = None
    prefetch_bytes: int | None = None
    offload_margin: int = 0
    grads: bool = False
    codec: str | None = None
    offload: bool | None = None
    kept_extra: int = 0
    inputs_offloaded: bool = True
    start_extra: int = 0
    measured: Mapping[tuple, int] = dataclasses.field(default_factory=dict)

    def moments(self, offloaded: int, recomputed: set[int] | frozenset[int], in_flight_bytes: int, *,
                inputs_offloaded: int = 0, prefetch: int = 0) -> list[int]:
        """held.moments of a plan's shape, likewise."""
        return moments_of(self.trace, self.figures, offloaded, recomputed, in_flight_bytes, grads=self.grads,
                        kept_extra=self.kept_extra, inputs_offloaded=inputs_offloaded, start_extra=self.start_extra,
                        prefetch=prefetch)

    @functools.cached_property
    def recompute_gains(self) -> tuple[list[int], list[int]]:
        """Per block, what recomputing it takes off every later moment (its saves less its inputs),
        and its place among those that gain, the least forward ms per byte first (the earlier block
        on ties): the order _recompute_until recomputes them in."""
        blocks = self.trace.blocks
        gain = [b.saved_bytes - b.input_bytes for b in blocks]
        rank = [0] * len(blocks)
        gaining = sorted((j for j in range(len(blocks)) if gain[j] > 0),
                         key=lambda j: (blocks[j].forward_ms / gain[j], j))
        for place, j in enumerate(gaining):
            rank[j] = place
        return gain, rank

    @functools.cached_property
    def figures(self) -> Figures:
        """The trace's figures, read once per scenario: choose() runs while the trace stays as it is."""
        return Figures.of(self.trace)


def choose(scenario: Scenario) -> Plan | None:
    """The plan of least predicted cost whose peak is at most the scenario's budget (less its
    ``offload_margin`` for plans that offload), where measured its measured peak, else its
    predicted one; the least-peak plan, fits=False, when none is, of the same figures (a
    measured plan's step over its target, an unmeasured one's prediction over the budget); None
    where there is no plan of the kind asked (every offload more than the store took). Plans
    that recompute blocks with their inputs offloaded come after those that do not, and are
    chosen only where they cost less or peak lower."""
    s, trace = scenario, scenario.trace
    n = len(trace.blocks)
    best: Plan | None = None
    lowest: Plan | None = None
    lowest_over = 0  # its peak over the budget: measured, else predicted with the margin
    measured_shapes = {(shape[0], shape[1]) for shape in s.measured}
    forward_ms = [0.0]  # of blocks[:i], at i
    for b in trace.blocks:
        forward_ms.append(forward_ms[-1] + b.forward_ms)
    shapes = [(k, 0) for k in range(n + 1)]
    shapes += [(k, m) for k in range(n) for m in range(1, n - k + 1)] if s.inputs_offloaded else []
    for k, m in shapes:
        if s.offload is not None and s.offload != (k + m > 0):
            continue
        # none made with inputs offloaded that can neither fit at a cost below the best's (as rounded;
        # recomputing the m blocks costs at least their forward) nor, while none fits, peak below the lowest's
        if m and best is not None and forward_ms[k + m] - forward_ms[k] - 1e-3 >= best.predicted_cost_ms:
            continue
        if m and lowest is not None and (k, m) not in measured_shapes:  # a measured one may beat its bound
            over = _least_peak(s, k, m) - (s.budget - s.offload_margin)
            if over > 0 and (best is not None or over >= lowest_over):
                continue
        for plan, over in _plans(s, k, m):
            if plan.fits and (best is None or plan.predicted_cost_ms < best.predicted_cost_ms):
                best = plan
            if lowest is None or over < lowest_over:
                lowest, lowest_over = plan, over
    return best or lowest


def full_offloads(s: Scenario) -> list[Plan]:
    """Full offload as plans: every save offloaded, the late ones after the blocks too, with
    storm.offload's own copy queue and prefetch window, which full offload's room paces from a
    profiled step of its own (storm/rooms.py); first with every block recomputed (each block's
    inputs offloaded, as over checkpointing: the cheaper where it fits), then with none; in frames
    where the step frames (full_codec), and where that is the planner's choice, not the user's,
    last with none raw: a frame being encoded sits on the device beside its tensor, so the raw
    step can peak lower, at the link's full bytes. choose() never picks them: the room's limits are
    learned from steps, not predicted, so the planner measures them where no plan of its blocks
    measured within its target. Their figures are the model's nearest raw plans (every block
    recomputed with its inputs offloaded; every block offloaded), which the measures replace; one
    is left out where the store took less than that sends."""
    n, out = len(s.trace.blocks), []
    any_codec = dataclasses.replace(s, codec=None)  # a codec given picks the step's frames (plan_context), not these
    framed = full_codec(s.trace, s.codec) in FRAME_CODECS
    for k, m in ((0, n), (n, 0)):
        raw = [plan for plan, _ in _plans(any_codec, k, m) if not plan.compressed]
        if raw:
            nearest = min(raw, key=lambda plan: plan.predicted_peak)
            out.append(dataclasses.replace(nearest, full=True, fits=False, measured_over=None, compressed=framed))
    if framed and s.codec is None and out and not out[-1].recomputed:
        out.append(dataclasses.replace(out[-1], compressed=False))
    return out


def full_codec(trace: Trace, given: str | None, compressed: bool = True) -> str | None:
    """The codec of a full-offload plan's steps: the one given to the planner; else, where the trace
    framed saves (as storm.enable(model) frames a CUDA model's), "auto" for a plan that compresses
    and "raw" for one that does not; else None: the store's."""
    if given:
        return given
    if not any(b.framed for b in trace.blocks):
        return None
    return "auto" if compressed else "raw"


def _least_peak(s: Scenario, k: int, m: int) -> int:
    """No plan that offloads blocks[:k] and the inputs of the next m peaks lower: each later
    block keeps the less of its saves and its inputs, nothing is in flight, nothing beside."""
    blocks = s.trace.blocks
    rest = {j for j in range(k + m, len(blocks)) if blocks[j].saved_bytes >= blocks[j].input_bytes}
    return max(moments_of(s.trace, s.figures, k, set(range(k, k + m)) | rest, 0, grads=s.grads, kept_extra=0,
                        inputs_offloaded=m, start_extra=s.start_extra, prefetch=0))


def _plans(s: Scenario, k: int, m: int) -> list[tuple[Plan, int]]:
    """choose()'s plans that offload blocks[:k] and the inputs of the next m blocks, recomputed,
    per codec and copy queue to consider; each with its peak over the budget it is held to
    (measured, where the scenario has measured it: the plan then fits by that)."""
    trace = s.trace
    blocks, n = trace.blocks, len(trace.blocks)
    # the largest block's offloaded bytes: its saves, or a recomputed block's inputs
    block = max(offloaded_per_block(trace, k, m), default=0)
    allowed = (False, True) if s.codec is None else (s.codec in FRAME_CODECS,)
    # compressed where allowed and the link would carry fewer bytes (else it is raw by another name)
    frameable = any(b.frame_bytes < b.framed_bytes for b in blocks[:k])
    offloading = [off for compressed in sorted({c and frameable for c in allowed})
                  for off in Offloading.of(trace, k, s.held_bytes, compressed, m, s.figures)]
    # the step offloads every save before block k + m (budget None where that is every block: the
    # early saves after it go too, as wiring.py limits it there); the inputs' bytes may count a
    # tensor twice, but the hooks come off after block k + m - 1 anyway
    offload_budget = (None if k + m == n else (trace.offloaded_before[k] if k + m else 0)
                      + sum(b.input_bytes for b in blocks[k:k + m]))
    out = []
    for off in offloading:
        if trace.store_bytes is not None and off.sent > trace.store_bytes:
            continue  # more than the store took: the rest would stay on the device
        room = s.budget - (s.offload_margin if off.sent else 0)
        if s.prefetch_bytes is not None or not off.sent:
            window = s.prefetch_bytes if off.sent else 0  # nothing offloaded: nothing to fetch
            recomputed, peak, cost = _recompute_until(s, k, m, room, off, window)
        else:  # no window while kept blocks follow: backward frees them before it needs the offloaded ones
            window = 0
            recomputed, peak, cost = _recompute_until(s, k, m, room, off, 0)
            if all(i in recomputed for i in range(k, n)):
                window = block
                recomputed, peak, cost = _recompute_until(s, k, m, room, off, block)
        plan = Plan(offloaded=k, recomputed=frozenset(recomputed), offload_budget=offload_budget,
                    max_held_bytes=off.held, prefetch_bytes=window, predicted_peak=peak,
                    predicted_cost_ms=round(cost, 3), fits=peak <= room,
                    in_flight_bytes=off.leftover + off.frames + window, compressed=off.compressed,
                    inputs_offloaded=m)
        over = s.measured.get(plan.shape)
        if over is None:
            out.append((plan, peak - room))
        else:
            out.append((dataclasses.replace(plan, fits=over <= 0, measured_over=over), over))
        out += [(p, p.measured_over) for p in _measured_within(s, plan, off) if p.shape != plan.shape]
    return out


def _measured_within(s: Scenario, plan: Plan, off: Offloading) -> list[Plan]:
    """The plans measured within their target that differ from ``plan`` (as _plans made it) only
    in the blocks they recompute and their prefetch window, costed and predicted as it would be: a
    plan the model predicted over the budget, measured within it (Planner.near_plan), is one
    that the blocks recomputed until the prediction fits never make again."""
    blocks, out = s.trace.blocks, []
    for shape, over in s.measured.items():
        k, m, recomputed, compressed, held, window, full = shape
        if over > 0 or full or (k, m, compressed, held) != (plan.offloaded, plan.inputs_offloaded,
                                                            plan.compressed, plan.max_held_bytes):
            continue
        in_flight = off.leftover + off.frames + window
        peak = max(s.moments(k, recomputed, in_flight, inputs_offloaded=m, prefetch=window))
        cost = off.cost_ms + sum(blocks[j].forward_ms for j in recomputed)
        out.append(dataclasses.replace(plan, recomputed=recomputed, prefetch_bytes=window, predicted_peak=peak,
                                       predicted_cost_ms=round(cost, 3), in_flight_bytes=in_flight, fits=True,
                                       measured_over=over))
    return out


def _running_max(at: list[int]) -> tuple[list[int], list[int]]:
    """Per i, the most of at[:i + 1], and the most of at[i:]."""
    return list(itertools.accumulate(at, max)), list(itertools.accumulate(reversed(at), max))[::-1]


def _recompute_until(s: Scenario, k: int, m: int, budget: int, off: Offloading,
                     window: int) -> tuple[set[int], int, float]:
    """Blocks past the first k + m (the next m of which are recomputed with their inputs
    offloaded) to recompute until the predicted peak fits; with the peak and cost reached (the
    m blocks are in the set). Recomputing block j lowers what every later moment holds (the start of
    backward, and each block i > j as backward reaches it) by its saves less its input, and
    no earlier one: so the moments are met in the order backward's blocks come (block 0's,
    then 1's, ..., then backward's start), each by the cheapest blocks in forward ms per byte
    removed (earlier blocks on ties) among those before it. Picking the cheapest anywhere
    first can spend them where no moment over the budget gains: of many like blocks, the later
    ones a little cheaper each, it would recompute nearly all where a few at the front fit.
    A kept block's own moment also holds ``kept_extra``, which recomputing it removes: for that
    moment it is a candidate too. Meeting each moment in turn can leave blocks that later
    choices made unneeded (like blocks traced a little apart, as noise makes them:
    tests/planner/test_planner_model.py); those go after, the dearest first, while the peak
    still fits."""
    blocks, n, kept_extra = s.trace.blocks, len(s.trace.blocks), s.kept_extra
    in_flight = off.leftover + off.frames + window
    inputs = set(range(k, k + m))  # recomputed with their inputs offloaded
    gain, rank = s.recompute_gains
    # block i's, for i < n (every block past k + m kept, so each with kept_extra), then backward's start
    held_at = s.moments(k, inputs, in_flight, inputs_offloaded=m, prefetch=window)
    recomputed: set[int] = set()
    gained = 0  # of the blocks recomputed so far: each was chosen at a moment no later than this one
    # the blocks a moment may recompute (cheapest first: by rank), each let in at the first moment it lowers
    candidates: list[tuple[int, int]] = []
    for i, held in enumerate(held_at):
        for j in (i, i - 1):
            if k + m <= j < n and gain[j] > 0 and (j == i - 1) != bool(kept_extra):
                heapq.heappush(candidates, (rank[j], j))
        lowered = held - gained
        while lowered > budget and candidates:
            j = heapq.heappop(candidates)[1]
            recomputed.add(j)
            gained += gain[j]
            lowered -= gain[j] if j < i else kept_extra
    at = s.moments(k, inputs | recomputed, in_flight, inputs_offloaded=m, prefetch=window)
    peak = max(at)
    if peak <= budget:
        f = s.figures
        upto, past = _running_max(at)
        for j in sorted(recomputed, key=lambda j: (-blocks[j].forward_ms, -j)):
            # keeping block j adds its kept_extra to its own moment and at most its saves less its own
            # inputs to every later one (backward's start among them; inputs it shares may stay, kept
            # by another block): the moments before it stay
            without = max(upto[j - 1] if j else 0, at[j] + kept_extra, past[j + 1] + f.saved[j] - f.fetched[j])
            if without <= budget:
                recomputed.discard(j)
                at = s.moments(k, inputs | recomputed, in_flight, inputs_offloaded=m, prefetch=window)
                peak = max(at)
                upto, past = _running_max(at)
    recomputed |= inputs
    return recomputed, peak, off.cost_ms + sum(blocks[j].forward_ms for j in recomputed)
