"""What the planner's hooks on a step rely on in storm.offload: allow_prefetch() lets backward
fetch ahead as far as the room reported, and drain() lets go of copied tensors once the
saved-tensor hooks are off."""

from __future__ import annotations

import pytest
import torch

import storm
from planner_fakes import MiB, gpt, grads_of
from storm.planner import BlockTrace, Plan, Trace
from storm.planner.wiring import BlockHooks


@pytest.mark.parametrize("told", [False, True])
def test_allow_prefetch_lets_offloaded_bytes_come_back_ahead(told):
    """storm.offload's allow_prefetch(): with no prefetch window, backward fetches ahead only
    when told that room was made."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(6)]
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes=0) as ctx:
        h = torch.randn(64, 256)
        for layer in layers:
            h = torch.relu(layer(h))
        if told:
            h.register_hook(lambda g: ctx.allow_prefetch(1 << 30))  # runs as backward starts
    ctx.synchronize()  # every copy done: backward has to fetch them all
    h.sum().backward()
    ctx.synchronize()
    assert ctx.stats.offloaded == ctx.stats.fetched > 0
    assert ctx.stats.prefetch_hits == (ctx.stats.offloaded if told else 0)


def test_prefetch_takes_no_more_than_the_room_backward_made():
    """A fetch starts only where the whole tensor fits in the room allow_prefetch() reports
    (storm.plan's is its peak's slack): 2.5 tensors' room fetches two, not three."""
    x = torch.randn(64, 256, requires_grad=True)
    one = x.numel() * x.element_size()
    seen = []
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes=0) as ctx:
        h = x
        for _ in range(6):
            h = torch.tanh(h * 1.5)  # six fresh tensors of `one` bytes

        def room(grad: torch.Tensor) -> None:
            ctx.allow_prefetch(5 * one // 2)
            seen.append(ctx._session.restorer.prefetch.nbytes)

        h.register_hook(room)
    ctx.synchronize()
    h.sum().backward()
    assert seen == [2 * one]
    assert ctx.stats.fetched == ctx.stats.offloaded == 6


def test_drain_lets_go_of_copied_tensors_after_the_hooks_are_off():
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0, budget=3 * 64 * 256 * 4) as ctx:
        h = x
        for _ in range(6):
            h = torch.tanh(h * 1.5)  # saves one fresh 64 KiB tensor each: 3 go, then the hooks come off
        st = ctx.stats
        assert st.offloaded == 3 and st.stored_bytes < st.offloaded_bytes  # the last copy is not released yet
        ctx.drain(0)  # waits for the copies, then lets go of them
        assert st.stored_bytes == st.offloaded_bytes
    h.sum().backward()


def test_offload_shows_its_checked_options_and_its_saves_in_order():
    """What storm.plan reads of a storm.offload step: its options as checked (sizes in bytes), a
    copy, and the storages it offloaded, in saving order."""
    ctx = storm.offload(mode="embedded", min_bytes="1KiB", max_held_bytes="1MiB")
    assert ctx.options["min_bytes"] == 1024 and ctx.options["max_held_bytes"] == 1 << 20
    ctx.options["min_bytes"] = 0
    assert ctx.options["min_bytes"] == 1024
    with pytest.raises(RuntimeError, match="not been entered"):
        ctx.saves
    x = torch.randn(64, 256, requires_grad=True)
    with ctx:
        a = torch.tanh(x * 1.5)  # saves a: 64 KiB
        b = torch.tanh(a[:32] * 2.0)  # saves b: 32 KiB
    assert [s.nbytes for s in ctx.saves] == [64 * 256 * 4, 32 * 256 * 4]
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 for s in ctx.saves)
    b.sum().backward()


