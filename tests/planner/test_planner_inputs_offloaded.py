"""The planner's fourth option per block on CPU models: recompute it and offload its inputs. Both
recompute forms save a block's tensor inputs through the outer saved-tensor hooks (the reentrant
form by save_for_backward, torch's checkpoint by its input saver), so while a storm.offload step
still offloads, a recomputed block's call offloads exactly its inputs, and backward fetches them
for its recompute. Gradients equal training without STORM bit for bit, at budgets below
checkpointing's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import storm
from planner_fakes import FakeClock, below_checkpointing, gpt, grads_of
from storm.examples.models import same_bits
from storm.planner import Plan, Scenario, kept_bytes
from storm.planner.held import fetched_inputs
from storm.planner.model import Offloading
from storm.recompute import Recompute


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(self.norm(h + pos))))


class PosModel(nn.Module):
    """Blocks called with the same position embeddings, positionally (as a model passes each layer
    its rotary tables or mask): every block saves them when recomputed, so STORM stores them once,
    and offloading them frees nothing while later blocks use them."""

    def __init__(self, d: int = 64, n: int = 6, seq: int = 64):
        super().__init__()
        self.emb, self.pos = nn.Embedding(256, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 256)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(idx.shape[1]))
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h, pos)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def pos_model() -> tuple[PosModel, torch.Tensor]:
    torch.manual_seed(0)
    return PosModel(), torch.randint(0, 256, (8, 65))


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputed_blocks_call_offloads_exactly_its_inputs(reentrant):
    """What the option stands on: under storm.offload, Recompute's call saves its block's tensor
    inputs (a shared one once) and nothing of what the block computes."""
    torch.manual_seed(0)
    blocks = [Block(64) for _ in range(3)]
    x, pos = torch.randn(8, 64, 64, requires_grad=True), torch.randn(8, 64, 64)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = x * 2  # not a leaf: offloaded as block 0's input
        inputs = [h]
        for b in blocks:
            h = Recompute(b.forward, torch.device("cpu"), reentrant)(h, pos)
            inputs.append(h)
    assert {s.weak.cdata for s in ctx.saves} == {t.untyped_storage()._cdata for t in [*inputs[:3], pos]}
    ctx.synchronize()
    h.sum().backward()
    assert ctx.stats.fetched == ctx.stats.offloaded == 4


def fixed(offloaded: int, inputs: int, recomputed: set[int]):
    """A choice of this plan, whatever the planner measured, with room to fetch everything."""
    def choose(s: Scenario) -> Plan | None:
        trace = s.trace
        if s.offload is not None:
            return None
        every = sorted(recomputed | set(range(offloaded, offloaded + inputs)))
        nbytes = None if offloaded + inputs == len(trace.blocks) else \
            trace.offloaded_before[offloaded] + sum(trace.blocks[j].input_bytes for j in every[:inputs])
        return Plan(offloaded=offloaded, recomputed=frozenset(every), offload_budget=nbytes, max_held_bytes=1 << 30,
                    prefetch_bytes=0, predicted_peak=1 << 40, predicted_cost_ms=0.0, fits=True,
                    inputs_offloaded=inputs)
    return choose


def test_a_plan_offloads_the_inputs_of_its_blocks_and_nothing_of_the_kept_ones():
    """Block 0 offloaded, blocks 1-2 recomputed with their inputs offloaded, 3-5 kept: the step
    offloads the saves before the blocks, block 0's, and blocks 1's and 2's inputs; then the hooks
    come off."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(),
                            chooser=fixed(1, 2, set()), form_trial=False)
    for _ in range(2):
        grads_of(model, idx, planner.step())
    t = planner.trace
    ctx = planner.step()
    got = grads_of(model, idx, ctx)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == {1, 2}
    st = ctx.stats
    assert st.offloaded_bytes == t.before_bytes + t.blocks[0].saved_bytes + t.blocks[1].input_bytes \
        + t.blocks[2].input_bytes
    assert storm.Keep.BUDGET not in st.kept  # the hooks came off after block 2: no save went past the budget
    assert st.fetched == st.offloaded and st.prefetch_hits == st.offloaded  # fetched ahead of their recompute
    assert "blocks 1-2 recomputed with their inputs offloaded" in planner.explain()
    planner.close()


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("inputs", [2, 6])
def test_a_shared_input_a_later_block_keeps_stays_on_the_device(inputs, reentrant):
    """Blocks 0-1 recomputed with their inputs offloaded, 2-3 recomputed, 4-5 kept: the position
    tensor every block is called with stays alive for blocks 2-3 anyway, so blocks 0-1 keep it on
    the device (Keep.SHARED) and offload their hidden states alone, as the model counts them. Where
    every block offloads its inputs, it goes, stored once."""
    model, idx = pos_model()
    ref = grads_of(copy.deepcopy(model), idx)
    n = len(model.blocks)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(),
                            chooser=fixed(0, inputs, {2, 3} if inputs < n else set()), form_trial=False,
                            reentrant=reentrant)
    for _ in range(2):
        grads_of(model, idx, planner.step())
    t = planner.trace
    positions = []
    model.pos.register_forward_hook(lambda m, args, out: positions.append(out))
    ctx = planner.step()
    got = grads_of(model, idx, ctx)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    st, pos = ctx.stats, positions[-1].untyped_storage()._cdata
    said = planner.explain()
    if inputs < n:
        assert pos not in {s.weak.cdata for s in ctx.saves} and st.kept[storm.Keep.SHARED] == inputs
        assert st.offloaded_bytes == t.before_bytes + sum(fetched_inputs(b) for b in t.blocks[:inputs])
        assert "16 KiB of inputs a later block is called with too stay on the device" in said, said
    else:
        assert pos in {s.weak.cdata for s in ctx.saves} and storm.Keep.SHARED not in st.kept
        assert "16 KiB of inputs these blocks alone share offloaded once" in said, said
    assert st.fetched == st.offloaded
    planner.close()


