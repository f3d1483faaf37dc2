"""``Planner.explain()``: whether the plan is settled (and if not, what the next steps do), per
block what was measured and what the plan does with it, what the modules outside the blocks
saved, the predicted totals, the trials and the measured peak, as text, with storm.offload's
option names beside what they set. docs/planner.md ("What ``explain()`` prints") shows an example.
"""

from __future__ import annotations

from typing import Any, Protocol

from stormd.wire.sizes import format_size

from ..frames import FRAME_MIN_BYTES
from ..policy import DEFAULT_MIN_BYTES
from .budgets import BudgetSearch
from .held import after_kept, fetched_inputs, offloaded_per_block, shared_staying
from .model import Offloading, Plan, full_codec
from .records import Trace
from .trial import Trial

MiB = 1 << 20
OUTSIDE_NAMED = 4  # the modules named per side of the blocks, the largest; the rest are counted
# What a traced step is for, by Phase value (phases.Phase)
_TRACED = {
    "trace-offload": "is traced with every save offloaded (what each block saves)",
    "trace-compute": "is traced with every block recomputed (what recomputing each costs)",
    "trace-compute-kept": "is traced with every block recomputed and its saves held as a kept block's (what a "
                          "kept block's backward holds beyond them)",
}


class Explained(Protocol):
    """What explain() reads of a Planner."""

    trace: Trace | None
    plan: Plan | None
    budget: int | float | None
    peak: int | None
    reentrant: bool
    compiled: bool
    options: dict[str, Any]
    replans: int
    block_budget: float | None
    search: BudgetSearch | None

    @property
    def traced_host_ms_per_tensor(self) -> float | None: ...

    @property
    def traced_frame_host_ms_per_tensor(self) -> float | None: ...

    @property
    def trials(self) -> list[Trial]: ...

    @property
    def besides(self) -> int | None: ...

    @property
    def start_extra(self) -> int: ...

    @property
    def measured_peak(self) -> int | None: ...

    @property
    def checks(self) -> int: ...

    @property
    def phase(self) -> Any: ...

    @property
    def target(self) -> int | None: ...

    @property
    def kept_extra(self) -> int: ...

    @property
    def trying(self) -> Trial | None: ...

    @property
    def margins(self) -> dict[bool, int]: ...

    @property
    def measured_plans(self) -> int: ...

    @property
    def smaller_steps(self) -> int: ...

    def peak_moments(self, plan: Plan | None = None) -> list[tuple[int, int | None]] | None: ...