def test_blocks_listed_twice_or_one_inside_another_are_refused_by_name():
    """A layer shared between places of the model, listed once per place, crashed mid-training (its
    forward was set and taken off twice); a block inside another would be hooked twice."""
    from storm.examples.models import GPT
    model = GPT(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    with pytest.raises(ValueError, match="block 1 is block 0"):
        storm.plan([model.blocks[0], model.blocks[0]], budget=0.5, mode="embedded")
    with pytest.raises(ValueError, match="block 0 holds block 1"):
        storm.plan([model.blocks[0], model.blocks[0].attn], budget=0.5, mode="embedded")


def test_backward_reaches_a_block_through_the_first_output_that_requires_grad():
    """A block that returns a detached statistic first (for logging) and its hidden state: the
    hooks that mark backward's arrival go on the hidden state (on the statistic they never fired,
    and the planner's trials never ended)."""
    from storm.planner.wiring import grad_tensor
    h = torch.randn(2, requires_grad=True) * 2
    assert grad_tensor((h.detach().mean(), h)) is h
    assert grad_tensor({"stat": h.detach(), "hidden": [h]}) is h
    assert grad_tensor(h.detach()) is None and grad_tensor((1, None)) is None


def test_an_evaluation_under_no_grad_between_steps_is_no_call_of_a_step():
    """Evaluation batches of another size between training steps: the planner's hooks read them
    as the step's calls, traced again at each and never settled."""
    from planner_fakes import FakeClock, gpt, grads_of
    model, idx = gpt()
    evaluation = torch.randint(0, 256, (3, 65))
    # a clock standing still: how many steps its trials take does not depend on how busy the machine is
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    for _ in range(24):
        grads_of(model, idx, planner.step())
        with torch.no_grad():
            model.loss(evaluation[:, :-1], evaluation[:, 1:])
    assert planner.replans == 0 and planner.trace.forwards == 1 and planner.settled
    planner.close()


def test_blocks_called_by_keyword_trace_again_when_their_inputs_change_shape():
    """A block called as block(x=h): its input's shape is in the trace's signature too, so a larger
    batch is noticed (the plan made for the small one ran on, sized for it)."""
    import types

    from planner_fakes import gpt, grads_of
    model, idx = gpt()

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x=x)
        return self.head(self.ln(x))

    model.forward = types.MethodType(forward, model)
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0)
    for _ in range(6):
        grads_of(model, idx, planner.step())
    assert planner.replans == 0
    larger = torch.randint(0, 256, (4 * idx.shape[0], idx.shape[1]))
    for _ in range(2):
        grads_of(model, larger, planner.step())
    assert planner.replans == 1
    planner.close()


def test_what_prefetch_may_fetch_at_each_block_stays_within_the_plan_s_peak(monkeypatch):
    """As backward reaches each block, the planner lets prefetch fetch ahead what the plan's peak
    leaves free there (allow_prefetch), and prefetch adds the plan's window once it fetches. The
    peak counts that window once, among the bytes in flight: the allowance counted it again, so a
    plan with a window could fetch one window more than its predicted peak at its peak block."""
    from planner_fakes import gpt, grads_of
    from storm.planner import Plan, Scenario, predicted_peak
    from storm.planner.held import kept_bytes
    from storm.restore import Restorer

    window = 64 << 10
    chosen: list[Plan] = []

    def offload_two(s: Scenario) -> Plan:
        t = s.trace
        chosen.append(Plan(offloaded=2, recomputed=frozenset(), offload_budget=t.offloaded_before[2],
                           max_held_bytes=1 << 30, prefetch_bytes=window, in_flight_bytes=window,
                           predicted_peak=predicted_peak(t, 2, set(), window, grads=False, prefetch=window),
                           predicted_cost_ms=0.0, fits=True))
        return chosen[-1]

    allowed: list[int] = []
    allow = Restorer.allow_prefetch

    def recorded(self, step, nbytes):
        allowed.append(nbytes)
        allow(self, step, nbytes)

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, chooser=offload_two,
                            form_trial=False, host_check_tolerance=float("inf"))
    for _ in range(2):  # the traces
        grads_of(model, idx, planner.step())
    monkeypatch.setattr(Restorer, "allow_prefetch", recorded)
    grads_of(model, idx, planner.step())
    p, t = planner.plan, planner.trace
    assert p.prefetch_bytes == window and len(allowed) == len(t.blocks)
    kept = kept_bytes(t, p.offloaded, p.recomputed)
    for i, nbytes in enumerate(reversed(allowed)):  # backward reaches the last block first
        held = sum(kept[:i]) + t.blocks[i].saved_bytes  # the blocks before keep theirs; block i its own
        assert held + nbytes + p.prefetch_bytes <= p.predicted_peak, i
    planner.close()


