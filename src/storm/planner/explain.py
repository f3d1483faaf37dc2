"""``Planner.explain()``: per block what was measured and what the plan does with it, the
predicted totals, the trials and the measured peak, as text. docs/planner.md ("What
``explain()`` prints") shows an example.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..mover import FRAME_MIN_BYTES
from .model import Offloading, Plan, Trace, after_kept, fetched_inputs
from .trial import Trial

MiB = 1 << 20


class Explained(Protocol):
    """What explain() reads of a Planner."""

    trace: Trace | None
    plan: Plan | None
    budget: int | float | None
    peak: int | None
    reentrant: bool
    compiled: bool
    options: dict[str, Any]
    traced_host_ms_per_tensor: float | None
    replans: int
    trials: list[Trial]
    besides: int | None
    start_extra: int
    measured_peak: int | None
    checks: int

    @property
    def phase(self) -> Any: ...

    @property
    def target(self) -> int | None: ...

    @property
    def kept_extra(self) -> int: ...

    @property
    def margins(self) -> dict[bool, int]: ...


def explain(planner: Explained) -> str:
    """Per block what was measured and what the plan does with it, and the predicted totals."""
    if planner.plan is None or planner.trace is None:
        return f"storm.plan: {planner.phase.value.replace('-', ' ')} step next; no plan yet"
    t, p = planner.trace, planner.plan
    want = (f"peak {planner.peak / MiB:.1f} MiB above the step's start" if planner.peak is not None
            else f"budget {_describe_budget(planner.budget, t.total_bytes)}")
    host = f"host {t.host_ms_per_tensor * 1e3:.0f} us per offloaded tensor" + (
        "" if planner.traced_host_ms_per_tensor is None
        else f" (measured in a planned step; traced {planner.traced_host_ms_per_tensor * 1e3:.0f})")
    lines = [f"storm.plan: {want}; link {t.d2h_GBps:.1f} GB/s to host, {t.h2d_GBps:.1f} back; {host}; "
             f"forward {t.forward_host_ms:.2f} ms host, {t.forward_device_ms:.2f} ms compute stream",
             f"{'block':>5} {'saved MiB':>10} {'tensors':>7} {'input MiB':>10} {'forward ms':>10}  decision"]
    for i, b in enumerate(t.blocks):
        what = ("offload" if i < p.offloaded else "recompute, inputs offloaded" if i < p.offloaded + p.inputs_offloaded
                else "recompute" if i in p.recomputed else "keep")
        lines.append(f"{i:>5} {b.saved_bytes / MiB:>10.1f} {b.tensors:>7} {b.input_bytes / MiB:>10.1f} "
                     f"{b.forward_ms:>10.3f}  {what}")
    lines.append(f"outside the blocks: {t.before_bytes / MiB:.1f} MiB saved before them (embeddings; "
                 f"{'offload' if p.offloads else 'keep'}), {t.after_bytes / MiB:.1f} MiB after them (final norm, "
                 f"logits, loss; {_after_blocks(t, p)})")
    if p.inputs_offloaded:
        lines.append(_inputs_offloaded(t, p))
    lines.append(f"copy queue {p.max_held_bytes / MiB:.1f} MiB, prefetch window {p.prefetch_bytes / MiB:.1f} MiB"
                 + (" (given)" if {"max_held_bytes", "prefetch_bytes"} & planner.options.keys() else ""))
    if p.recomputed:
        lines.append(_recompute_form(p, planner.reentrant, planner.compiled))
    if t.store_bytes is not None:
        lines.append(f"the store took {t.store_bytes / MiB:.1f} of the {t.total_bytes / MiB:.1f} MiB traced: "
                     "plans offload at most that")
    lines.append(_codec(t, p, "codec" in planner.options))
    lines.append(f"predicted: {p.predicted_peak / MiB:.1f} MiB saved on the device at the peak "
                 f"({'fits' if p.fits else 'does NOT fit'}), {p.predicted_cost_ms:.2f} ms over no offload; "
                 f"re-planned {planner.replans} times")
    lines += [trial.describe() for trial in planner.trials]
    if planner.besides is not None:
        measured = "not yet" if planner.measured_peak is None else f"{planner.measured_peak / MiB:.1f} MiB"
        margins = planner.margins
        lines.append(f"measured: step peak {measured} against a target of {planner.target / MiB:.1f} MiB "
                     f"(besides the saves {planner.besides / MiB:.1f} MiB at a block's backward, "
                     f"{planner.start_extra / MiB:+.1f} at backward's start, and {planner.kept_extra / MiB:.1f} "
                     f"more while a kept block's backward runs); margins {margins[False] / MiB:.1f} "
                     f"MiB, plus {margins[True] / MiB:.1f} MiB for plans that offload, after "
                     f"{planner.checks} measured steps")
    return "\n".join(lines)


def _recompute_form(p: Plan, reentrant: bool, compiled: bool) -> str:
    """How the plan's blocks are recomputed, and why (``reentrant``: the planner's own form)."""
    if p.reentrant:
        return "recomputed in the reentrant form (storm.recompute)"
    if reentrant:
        return "recomputed with torch's non-reentrant checkpoint, faster here in its trial"
    if compiled:
        return "recomputed with torch's non-reentrant checkpoint (compiled blocks: it runs their training graph)"
    return "recomputed with torch's non-reentrant checkpoint (reentrant=False)"


def _inputs_offloaded(t: Trace, p: Plan) -> str:
    """Which blocks are recomputed with their inputs offloaded, and what that moves."""
    first, last = p.offloaded, p.offloaded + p.inputs_offloaded - 1
    blocks = t.blocks[first:last + 1]
    which = f"block {first}" if first == last else f"blocks {first}-{last}"
    shared = sum(b.shared_input_bytes for b in blocks)
    return (f"{which} recomputed with their inputs offloaded: {sum(map(fetched_inputs, blocks)) / MiB:.1f} MiB in "
            f"{sum(b.input_tensors for b in blocks)} tensors fetched back when backward recomputes them"
            + (f"; {shared / MiB:.1f} MiB of inputs other blocks are called with too stay" if shared else ""))


def _codec(t: Trace, p: Plan, given: bool) -> str:
    """Whether offloaded tensors go raw or compressed, and the predicted times that chose it."""
    if not p.offloads:
        return "nothing offloaded: no codec"
    offloaded, given_text = t.blocks[:p.offloaded], " (codec given)" if given else ""
    framed_bytes, frame_bytes = sum(b.framed_bytes for b in offloaded), sum(b.frame_bytes for b in offloaded)
    if frame_bytes >= framed_bytes:
        return (f"offloaded tensors go raw{given_text}: none would be framed (frames are for CUDA bf16 tensors of "
                f"at least {FRAME_MIN_BYTES / MiB:g} MiB)")
    raw, compressed = (Offloading.of(t, p.offloaded, p.max_held_bytes, c, p.inputs_offloaded)[0] for c in (False, True))
    framed = sum(b.framed for b in offloaded)
    return (f"offloaded tensors go {'compressed' if p.compressed else 'raw'}{given_text}: predicted link "
            f"{compressed.link_ms:.2f} ms compressed against {raw.link_ms:.2f} ms raw ({framed_bytes / MiB:.1f} "
            f"MiB in {framed} tensors would cross as {frame_bytes / MiB:.1f} MiB of frames), host "
            f"{compressed.host_ms - raw.host_ms:+.2f} ms ({t.frame_host_ms_per_tensor * 1e3:.0f} us per frame, "
            f"less what the compute stream hides), codec kernels +{compressed.codec_ms:.2f} ms on the device "
            f"({t.frame_device_ms_per_GiB:.2f} ms per GiB framed)")


def _describe_budget(budget: int | float, total: int) -> str:
    if isinstance(budget, float):
        return f"{budget:.0%} of {total / MiB:.1f} MiB saved per step"
    return f"{budget / MiB:.1f} MiB of {total / MiB:.1f} MiB saved per step"


def _after_blocks(t: Trace, p: Plan) -> str:
    """What the plan does with the saves after the blocks."""
    if after_kept(t, p.offloaded, p.inputs_offloaded) == t.after_bytes:
        return "keep"
    return f"offload the {t.after_early_bytes / MiB:.1f} MiB saved before the largest"