def explain(planner: Explained) -> str:
    """Whether the plan is settled, per block what was measured and what the plan does with it,
    what was saved outside the blocks, the predicted totals, the trials and the measured peak."""
    if planner.plan is None or planner.trace is None:
        return "\n".join([f"storm.plan: no plan yet; the next step {_TRACED[planner.phase.value]}", *_smaller(planner)])
    t, p = planner.trace, planner.plan
    want = (f"peak {planner.peak / MiB:.1f} MiB above the step's start" if planner.peak is not None
            else f"budget {_describe_budget(planner.budget, t.total_bytes)}")
    host = f"host {t.host_ms_per_tensor * 1e3:.0f} us per offloaded tensor" + (
        "" if planner.traced_host_ms_per_tensor is None
        else f" (measured in a planned step; traced {planner.traced_host_ms_per_tensor * 1e3:.0f})")
    backward = ("" if t.backward_device_ms is None else
                f"; the blocks' backward {t.backward_device_ms:.2f} ms compute stream (offloading's link model "
                f"takes twice their forward, {2 * t.blocks_forward_ms:.2f})")
    lines = [f"storm.plan: {want}; link {t.d2h_GBps:.1f} GB/s to host, {t.h2d_GBps:.1f} back; {host}; "
             f"forward {t.forward_host_ms:.2f} ms host, {t.forward_device_ms:.2f} ms compute stream{backward}",
             _standing(planner),
             *_budgets(planner),
             *_smaller(planner),
             *([f"a step is {t.forwards} forwards before one backward: each block's figures are its {t.forwards} "
                f"calls' together, and the plan decides for all of them"] if t.forwards > 1 else []),
             f"{'block':>5} {'saved MiB':>10} {'tensors':>7} {'input MiB':>10} {'forward ms':>10}  decision"]
    for i, b in enumerate(t.blocks):
        what = ("offload" if i < p.offloaded else "recompute, inputs offloaded" if i < p.offloaded + p.inputs_offloaded
                else "recompute" if i in p.recomputed else "keep")
        lines.append(f"{i:>5} {b.saved_bytes / MiB:>10.1f} {b.tensors:>7} {b.input_bytes / MiB:>10.1f} "
                     f"{b.forward_ms:>10.3f}  {what}")
    if p.full:
        codec = full_codec(t, planner.options.get("codec"), p.compressed)
        lines.append("full offload: every save is offloaded, those outside the blocks too, with storm.offload's own "
                     "copy queue and prefetch window, which full offload's room paces (storm/rooms.py), codec "
                     f"{codec or 'of the store'}{', as given' if 'codec' in planner.options else ''}; measured "
                     "because no plan of the blocks measured within the target")
    else:
        lines += _outside(t, p)
        if p.inputs_offloaded:
            lines.append(_inputs_offloaded(t, p))
        lines.append(_copies(t, p, planner.options))
    if p.offloads:
        lines.append(_min_bytes(t, planner.options))
    if p.recomputed:
        lines.append(_recompute_form(planner, p))
    if t.store_bytes is not None:
        lines.append(f"the store took {t.store_bytes / MiB:.1f} of the {t.total_bytes / MiB:.1f} MiB traced: "
                     "plans offload at most that")
    if p.offloads and not p.full:
        lines.append(_codec(t, p, "codec" in planner.options, planner.traced_frame_host_ms_per_tensor))
    if p.full:  # its room's limits come from a profiled step: the model has the nearest plan of the blocks only
        lines.append(f"predicted: nothing of full offload's peak, which its room makes and its steps measure (the "
                     f"nearest plan of the blocks: {p.predicted_peak / MiB:.1f} MiB saved on the device at the "
                     f"peak, {p.predicted_cost_ms:.2f} ms over no offload); re-planned {planner.replans} times")
    else:
        lines.append(f"predicted: {p.predicted_peak / MiB:.1f} MiB saved on the device at the peak "
                     f"({'fits' if p.fits else 'does NOT fit'}), {p.predicted_cost_ms:.2f} ms over no offload; "
                     f"re-planned {planner.replans} times")
    lines += [trial.describe() for trial in planner.trials]
    if planner.besides is not None:
        measured = "not yet" if planner.measured_peak is None else f"{planner.measured_peak / MiB:.1f} MiB"
        margins = planner.margins
        extras = [b.backward_extra for b in t.blocks]
        each = (f" ({min(extras) / MiB:+.1f} to {max(extras) / MiB:+.1f} MiB by block, as each block's backward "
                f"measured)" if any(extras) else "")
        lines.append(f"measured: step peak {measured} against a target of {planner.target / MiB:.1f} MiB "
                     f"(besides the saves {planner.besides / MiB:.1f} MiB at a block's backward{each}, "
                     f"{planner.start_extra / MiB:+.1f} at backward's start, and {planner.kept_extra / MiB:.1f} "
                     f"more while a kept block's backward runs); margins {margins[False] / MiB:.1f} "
                     f"MiB, plus {margins[True] / MiB:.1f} MiB for plans that offload, after "
                     f"{planner.checks} measured steps")
        lines.append(_measured(planner, p))
        at = planner.peak_moments(p)
        if at is not None:
            lines.append(_moments(at))
    return "\n".join(lines)


def _budgets(planner: Explained) -> list[str]:
    """Where the planner compiles the blocks: their partitioner's budget, and the budgets weighed."""
    search = planner.search
    if search is None or planner.block_budget is None:
        return []
    weighed = "; ".join(f"{t.budget:g}: {t.cost_ms:.2f} ms, " + ("fits" if t.fits else f"{t.over / MiB:+.1f} MiB over")
                        for t in search.tried)
    if search.unweighed:
        where = ("no budget below 1 weighed: the compute trace did not time the blocks' backward one by one (a step "
                 "of several forwards)")
    elif search.done:
        where = (f"chosen of the budgets traced, by the blocks' forward and backward measured at each plus the "
                 f"plan's predicted cost ({weighed})")
    else:
        where = f"tracing the budgets from 1.0 down ({weighed or 'none yet'})"
    return [f"blocks compiled by storm.plan (inductor), their partitioner at activation_memory_budget "
            f"{planner.block_budget:g} (torch's selective recompute inside each block; 1 is none): {where}"]