class Paced:
    """What a planned step's pacing hooks tell storm.offload, recorded: the room each block's
    backward allows prefetch."""

    def __init__(self) -> None:
        self.rooms: list[int] = []
        self.queued: list[int] = []  # the copy queue's allowance after each block's forward
        self.drains: list[int] = []

    def drain(self, limit: int) -> None:
        self.drains.append(limit)

    def allow_queued(self, nbytes: int) -> None:
        self.queued.append(nbytes)

    def stop_offloading(self) -> None:
        pass

    def offload_at_most(self, n: int) -> None:
        pass

    def allow_prefetch(self, room: int) -> None:
        self.rooms.append(room)


def test_a_blocks_measured_backward_extra_moves_the_room_prefetch_takes_there_and_nowhere_else():
    """Block 2's heavier backward lowers the room at block 2 alone (the blocks after it in backward
    leave less anyway); a lighter one raises none: what block 2 fetches ahead stays through block
    1's backward, which leaves no more than before."""
    model, idx = gpt()
    n = len(model.blocks)

    def rooms(extra_at_2: int, grads: bool = True) -> list[int]:
        blocks = [BlockTrace(saved_bytes=10 * MiB, input_bytes=MiB, backward_extra=extra_at_2 * (i == 2))
                  for i in range(n)]
        trace = Trace(blocks=blocks, offloaded_before=[10 * MiB * i for i in range(n + 1)])
        plan = Plan(offloaded=2, recomputed=frozenset(), offload_budget=20 * MiB, max_held_bytes=0, prefetch_bytes=0,
                    predicted_peak=100 * MiB, predicted_cost_ms=0.0, fits=True)
        hooks, paced = BlockHooks(list(model.blocks), reentrant=True), Paced()
        hooks.apply(plan, trace, grads=grads, ctx=lambda: paced)
        grads_of(model, idx)
        hooks.close()
        return paced.rooms[::-1]  # block 0's first

    plain, heavier, lighter = rooms(0), rooms(8 * MiB), rooms(-8 * MiB)
    assert len(plain) == n > 3 and heavier[2] == plain[2] - 8 * MiB and lighter == plain
    assert [r for i, r in enumerate(heavier) if i != 2] == [r for i, r in enumerate(plain) if i != 2]
    assert rooms(8 * MiB, grads=False) == rooms(0, grads=False)  # budget=: saves alone, as its plan counts them


