"""The planner on the CPU GPT (and a Hugging Face Llama): planned steps train bit-exact and do
what the plan says, its options and refusals, a given plan applied through the embedded store
and through stormd, the codec it passes on."""

from __future__ import annotations

import copy
import logging
from typing import Callable

import pytest
import torch

import storm
import storm.session as session_mod
from planner_fakes import FakeClock, MiB, gpt, grads_of, traced_gpt_planner
from storm.examples.models import same_bits
from storm.planner import Phase, Plan, Scenario, choose
from storm.recompute import _warn_cache_off


@pytest.mark.parametrize("budget", [0.5, 0.05])
def test_planned_steps_train_bit_exact_and_follow_the_plan(budget):
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=budget, mode="embedded", min_bytes=0)
    assert "no plan yet" in planner.explain()
    for step in range(4):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got)), f"gradients differ in step {step}"
        if step == 0:  # the offload trace: everything
            assert ctx.stats.offloaded_bytes > 0 and storm.Keep.BUDGET not in ctx.stats.kept
    plan, t = planner.plan, planner.trace
    assert plan is not None and len(t.blocks) == 6
    assert all(b.saved_bytes > 0 and b.tensors > 0 and b.input_bytes > 0 and b.forward_ms > 0 for b in t.blocks)
    # on CPU host and "stream" are one clock: the host is never ahead
    assert len(t.lead_ms) == len(t.blocks) + 1 and all(abs(lead) < 5.0 for lead in t.lead_ms)
    # set to None before each step: each block's backward allocates its parameters' gradients
    assert [b.grad_bytes for b in t.blocks] == [sum(q.numel() * q.element_size() for q in m.parameters())
                                                for m in model.blocks]
    # the last planned step did what the plan says
    recomputing = {i for i, b in enumerate(model.blocks) if "forward" in vars(b)}
    assert recomputing == set(plan.recomputed)
    expected = t.total_bytes if plan.offload_budget is None else plan.offload_budget
    assert ctx.stats.offloaded_bytes == expected
    if budget == 0.05:  # 5% of the step cannot stay on the device without recomputing or offloading most
        assert plan.offloaded + len(plan.recomputed) >= 5
    assert plan.fits == (plan.predicted_peak <= int(budget * t.total_bytes))
    text = planner.explain()
    decisions = ("offload", "recompute", "keep", "inputs offloaded")
    assert len([line for line in text.splitlines() if line.rstrip().endswith(decisions)]) >= 6
    planner.close()
    assert not any("forward" in vars(b) for b in model.blocks)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)


def test_an_unreachable_budget_warns_and_trains(caplog):
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=1024, mode="embedded", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(3):
            got = grads_of(model, idx, planner.step())
    assert not planner.plan.fits
    assert any("no plan keeps the saved activations under" in r.getMessage() for r in caplog.records)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    planner.close()


@pytest.mark.parametrize("blocks, budget, options, error", [
    ([], "1GiB", {}, TypeError),
    (["not a module"], "1GiB", {}, TypeError),
    (None, None, {}, TypeError),
    (None, -1, {}, ValueError),
    (None, 1.5, {}, ValueError),
    (None, "lots", {}, ValueError),
    (None, "1GiB", {"budget": 0.5}, TypeError),
    (None, "1GiB", {"min_bytes": -1}, ValueError),
    (None, "1GiB", {"peak": "1GiB"}, TypeError),  # one or the other
    (None, None, {"peak": 0.5}, ValueError),
    (None, None, {"peak": "a lot"}, ValueError),
    (None, None, {"peak": -5}, ValueError),
])
def test_bad_plans_are_refused(blocks, budget, options, error):
    model, _ = gpt()
    with pytest.raises(error):
        storm.plan(model.blocks if blocks is None else blocks, budget=budget, **options)


@pytest.mark.parametrize("options, message", [
    ({"reentrant": "no"}, "reentrant must be True or False; got 'no'"),
    ({"reentrant": None}, "reentrant must be True or False; got None"),
    ({"clock": "cuda"}, r"clock must be None \(the compute stream's timings.*or a storm.planner.Clock.*got 'cuda'"),
    ({"clock": 5}, "clock must be None .*got 5"),
])
def test_reentrant_and_clock_are_refused_where_given(options, message):
    """reentrant='no' was taken as True and a clock that is none failed at the first step, inside
    the trace."""
    model, _ = gpt()
    with pytest.raises((TypeError, ValueError), match=message):
        storm.plan(model.blocks, budget=0.5, **options)