def _moments(at: list[tuple[int, int | None]]) -> str:
    """Where the plan's step was predicted to peak and where it was measured to, each moment's
    prediction against its measure (``at``: Planner.peak_moments)."""
    def name(i: int) -> str:
        return "backward's start" if i == len(at) - 1 else f"block {i}'s backward"

    def one(i: int) -> str:
        predicted, measured = at[i]
        read = "not measured alone" if measured is None else f"{measured / MiB:.1f} measured"
        return f"{name(i)}, {predicted / MiB:.1f} MiB predicted, {read}"
    predicted_at = max(range(len(at)), key=lambda i: at[i][0])
    measured_at = max(range(len(at)), key=lambda i: -1 if at[i][1] is None else at[i][1])
    if predicted_at == measured_at:
        return f"peaks, predicted and measured, at {one(predicted_at)}"
    return f"predicted to peak at {one(predicted_at)}; measured to peak at {one(measured_at)}"


def _measured(planner: Explained, p: Plan) -> str:
    """What the plans measured this trace decided: each fits and ranks by its measured peak."""
    if p.measured_over is None:
        return f"plans measured: {planner.measured_plans}, ranked by their measured peaks; this one not yet"
    where = f"{abs(p.measured_over) / MiB:.1f} MiB {'over' if p.measured_over > 0 else 'under'} its target"
    if p.fits:
        return f"plans measured: {planner.measured_plans}, ranked by their measured peaks; this one {where}"
    return (f"plans measured: {planner.measured_plans}, ranked by their measured peaks; none fits, so this one, "
            f"of least measured peak, is kept: {where}")


def _standing(planner: Explained) -> str:
    """Whether the plan is settled, and if not, what the next steps do to it."""
    phase = planner.phase.value
    if phase == "settled":
        return ("settled: no further step measures, tries or changes this plan while steps run as the traced one did, "
                "or on smaller inputs")
    if phase in _TRACED:  # a plan, and a step traced again
        return (f"not settled: the last step ran unlike the traced one (block 0's inputs larger, say), so "
                f"the next step {_TRACED[phase]} and the plan is made anew")
    if phase == "measure":
        target = "" if planner.target is None else f" of {planner.target / MiB:.1f} MiB"
        return (f"not settled yet: the next step measures its peak against the target{target}; a step over it "
                "leaves a margin and the plan is made again")
    if phase == "measure-near":
        return (f"not settled yet: the next step measures a cheaper plan predicted a little over the target of "
                f"{(planner.target or 0) / MiB:.1f} MiB, as the model was measured long on the plan within it; "
                "measured within, it is kept")
    if phase == "measure-full":
        return ("not settled yet: no plan of the blocks measured within the target, so full offload is measured: "
                "its room profiles a step and tries what it keeps, and the first step that follows the room it "
                "settles on is its measure")
    if phase == "check-host":
        return ("not settled yet: a coming step that offloads has its host time per offloaded tensor read; "
                "dearer than traced, the plan is made again with it")
    trying = planner.trying
    assert trying is not None  # phase "try"
    return f"not settled yet: {trying.describe()}; the plan below is the last step's"


def _smaller(planner: Explained) -> list[str]:
    """The steps since the last trace began whose block 0 took smaller inputs than traced, or that
    left a block out."""
    n = planner.smaller_steps
    if not n:
        return []
    return [f"{n} step{'s' * (n != 1)} since this trace began took smaller inputs at block 0 than the traced "
            "step (a shorter longest sequence, a smaller batch) or left a block out (a layer dropped): each ran "
            "as the step before it did and was not read, so the plan is made, measured and tried on steps like "
            "the traced one, of the largest inputs so far; it holds for smaller ones, whose saves and peak only "
            "shrink"]


