"""What the planner's tests share: small traces for the cost model, the CPU GPT and its
gradients, and fakes passed to a Planner in place of what it measures (a clock, the step's peak
memory, the choice)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Callable

import torch

import storm
import storm.session as session_mod
from storm.examples.models import GPT
from storm.kernels.frame import frame_nbytes
from storm.planner import BlockTrace, Phase, Plan, Scenario, Trace, moments, predicted_peak
from storm.planner.held import without_backward_extras

MiB = 1 << 20


def trace(n: int = 8, saved: int = 100 * MiB, inputs: int = 10 * MiB, fwd_ms: float = 1.0, gbps: float = 50.0,
          host_ms: float = 0.0, tensors: int = 5) -> Trace:
    blocks = [BlockTrace(saved, tensors, inputs, fwd_ms) for _ in range(n)]
    return Trace(blocks, before_bytes=MiB, after_bytes=2 * MiB,
                 offloaded_before=[MiB + i * saved for i in range(n)], host_ms_per_tensor=host_ms,
                 forward_host_ms=n * fwd_ms, forward_device_ms=n * fwd_ms, d2h_GBps=gbps, h2d_GBps=gbps)


def framed(t: Trace, per_block: int, frame_ms: float, saved_by_frames: int | None = None) -> Trace:
    """Every block's tensors are CUDA bf16 ones a frame codec frames (``per_block`` of equal size),
    each adding ``frame_ms`` of host time; their frames save ``saved_by_frames`` bytes per block
    over the link (what real frames save, when None)."""
    for b in t.blocks:
        b.framed, b.framed_bytes = per_block, b.saved_bytes
        b.frame_bytes = (per_block * frame_nbytes(b.saved_bytes // per_block // 2) if saved_by_frames is None
                         else b.saved_bytes - saved_by_frames)
    t.frame_host_ms_per_tensor = frame_ms
    return t


def shared_inputs(t: Trace, each_its_own: bool = False) -> Trace:
    """Every block of ``t`` is called with tensors other blocks are called with too, which
    offloading a block's inputs does not free: one storage for all (as a model passes each layer
    its position embeddings), or with ``each_its_own`` a storage per block that no earlier block
    keeps (as a U-Net's skip connection passes a tensor to two blocks), so that each recomputed
    block keeps its inputs' bytes, offloaded or not."""
    for i, b in enumerate(t.blocks):
        b.shared_inputs = {i if each_its_own else 0: b.input_bytes}
    return t


def gpt() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(seq_len=64, d_model=64, n_heads=4, n_layers=6, dropout=0.1), torch.randint(0, 256, (8, 65))


def grads_of(model: GPT, idx: torch.Tensor, ctx=None) -> list[torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in every step
    with ctx if ctx is not None else torch.enable_grad():
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    if ctx is not None:
        ctx.synchronize()  # every copy done: what backward fetches does not depend on the machine's speed
    loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]  # None: a block not run


def below_checkpointing(blocks: Any, run: Callable[[storm.Offload], Any]) -> int:
    """A budget just below what recomputing every one of ``blocks`` keeps (checkpointing's floor),
    which recomputing them with their inputs offloaded meets even with two blocks' inputs in
    flight (a copy queue and a prefetch window of one block each, all the model counts on a
    FakeClock, whose forward hides no copy), from a step of its own (``run(ctx)``) traced."""
    planner = storm.plan(blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    run(planner.step())
    planner.settled  # reads the step: the trace
    t = planner.trace
    planner.close()
    every, n = set(range(len(t.blocks))), len(t.blocks)
    floor = predicted_peak(t, 0, every, 0, grads=False)
    in_flight = 2 * max(b.input_bytes - b.shared_input_bytes for b in t.blocks)
    assert predicted_peak(t, 0, every, in_flight, grads=False, inputs_offloaded=n) < floor
    return floor - 1


class FakeClock:
    """A planner's clock (storm.planner.Clock) that moves only where a test moves it: the host's
    time and the compute stream's marks are both ``now`` (seconds). Tests of decisions made by
    timings give the timings this way, never by sleeping, which a loaded machine outweighs."""

    def __init__(self, first_calls_load: bool = False) -> None:
        self.now = 0.0
        self.first_calls_load = first_calls_load  # as a GPU's clock: a slow first call is traced again

    def host(self) -> float:
        return self.now

    def mark(self) -> float:
        return self.now

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


def traced_gpt_planner(clock: FakeClock | None = None, **seams: Any) -> tuple[GPT, torch.Tensor, list[torch.Tensor],
                                                                             storm.Planner]:
    """The CPU GPT, its gradients without offload, and a storm.Planner(budget=0.5) over its blocks
    (timed by ``clock``, where given, and with the other ``seams`` given) past the two traced steps."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=clock, **seams)
    for _ in range(2):  # the traces
        grads_of(model, idx, planner.step())
    return model, idx, ref, planner


class ScriptedMemory:
    """Stands in for the CUDA caching allocator's step peak (a Planner's ``memory=``): the trace's
    predicted moments plus ``besides``, and for plans that offload ``extra`` more than they
    predict; a kept block's backward holds ``kept_extra`` more than a recomputed one's, and
    backward's start ``start_extra`` more than a block's. Until restart() (backward has reached
    the blocks) it reads backward's start, then at each restart the next block's backward, last
    to first, as the allocator's peak would read at each moment; from the trace as the offload
    trace made it (what the compute trace measures of each block's backward is the planner's, not
    the allocator's). ``planner`` is the planner it reports to, set once made."""

    def __init__(self, besides: int = 40 * MiB, extra: int = 70 * MiB, kept_extra: int = 0,
                 start_extra: int = 0) -> None:
        self.besides, self.extra, self.kept_extra, self.start_extra = besides, extra, kept_extra, start_extra
        self.available, self.starts, self.reads = True, 0, 0
        self.at: int | None = None  # the block whose backward runs; None before the blocks
        self.planner: storm.Planner | None = None

    def start(self) -> None:
        self.starts += 1
        self.at = None

    def restart(self) -> None:
        self.at = len(self.planner.hooks.blocks) - 1 if self.at is None else self.at - 1

    def peak(self) -> int:
        self.reads += 1
        pl = self.planner
        if pl.plan is None:  # the compute traces: every block recomputed, without the hand-over in the second
            every = set(range(len(pl.trace.blocks)))
            held = moments(without_backward_extras(pl.trace), 0, every, 0, grads=True, start_extra=self.start_extra)
            kept = self.kept_extra * (pl.phase is Phase.TRACE_COMPUTE_KEPT)
            return self.besides + (held[self.at] + kept if self.at is not None else held[-1])
        p = pl.plan
        held = moments(without_backward_extras(pl.trace), p.offloaded, p.recomputed, p.in_flight_bytes, grads=True,
                       kept_extra=self.kept_extra,
                       inputs_offloaded=p.inputs_offloaded, start_extra=self.start_extra, prefetch=p.prefetch_bytes)
        return (self.besides + (held[self.at] if self.at is not None else held[-1])
                + (self.extra if p.offloads else 0))


def pack_clock(monkeypatch) -> FakeClock:
    """A FakeClock that times the training thread's packs (OffloadStats.pack_s) in place of the
    host's: a test moves it where a pack is to take time."""
    clock = FakeClock()
    monkeypatch.setattr(session_mod, "time", SimpleNamespace(perf_counter=clock.host))
    return clock


def recompute_two(s: Scenario) -> Plan | None:
    """choose() for the form trials' tests: recompute blocks 0 and 1, and no plan that offloads
    (none of the other kind: the form's trial comes at once)."""
    return None if s.offload else Plan(offloaded=0, recomputed=frozenset({0, 1}), offload_budget=0, max_held_bytes=0,
                                       prefetch_bytes=0, predicted_peak=1 << 40, predicted_cost_ms=1.0, fits=True)