def test_a_whole_model_is_refused_naming_its_blocks():
    """The model itself, not its blocks: said so, with where to look (it raised "'GPT' object is
    not iterable")."""
    model, _ = gpt()
    with pytest.raises(TypeError, match="storm.plan takes the model's repeated blocks .*such as model.layers.*not a "
                                        "GPT that holds them; or storm.enable"):
        storm.plan(model, budget=0.5)


def test_plan_options_in_sizes_reach_the_plan_as_bytes():
    """The options go to the planner's choice as bytes, whatever it chooses (which depends on
    the trace's timings: on a busy CPU recomputing every block can win, and a plan that
    offloads nothing has no copy queue); a plan that offloads uses them."""
    asked = []

    def recorded(s: Scenario) -> Plan | None:
        asked.append((s.held_bytes, s.prefetch_bytes))
        return choose(s)

    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes="0", max_held_bytes="1MiB",
                            prefetch_bytes="2MiB", chooser=recorded)
    assert planner.options == {"mode": "embedded", "min_bytes": 0, "max_held_bytes": 1 << 20,
                                "prefetch_bytes": 2 << 20}
    for _ in range(3):  # two traces, then a plan made with those options
        grads_of(model, idx, planner.step())
    assert asked and set(asked) == {(1 << 20, 2 << 20)}
    assert planner.plan is not None and planner.plan.max_held_bytes == (1 << 20 if planner.plan.offloaded else 0)
    planner.close()


def test_reentrant_false_recomputes_for_torch_autograd_grad():
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.plan(model.blocks, budget=0.05, mode="embedded", min_bytes=0, reentrant=False)
    for _ in range(4):
        ctx = planner.step()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with ctx:
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        ctx.synchronize()
        got = torch.autograd.grad(loss, list(model.parameters()))
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert planner.plan.recomputed
    assert all(not model.blocks[i].forward.reentrant for i in planner.plan.recomputed)
    planner.close()


def test_a_block_with_its_own_forward_attribute_is_refused_clearly():
    """Refused as the compute trace begins; the step that raised is no step to read, so asking
    again says the same, and close() comes off cleanly (it read a phase whose begin had raised)."""
    model, idx = gpt()
    model.blocks[3].forward = model.blocks[3].forward  # e.g. wrapped by another tool
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0)
    grads_of(model, idx, planner.step())
    for _ in range(2):
        with pytest.raises(RuntimeError, match="block 3 .*own forward"):
            planner.step()
    planner.close()


def fixed_plan(offloaded: int, recomputed: set[int], compressed: bool = False) -> Callable[[Scenario], Plan]:
    """A choice of this plan, whatever the planner measured. Its predicted peak is far above the
    step, so backward has room to fetch everything ahead as soon as it starts."""
    def fixed(s: Scenario) -> Plan:
        return Plan(offloaded=offloaded, recomputed=frozenset(recomputed),
                    offload_budget=s.trace.offloaded_before[offloaded], max_held_bytes=1 << 30, prefetch_bytes=0,
                    predicted_peak=1 << 40, predicted_cost_ms=0.0, fits=True, compressed=compressed)

    return fixed


def test_a_given_plan_is_applied_and_backward_progress_drives_prefetch(monkeypatch):
    """With the choice fixed (blocks 0-1 offloaded, 4 recomputed, the rest kept), a planned step
    offloads exactly the first two blocks, recomputes block 4, and fetches every offloaded
    tensor ahead of its unpack although its own prefetch window is 0: the hooks on the kept
    blocks' outputs report the room backward has made."""
    model, idx, ref, planner = traced_gpt_planner(chooser=fixed_plan(2, {4}))
    past = []  # saves past the offloaded blocks that reached STORM's hooks
    monkeypatch.setattr(session_mod.ClientSession, "save_past_budget",
                        lambda self, t, step: past.append(t) or session_mod.Kept(t))
    ctx = planner.step()
    got = grads_of(model, idx, ctx)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    t = planner.trace
    assert {i for i, b in enumerate(model.blocks) if "forward" in vars(b)} == {4}
    st = ctx.stats
    assert st.offloaded_bytes == t.before_bytes + t.blocks[0].saved_bytes + t.blocks[1].saved_bytes
    # the hooks came off after block 1: blocks 2-5 saved as without STORM
    assert not past and storm.Keep.BUDGET not in st.kept
    assert st.fetched == st.offloaded and st.prefetch_hits == st.offloaded
    planner.close()