def _outside(t: Trace, p: Plan) -> list[str]:
    """What the step saved outside the blocks, by module where the planner knows the model, and
    what the plan does with it."""
    after = ("kept on the device" if after_kept(t, p.offloaded, p.inputs_offloaded) == t.after_bytes + t.between_bytes
             else f"the first {_size(t.after_early_bytes)} (saved before its largest tensor) offloaded, the rest "
                  f"kept on the device")
    lines = [f"before the blocks: {_saved(t.before_bytes, t.before_modules)}"
             + (f"; {'offloaded' if p.offloads else 'kept on the device'}" if t.before_bytes else ""),
             f"after the blocks: {_saved(t.after_bytes, t.after_modules)}" + (f"; {after}" if t.after_bytes else "")]
    if t.between_bytes:
        lines.append(f"between the blocks: {_saved(t.between_bytes, t.between_modules)}; counted as kept on the "
                     f"device")
    return lines


def _saved(nbytes: int, modules: list[tuple[str, int]]) -> str:
    """``nbytes`` saved, and by which modules: the largest few."""
    if not nbytes:
        return "nothing saved"
    if not modules:
        return f"{_size(nbytes)} saved (storm.plan's model= names the modules that saved it)"
    named = ", ".join(f"{name} {_size(b)}" for name, b in modules[:OUTSIDE_NAMED])
    more = len(modules) - OUTSIDE_NAMED
    return f"{_size(nbytes)} saved by {named}" + (f" and {more} more" if more > 0 else "")


def _size(nbytes: int) -> str:
    """Bytes in MiB, or KiB below one (a small model's saves outside its blocks)."""
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB or not nbytes else f"{max(1, round(nbytes / 1024))} KiB"


def _copies(t: Trace, p: Plan, options: dict[str, Any]) -> str:
    """What the plan lets wait for the link, and fetch ahead, in storm.offload's options' terms,
    and why those sizes (choose()'s knobs, where not given)."""
    if not p.offloads:
        return "nothing is offloaded: every save stays on the device" + (
            " or, in a recomputed block, is rebuilt in backward" if p.recomputed else "")
    if "max_held_bytes" in options:
        held = "as given"
    elif p.max_held_bytes <= max(offloaded_per_block(t, p.offloaded, p.inputs_offloaded), default=0):
        held = "one block's offloaded bytes, of the two queues weighed: forward waits for the link past one block"
    else:
        held = "all the step sends, of the two queues weighed: the link is predicted to keep up without waits"
    if "prefetch_bytes" in options:
        window = "as given"
    elif p.prefetch_bytes:
        window = "one block: no kept block follows the offloaded ones to free room before they are needed"
    else:
        window = ("none beyond the room the planner's hooks report as backward reaches each block: kept blocks "
                  "after the offloaded ones free theirs first")
    return (f"copies: at most {_size(p.max_held_bytes)} of saves wait for their copy to the host, forward waiting "
            f"past that (max_held_bytes: {held}); backward fetches up to {_size(p.prefetch_bytes)} "
            f"ahead of its need (prefetch_bytes: {window})")


def _min_bytes(t: Trace, options: dict[str, Any]) -> str:
    """The min_bytes the plan's steps offload by, and what it kept in the traced step: the user's
    option, not a plan's choice (docs/planner.md says why). ``options`` are as plan_options checked
    them: sizes already in bytes."""
    given = "min_bytes" in options
    limit = options.get("min_bytes", DEFAULT_MIN_BYTES)
    return (f"min_bytes: {format_size(limit)} ({'as given' if given else 'storm.offload default'}); "
            f"{t.below_min_bytes} saves of the traced step were smaller and stayed on the device (what min_bytes "
            f"moves is saves and their host time, hardly bytes: the plan does not vary it)")