def test_what_is_fetched_ahead_at_a_block_fits_every_block_backward_reaches_before_its_own():
    """A fetch ahead stays until its own block's backward. Where backward reaches recomputed
    blocks first (they keep only their inputs) and kept blocks after them, with the parameter
    gradients growing as it goes, the room is largest at the last block: block 0's offloaded saves,
    fetched there in full, took each block between over the plan's peak (phi3-wide, 1233 MiB over
    its prediction). The room at a block is now no more than what any block from there down leaves."""
    from storm.planner.held import moments

    model, idx = gpt()
    n = len(model.blocks)
    blocks = [BlockTrace(saved_bytes=10 * MiB, input_bytes=MiB, grad_bytes=8 * MiB) for _ in range(n)]
    trace = Trace(blocks=blocks, offloaded_before=[10 * MiB * i for i in range(n + 1)])
    recomputed = frozenset(range(n // 2, n))  # block 0 offloaded, the next kept, the last half recomputed
    held = moments(trace, 1, recomputed, 0, grads=True)
    plan = Plan(offloaded=1, recomputed=recomputed, offload_budget=10 * MiB, max_held_bytes=0, prefetch_bytes=0,
                predicted_peak=max(held), predicted_cost_ms=0.0, fits=True)
    hooks, paced = BlockHooks(list(model.blocks), reentrant=True), Paced()
    hooks.apply(plan, trace, grads=True, ctx=lambda: paced)
    grads_of(model, idx)
    hooks.close()
    rooms = paced.rooms[::-1]  # block 0's first
    assert len(rooms) == n and rooms[-1] > 0
    for i in range(1, n):
        for j in range(1, i + 1):  # fetched at block i, there through block j's backward too
            assert held[j] + rooms[i] <= plan.predicted_peak, (i, j)
    assert rooms[1] == plan.predicted_peak - held[1]  # no less than the blocks' own room where it is the least


def test_forward_lets_copies_run_behind_by_its_room_below_the_peak_and_drains_after_the_last_block():
    """Where backward's start is a plan's peak, forward holds much less: the copies may run behind
    by the difference, so the host does not wait on each block's copy (losing its lead on the GPU,
    a gap in the compute stream per block). After the last block the queue drains to what the plan
    counts in flight, and allows nothing more: the loss comes next."""
    model, idx = gpt()
    n = len(model.blocks)

    def paced_by(plan: Plan, blocks: list[BlockTrace]) -> Paced:
        trace = Trace(blocks=blocks, offloaded_before=[10 * MiB * i for i in range(n + 1)])
        hooks, paced = BlockHooks(list(model.blocks), reentrant=True), Paced()
        hooks.apply(plan, trace, grads=False, ctx=lambda: paced)
        grads_of(model, idx)
        hooks.close()
        return paced

    blocks = [BlockTrace(saved_bytes=10 * MiB, input_bytes=MiB) for _ in range(n)]
    every = frozenset(range(n))  # every block recomputed with its inputs offloaded
    inputs = Plan(offloaded=0, recomputed=every, offload_budget=None, max_held_bytes=MiB, prefetch_bytes=MiB,
                  predicted_peak=100 * MiB, predicted_cost_ms=0.0, fits=True, in_flight_bytes=MiB,
                  inputs_offloaded=n)
    paced = paced_by(inputs, blocks)
    # the peak less what is in flight, the block's saves and its output: nothing kept before it
    assert paced.queued == [88 * MiB] * (n - 1) + [0]
    assert paced.drains == [MiB]  # after the last block alone: to the plan's in flight bytes
    # blocks 2.. kept: each keeps its saves, so the room shrinks block by block, never below none
    kept = Plan(offloaded=2, recomputed=frozenset(), offload_budget=20 * MiB, max_held_bytes=MiB, prefetch_bytes=0,
                predicted_peak=50 * MiB, predicted_cost_ms=0.0, fits=True)
    assert paced_by(kept, blocks).queued == [max(0, 50 - 11 - 10 * max(0, i - 2)) * MiB for i in range(1, n)] + [0]


def test_inputs_compare_call_by_call_and_dimension_by_dimension():
    """A step's calls of block 0 against the traced step's: smaller where no dimension is larger
    and the tensors are the same in number, rank and dtype; anything else is other inputs."""
    from storm.planner.wiring import Inputs, compare_inputs

    f32, bf16 = torch.float32, torch.bfloat16
    traced = ((((8, 64, 32), f32), ((8, 1, 64, 64), bf16)),)
    assert compare_inputs([traced[0]], traced) is Inputs.AS_TRACED
    assert compare_inputs([], traced) is Inputs.AS_TRACED  # no call of block 0
    assert compare_inputs([traced[0]], ()) is Inputs.AS_TRACED  # nothing traced yet
    shorter = (((8, 33, 32), f32), ((8, 1, 33, 33), bf16))
    assert compare_inputs([shorter], traced) is Inputs.SMALLER
    assert compare_inputs([(((4, 64, 32), f32), ((4, 1, 64, 64), bf16))], traced) is Inputs.SMALLER
    for other in [(((8, 65, 32), f32), ((8, 1, 65, 65), bf16)),   # longer
                  (((16, 33, 32), f32), ((16, 1, 33, 33), bf16)),  # more tokens in one dimension, fewer in another
                  (((8, 64, 32), bf16), ((8, 1, 64, 64), bf16)),   # another dtype
                  (((8, 64, 32), f32), ((8, 64, 64), bf16)),       # another rank
                  (((8, 64, 32), f32),)]:                          # another number of tensors
        assert compare_inputs([other], traced) is Inputs.OTHER, other
    unmasked = (((8, 64, 32), f32), None)  # no padding in the batch: no mask
    assert compare_inputs([unmasked], traced) is Inputs.SMALLER
    assert compare_inputs([traced[0]], (unmasked,)) is Inputs.OTHER  # a mask where the traced step had none
    two = (traced[0], shorter)  # a step of two forwards, the second smaller
    assert compare_inputs([traced[0], shorter], two) is Inputs.AS_TRACED
    assert compare_inputs([shorter, shorter], two) is Inputs.SMALLER
    assert compare_inputs([shorter, traced[0]], two) is Inputs.OTHER  # the second larger than its own
    assert compare_inputs([traced[0], traced[0]], traced) is Inputs.OTHER  # more forwards than traced
