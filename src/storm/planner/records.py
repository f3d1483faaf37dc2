"""What the traced steps recorded, as the cost model reads it: per block (``BlockTrace``) and for
the step (``Trace``). trace.py records them, model.py and held.py compute on them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class BlockTrace:
    """One block in the traced steps."""

    saved_bytes: int = 0     # offloadable bytes its forward saved: what offloading or recomputing it removes
    tensors: int = 0         # how many storages that was
    input_bytes: int = 0     # tensors it was called with: what recomputing it keeps
    forward_ms: float = 0.0  # what recomputing it costs
    # its backward on the compute stream, its recompute left out (the compute trace's, of a step of one
    # forward); 0 where not measured. What the budget of a compiled block's partitioner changes (budgets.py)
    backward_ms: float = 0.0
    grad_bytes: int = 0      # parameter gradients its backward allocates (none where they outlive the step)
    framed: int = 0          # of its storages, how many a frame codec puts in frames
    framed_bytes: int = 0    # their bytes
    frame_bytes: int = 0     # and their frames': what the link carries for them when compressed
    input_tensors: int = 0   # storages it was called with that no other block was
    # of its inputs, the storages (an identity: bytes) other blocks were called with too (a position
    # bias, a mask): offloading its inputs leaves them there, and blocks that keep them keep one storage
    shared_inputs: dict[int, int] = dataclasses.field(default_factory=dict)
    # where those are in its call (a place in wiring.call_leaves), each position's storage: a planned
    # step that offloads its inputs keeps on the device those a later block keeps anyway (wiring.py)
    shared_at: dict[int, int] = dataclasses.field(default_factory=dict)
    # what its backward held beyond the besides (CUDA, the compute trace's moment: measure.StepPeak),
    # where blocks differ (a block that computes a position bias and runs its embedding's backward);
    # 0 where not measured
    backward_extra: int = 0

    @property
    def shared_input_bytes(self) -> int:
        """Of input_bytes, the storages other blocks were called with too."""
        return sum(self.shared_inputs.values())


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
    # the blocks' backward on the compute stream, their recomputes left out (the compute trace's);
    # None where not measured. Offloading's link model takes twice their forward instead (explain()
    # shows both): measured on models it was not fitted to, it says whether that holds
    backward_device_ms: float | None = None
    lead_ms: list[float] = dataclasses.field(default_factory=list)  # host ahead of the stream at block i, at the end
    d2h_GBps: float = 0.0
    h2d_GBps: float = 0.0
    store_bytes: int | None = None   # what the store took of the offload trace's saves when it refused some
    below_min_bytes: int = 0         # the offload trace's saves that stayed on the device as under min_bytes
    after_early_bytes: int = 0       # of after_bytes, those saved before the largest of them (after_kept)
    between_bytes: int = 0           # saved between blocks, outside them (a step's forwards but its last end there)
    # what saved them, per module outside the blocks ((name, bytes), largest first), where the planner
    # knows the model (trace.OutsideSaves): before the first block, between blocks, after the last
    before_modules: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    between_modules: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    after_modules: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # forwards a step ran before its backward, each calling every block: a block's figures are all its calls'
    forwards: int = 1

    @property
    def total_bytes(self) -> int:
        return self.before_bytes + sum(b.saved_bytes for b in self.blocks) + self.between_bytes + self.after_bytes

    @property
    def blocks_forward_ms(self) -> float:
        """The blocks' forward on the compute stream, all of them: what recomputing every one costs."""
        return sum(b.forward_ms for b in self.blocks)
