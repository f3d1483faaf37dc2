"""explain(): what it says of a plan's codec, and why (other tests check its other lines
where they check what they describe)."""

from __future__ import annotations

import pytest

import storm
from planner_fakes import MiB, framed, gpt, trace
from storm.planner import Offloading, choose


@pytest.mark.parametrize("hidden_ms, choice", [(50.0, "compressed"), (0.0, "raw")])
def test_explain_says_raw_or_compressed_and_why(hidden_ms, choice):
    model, _ = gpt()
    planner = storm.plan(model.blocks, budget=300 * MiB, mode="embedded")
    t = framed(trace(inputs=60 * MiB, host_ms=0.02), per_block=5, frame_ms=0.1)
    t.forward_device_ms = t.forward_host_ms + hidden_ms  # unhidden, frames' host time outweighs their link time
    planner.trace, planner.plan = t, choose(t, 300 * MiB)
    raw, compressed = (Offloading.of(t, planner.plan.offloaded, planner.plan.max_held_bytes, c)[0]
                       for c in (False, True))
    text = planner.explain()
    assert f"offloaded tensors go {choice}: predicted link {compressed.link_ms:.2f} ms compressed against " \
           f"{raw.link_ms:.2f} ms raw" in text
    assert f"host {compressed.host_ms - raw.host_ms:+.2f} ms (100 us per frame" in text
    assert f"codec kernels +{compressed.codec_ms:.2f} ms on the device (0.00 ms per GiB framed)" in text
    planner.close()