def _recompute_form(planner: Explained, p: Plan) -> str:
    """How the plan's blocks are recomputed, and why: the form trial (running, or what it kept),
    the user's reentrant=False, or compiled blocks."""
    form = "in the reentrant form (storm.recompute)" if p.reentrant else "with torch's non-reentrant checkpoint"
    trying = planner.trying
    if trying is not None and trying.forms:
        return f"recomputed {form} in the last step: the two forms are being tried (above)"
    tried = next((t for t in reversed(planner.trials) if t.forms), None)
    if tried is not None and tried.kept == p:
        why = ("the other went over its target" if tried.over is not None
               else "neither was faster" if tried.gain_ms == 0 else "faster there")
        return f"recomputed {form}, kept in its trial against the other form: {why}"
    if not p.reentrant and planner.compiled:
        return f"recomputed {form} (compiled blocks: it runs their training graph)"
    if not p.reentrant and not planner.reentrant:
        return f"recomputed {form} (reentrant=False)"
    return f"recomputed {form}"


def _inputs_offloaded(t: Trace, p: Plan) -> str:
    """Which blocks are recomputed with their inputs offloaded, and what that moves."""
    first, last = p.offloaded, p.offloaded + p.inputs_offloaded - 1
    blocks = t.blocks[first:last + 1]
    which = f"block {first}" if first == last else f"blocks {first}-{last}"
    shared = {key: n for b in blocks for key, n in b.shared_inputs.items()}  # each storage once
    staying = shared_staying(t, last + 1)
    stay = sum(n for key, n in shared.items() if key in staying)
    once = sum(shared.values()) - stay
    return (f"{which} recomputed with their inputs offloaded: {_size(sum(map(fetched_inputs, blocks)))} in "
            f"{sum(b.input_tensors for b in blocks)} tensors fetched back when backward recomputes them"
            + (f"; {_size(stay)} of inputs a later block is called with too stay on the device" if stay else "")
            + (f"; {_size(once)} of inputs these blocks alone share offloaded once" if once else ""))


def _codec(t: Trace, p: Plan, given: bool, apart: float | None = None) -> str:
    """Whether offloaded tensors go raw or compressed, and the predicted times that chose it
    (``apart``: a frame's host time as measured apart, where a planned step measured more)."""
    offloaded, given_text = t.blocks[:p.offloaded], ", as given" if given else ""
    framed_bytes, frame_bytes = sum(b.framed_bytes for b in offloaded), sum(b.frame_bytes for b in offloaded)
    if not offloaded:  # inputs and saves outside the blocks go by the codec chosen for the blocks' saves
        how = "by the codec given" if given else "raw (codec)"
        return f"offloaded tensors go {how}: no block's saves are offloaded, the only ones frames are weighed for"
    if frame_bytes >= framed_bytes:
        return (f"offloaded tensors go raw (codec{given_text}): none of the offloaded blocks' saves would be "
                f"compressed (compression is for CUDA bf16, bool and float32 tensors of at least "
                f"{FRAME_MIN_BYTES / MiB:g} MiB)")
    raw, compressed = (Offloading.of(t, p.offloaded, p.max_held_bytes, c, p.inputs_offloaded)[0] for c in (False, True))
    framed = sum(b.framed for b in offloaded)
    return (f"offloaded tensors go {'compressed' if p.compressed else 'raw'} (codec{given_text}): predicted link "
            f"{compressed.link_ms:.2f} ms compressed against {raw.link_ms:.2f} ms raw ({framed_bytes / MiB:.1f} "
            f"MiB in {framed} tensors would cross as {frame_bytes / MiB:.1f} MiB compressed), host "
            f"{compressed.host_ms - raw.host_ms:+.2f} ms ({t.frame_host_ms_per_tensor * 1e3:.0f} us per compressed "
            f"tensor{'' if apart is None else f' in a planned step, {apart * 1e3:.0f} measured apart'}, less what "
            f"the compute stream hides), compression kernels +{compressed.codec_ms:.2f} ms on the "
            f"device ({t.frame_device_ms_per_GiB:.2f} ms per GiB compressed)")


def _describe_budget(budget: int | float, total: int) -> str:
    if isinstance(budget, float):
        return f"{budget:.0%} of {total / MiB:.1f} MiB saved per step"
    return f"{budget / MiB:.1f} MiB of {total / MiB:.1f} MiB saved per step"