@pytest.mark.parametrize("inputs", [True, False], ids=["inputs-offloaded", "saves-offloaded"])
def test_where_every_block_offloads_the_early_saves_after_the_blocks_go_too(inputs):
    """Every block recomputed with its inputs offloaded, or every block's saves offloaded: the
    step also offloads what the head saves before the largest save after the blocks (the final
    norm's; the log-softmax of the logits, which the loss's backward takes at once, stays), as
    the plan counts, where the hooks came off after the last block before."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    n = len(model.blocks)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(),
                            chooser=fixed(0, n, set()) if inputs else fixed(n, 0, set()), form_trial=False)
    for _ in range(2):
        grads_of(model, idx, planner.step())
    t = planner.trace
    assert 0 < t.after_early_bytes < t.after_bytes
    for _ in range(2):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    st = ctx.stats
    blocks = sum(b.input_bytes if inputs else b.saved_bytes for b in t.blocks)
    assert st.offloaded_bytes == t.before_bytes + blocks + t.after_early_bytes
    assert st.kept[storm.Keep.BUDGET] >= 1 and st.fetched == st.offloaded
    assert "(saved before its largest tensor) offloaded, the rest kept on the device" in planner.explain()
    planner.close()


def test_the_trace_counts_inputs_other_blocks_are_called_with_as_shared():
    model, idx = pos_model()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    grads_of(model, idx, planner.step())
    planner.settled  # reads the step: the trace
    pos = 64 * 64 * 4
    assert [(b.input_bytes, b.shared_input_bytes, b.input_tensors) for b in planner.trace.blocks] == \
        [(8 * 64 * 64 * 4 + pos, pos, 1)] * 6
    planner.close()


def test_recomputed_blocks_called_with_one_tensor_keep_it_once():
    """Every block is called with the same position tensor (as a T5 stack passes each layer its
    position bias): recomputing them all keeps one storage of it, which the plan's peak counts
    once, at block 0 (the last backward to use it), not once per block."""
    model, idx = pos_model()
    planner = storm.plan(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock())
    grads_of(model, idx, planner.step())
    planner.settled
    t, n, pos, hidden = planner.trace, len(model.blocks), 64 * 64 * 4, 8 * 64 * 64 * 4
    every = set(range(n))
    assert kept_bytes(t, 0, every) == [hidden + pos] + [hidden] * (n - 1)
    # every block's inputs offloaded: no block after them is called with it, so the step offloads it
    # once (shared_staying) and the model sends it once and keeps nothing
    assert kept_bytes(t, 0, every, inputs_offloaded=n) == [0] * n
    # all but the last: it keeps its inputs, so the storage stays, counted once, at block 0
    assert kept_bytes(t, 0, every, inputs_offloaded=n - 1) == [pos] + [0] * (n - 2) + [hidden]
    planner.close()


def test_a_storage_the_input_offloading_blocks_alone_share_is_sent_once_as_the_step_does():
    """Every block recomputed with its inputs offloaded: the position tensor they are all called
    with is offloaded once by the step (no later block keeps it alive), and the model sends it once
    too, where it counted it kept on the device and never sent (its peaks one storage over)."""
    model, idx = pos_model()
    n = len(model.blocks)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0, clock=FakeClock(),
                            chooser=fixed(0, n, set()), form_trial=False)
    try:
        for _ in range(2):
            grads_of(model, idx, planner.step())
        ctx = planner.step()
        grads_of(model, idx, ctx)
        assert Offloading.of(planner.trace, 0, None, m=n)[0].sent == ctx.stats.offloaded_bytes
    finally:
        planner.close()


@pytest.mark.parametrize("model_of", [gpt, pos_model], ids=["gpt", "shared-pos"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_budget_below_checkpointings_trains_bit_exact(model_of, reentrant):
    model, idx = model_of()
    ref = grads_of(copy.deepcopy(model), idx)
    budget = below_checkpointing(model.blocks, lambda ctx: grads_of(model, idx, ctx))
    planner = storm.plan(model.blocks, budget=budget, mode="embedded", min_bytes=0, reentrant=reentrant,
                         clock=FakeClock())
    for step in range(8):
        got = grads_of(model, idx, planner.step())
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
    p = planner.plan
    assert p.fits and p.inputs_offloaded > 0 and p.predicted_peak <= budget, planner.explain()
    assert "recomputed with their inputs offloaded" in planner.explain()
    planner.close()
    assert all(same_bits(a, b) for a, b in zip(ref, grads_of(model, idx)))


def test_a_hugging_face_llama_below_checkpointings_peak_trains_bit_exact():
    """LlamaForCausalLM passes each layer its hidden states positionally (saved by the checkpoint,
    so offloaded) and its position embeddings and mask as keyword arguments (held by the
    checkpoint, not saved): recomputed in torch's non-reentrant form (keyword arguments), with
    their hidden states offloaded, every parameter's gradient is that of no offload."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=4, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 128, (4, 64))

    def grads(m: nn.Module, ctx: storm.Offload | None = None) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            loss = m(idx, labels=idx).loss
        if ctx is not None:
            ctx.synchronize()
        loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    want = grads(ref)
    budget = below_checkpointing(model.model.layers, lambda ctx: grads(model, ctx))
    planner = storm.plan(model.model.layers, budget=budget, mode="embedded", min_bytes=0, clock=FakeClock())
    tables = []  # the rotary tables each layer is given by keyword
    model.model.rotary_emb.register_forward_hook(lambda m, args, out: tables.append(out))
    for step in range(8):
        ctx = planner.step()
        got = grads(model, ctx)
        assert all(same_bits(a, b) for a, b in zip(want, got)), f"gradients differ in step {step}"
    p = planner.plan
    assert p.fits and p.inputs_offloaded > 0, planner.explain()
    # saved through STORM's hooks with the first recomputed block's inputs, not held by torch's
    # checkpoint: kept on the device where a later layer keeps them anyway, else offloaded
    given, saved = {t.untyped_storage()._cdata for t in tables[-1]}, {s.weak.cdata for s in ctx.saves}
    if p.offloaded + p.inputs_offloaded < len(model.model.layers):
        assert given.isdisjoint(saved) and ctx.stats.kept[storm.Keep.SHARED] >= len(given) * p.inputs_offloaded
    else:
        assert given <= saved
    planner.close()
