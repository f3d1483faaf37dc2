"""``storm.plan``: keep saved activations under a GPU-memory budget at the least step time,
choosing per block of the model: keep on the device, offload, recompute in backward, or
recompute with its inputs offloaded, and whether offloaded tensors go raw or compressed (frames).

    plan = storm.plan(model.blocks, budget="1GiB")  # or a fraction of a step's activation bytes
    plan = storm.plan(model.blocks, peak="6GiB")    # or: the step's peak above its start (CUDA)
    for x in data:
        with plan.step():
            loss = model(x).sum()
        loss.backward()
    print(plan.explain())

The planner traces a step that offloads everything and one that recomputes everything
(trace.py), chooses from them by a cost model (model.py, held.py its arithmetic of memory),
measures what the plan's steps take (measure.py), tries the best plan against an alternative
(trial.py), and says why
(explain.py); driver.py runs those phases a step at a time (phases.py and traced.py: one object
each, state.py: what a trace has taught), wiring.py holds the blocks' hooks. Where the planner
compiles the blocks (``compile_blocks=True``), budgets.py chooses their partitioner's budget
(torch's selective recompute inside each block) with the plan.
docs/planner.md explains the model.
"""

from .driver import Planner, plan
from .held import kept_bytes, moments, predicted_peak
from .measure import CudaPeakMemory, PeakMemory, frame_costs, frames_of, link_bandwidth
from .model import Offloading, Plan, Scenario, choose
from .phases import Phase
from .records import BlockTrace, Trace
from .trial import Clock, Trial

__all__ = ["Planner", "plan", "Phase", "Clock", "Trial", "PeakMemory", "CudaPeakMemory", "link_bandwidth",
           "frame_costs", "frames_of", "BlockTrace", "Trace", "Plan", "Scenario", "Offloading", "choose", "kept_bytes",
           "moments", "predicted_peak"]
