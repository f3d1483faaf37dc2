"""explain(): what it says of a plan's codec, and why (other tests check its other lines
where they check what they describe)."""

from __future__ import annotations

import pytest

import storm
from planner_fakes import MiB, framed, gpt, trace
from storm.planner import Offloading, Plan, Scenario, choose, predicted_peak


@pytest.mark.parametrize("hidden_ms, choice", [(50.0, "compressed"), (0.0, "raw")])
def test_explain_says_raw_or_compressed_and_why(hidden_ms, choice):
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=300 * MiB, mode="embedded")
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + hidden_ms  # unhidden, frames' host time outweighs their link time
    planner.trace, planner.plan = t, choose(Scenario(t, 300 * MiB))
    raw, compressed = (Offloading.of(t, planner.plan.offloaded, planner.plan.max_held_bytes, c)[0]
                       for c in (False, True))
    text = planner.explain()
    assert f"offloaded tensors go {choice} (codec): predicted link {compressed.link_ms:.2f} ms compressed against " \
           f"{raw.link_ms:.2f} ms raw" in text
    assert f"host {compressed.host_ms - raw.host_ms:+.2f} ms (100 us per compressed tensor" in text
    assert f"compression kernels +{compressed.codec_ms:.2f} ms on the device (0.00 ms per GiB compressed)" in text
    planner.close()


def test_explain_says_a_frames_host_time_was_measured_in_a_planned_step():
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=300 * MiB, mode="embedded")
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + 50
    planner.trace, planner.plan = t, choose(Scenario(t, 300 * MiB))
    assert "us per compressed tensor, less what" in planner.explain()
    planner.state.traced_frame_host_ms_per_tensor = 0.03
    assert "(100 us per compressed tensor in a planned step, 30 measured apart, less what" in planner.explain()
    planner.close()


def test_explain_names_the_blocks_recomputed_with_their_inputs_offloaded_and_what_lies_outside_the_blocks():
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=300 * MiB, mode="embedded")
    t = trace(n=8, saved=100 * MiB, inputs=30 * MiB, gbps=1.0)
    for b in t.blocks:
        b.input_tensors = 1
    planner.trace = t
    planner.plan = p = choose(Scenario(t, predicted_peak(t, 0, set(range(8)), 0, grads=False) - 60 * MiB))
    first, last = p.offloaded, p.offloaded + p.inputs_offloaded - 1
    assert p.inputs_offloaded > 1
    lines = planner.explain().splitlines()
    decisions = [line.split()[5:] for line in lines[3:11]]
    assert decisions == [["offload"]] * first + [["recompute,", "inputs", "offloaded"]] * p.inputs_offloaded + \
        [["recompute"] if i in p.recomputed else ["keep"] for i in range(last + 1, 8)]
    assert f"blocks {first}-{last} recomputed with their inputs offloaded: {30.0 * p.inputs_offloaded:.1f} MiB in " \
           f"{p.inputs_offloaded} tensors fetched back when backward recomputes them" in lines
    assert "before the blocks: 1.0 MiB saved (storm.plan's model= names the modules that saved it); offloaded" in lines
    assert "after the blocks: 2.0 MiB saved (storm.plan's model= names the modules that saved it); kept on the " \
           "device" in lines
    planner.close()


@pytest.mark.parametrize("fwd_ms, options, held, window", [
    (10.0, {}, "one block's offloaded bytes, of the two queues weighed",
     "none beyond the room the planner's hooks report"),
    (1.0, {}, "all the step sends, of the two queues weighed", "none beyond the room the planner's hooks report"),
    (10.0, {"max_held_bytes": 7 * MiB, "prefetch_bytes": 3 * MiB}, "as given", "as given"),
])
def test_explain_says_why_the_copy_queue_and_prefetch_window_are_what_they_are(fwd_ms, options, held, window):
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=500 * MiB, mode="embedded", **options)
    t = trace(fwd_ms=fwd_ms)  # the plan offloads the first blocks and keeps the rest
    planner.trace = t
    planner.plan = p = choose(Scenario(t, 500 * MiB, held_bytes=options.get("max_held_bytes"),
                                       prefetch_bytes=options.get("prefetch_bytes")))
    assert p.offloaded and len(p.recomputed) < len(t.blocks) - p.offloaded  # kept blocks follow the offloaded
    line = next(line for line in planner.explain().splitlines() if line.startswith("copies: "))
    assert f"(max_held_bytes: {held}" in line and f"(prefetch_bytes: {window}" in line
    planner.close()


def offload_two(s: Scenario) -> Plan:
    """A choice that offloads blocks 0-1, whatever the host's speed."""
    return Plan(offloaded=2, recomputed=frozenset(), offload_budget=s.trace.offloaded_before[2], max_held_bytes=1 << 30,
                prefetch_bytes=0, predicted_peak=1 << 30, predicted_cost_ms=0.0, fits=True)


def test_explain_says_the_min_bytes_in_force_and_what_it_kept_in_the_traced_step():
    """min_bytes is the user's option, not the plan's: explain() says which is in force and how many
    of the traced step's saves it kept on the device (the CPU GPT's small saves: fewer under 1 KiB)."""
    from planner_fakes import grads_of

    kept = {}
    for given, said in (({}, "64KiB (storm.offload default)"), ({"min_bytes": "1KiB"}, "1KiB (as given)")):
        model, idx = gpt()
        planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", chooser=offload_two, **given)
        for _ in range(3):
            grads_of(model, idx, planner.step())
        assert planner.plan is not None and planner.plan.offloads
        kept[said] = n = planner.trace.below_min_bytes
        assert f"min_bytes: {said}; {n} saves of the traced step were smaller and stayed on the device (what " \
               f"min_bytes moves is saves and their host time, hardly bytes: the plan does not vary it)" \
               in planner.explain().splitlines()
        planner.close()
    assert kept["64KiB (storm.offload default)"] > kept["1KiB (as given)"]
    # the count is the saves a plain storm.offload step of the same forward keeps as under min_bytes
    model, idx = gpt()
    with storm.offload(mode="embedded") as ctx:
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert kept["64KiB (storm.offload default)"] == ctx.stats.kept["below min_bytes"]