@pytest.mark.parametrize("given, passed", [({}, "auto"), ({"codec": None}, "auto"), ({"codec": "raw"}, "raw")])
def test_a_compressed_plan_offloads_with_a_frame_codec_unless_the_user_gave_one(given, passed):
    """codec=None is no codec given: a config that passes every option must not turn the plan's
    frames into the store's codec behind the plan's back."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0,
                            chooser=fixed_plan(2, set(), compressed=True), **given)
    for _ in range(3):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
    assert ctx.options["codec"] == passed
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    planner.close()


def test_a_raw_plan_says_raw_where_frames_were_weighed():
    """Where the trace found tensors a frame codec would frame, a plan that chose raw says so, so
    that a daemon whose codec setting frames CUDA tensors does not frame them behind its back."""
    model, idx = gpt()
    planner = storm.Planner(model.blocks, budget=0.5, mode="embedded", min_bytes=0,
                            frames_of=lambda saves, setting: (1, 8 * MiB, 6 * MiB), chooser=fixed_plan(2, set()))
    for _ in range(3):
        ctx = planner.step()
        grads_of(model, idx, ctx)
    assert ctx.options["codec"] == "raw"
    planner.close()


def test_a_plan_through_stormd_trains_bit_exact(daemon):
    """The same fixed plan as above, its offloaded blocks stored by a real stormd process."""
    model, idx = gpt()
    ref = grads_of(copy.deepcopy(model), idx)
    planner = storm.Planner(model.blocks, budget=0.5, mode="daemon", socket=daemon.endpoint, min_bytes=0,
                            chooser=fixed_plan(3, {4}))
    for _ in range(3):
        ctx = planner.step()
        got = grads_of(model, idx, ctx)
        assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert "stormd" in ctx.backend_name
    t = planner.trace
    assert ctx.stats.offloaded_bytes == t.offloaded_before[3] and ctx.stats.prefetch_hits == ctx.stats.offloaded
    planner.close()


@pytest.mark.parametrize("budget", [0.3, 0.02])
def test_a_hugging_face_llama_with_its_cache_on_trains_bit_exact(budget, caplog):
    """LlamaForCausalLM as a new user would plan it (use_cache on, its config's default): every
    parameter's gradient in every step, traced and planned, is that of no offload, bit for bit;
    recomputed layers run without the cache, with a warning. 0.02 recomputes every layer."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face test needs transformers installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4)
    assert config.use_cache
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 128, (2, 16))

    def grads(m, ctx=None) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            loss = m(idx, labels=idx).loss
        loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    want = grads(ref)
    _warn_cache_off.cache_clear()  # warned once a process: maybe by an earlier test
    planner = storm.plan(model.model.layers, budget=budget, mode="embedded", min_bytes=0)
    with caplog.at_level(logging.WARNING, logger="storm"):
        for step in range(5):
            got = grads(model, planner.step())
            differ = [n for (n, _), a, b in zip(model.named_parameters(), want, got) if not same_bits(a, b)]
            assert not differ, f"step {step} ({planner.explain()}): gradients differ in {differ}"
    if budget < 0.1:
        assert planner.plan.recomputed == frozenset(range(4))
    assert any("LlamaDecoderLayer is recomputed" in r.getMessage() for r in caplog.records)
    planner.close()


@pytest.mark.parametrize("steps", [0, 2, 3, 6])
def test_a_step_begun_and_never_entered_leaves_its_phase_to_the_next_step(steps):
    """A batch skipped after planner.step() was called: its context never entered, the next step()
    raised (reading a step that never ran) in the trace and check phases; it begins that phase again."""
    model, idx = gpt()
    plain = copy.deepcopy(model)
    planner = storm.plan(model.blocks, budget=0.3, mode="embedded", min_bytes=0, clock=FakeClock())
    for _ in range(steps):
        grads_of(model, idx, planner.step())
    planner.step()  # never entered
    assert all(same_bits(a, b) for a, b in zip(grads_of(plain, idx), grads_of(model, idx, planner.step())))
    for _ in range(40):
        grads_of(model, idx, planner.step())
    assert planner.settled
    planner.close()


def test_a_step_skipped_in_the_compute_trace_leaves_no_timing_on_the_recomputes():
    """The compute trace times each block's recompute by wrapping Recompute.forward: a step begun
    there and never entered left its wrapper on, the next trace wrapped that one, and the stale
    one timed every recompute of the settled plan for good (its marks grew without end)."""
    model, idx = gpt()
    planner = storm.plan(model.blocks, budget=0.01, mode="embedded", min_bytes=0, clock=FakeClock())
    grads_of(model, idx, planner.step())  # the offload trace
    planner.step()  # never entered
    assert planner.phase == Phase.TRACE_COMPUTE
    for _ in range(40):
        grads_of(model, idx, planner.step())
    assert planner.settled and planner.plan.recomputed
    assert all(vars(b)["forward"].forward.__name__ == "forward" for b in model.blocks if "forward" in vars(b))
    planner.close()
