"""Issue 40's W3 (a Hugging Face Llama) through the benchmarks' code on the CPU: the workloads as
built, every method's row trained for real on the tiny variant, each compiled variant at its own
activation_memory_budget, torchtune's OffloadActivations imported without torchtune's
dataset stack, and frontier.py's W3 rows, caps and must-show verdicts from fake measurements."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math

import pytest
import torch
import torch._functorch.config

import storm
from helpers import bench_module

common = bench_module("common")
frontier = bench_module("frontier")
summary = bench_module("summary")
GiB = common.GiB
CPU = torch.device("cpu")
STORM = {"mode": "embedded", "min_bytes": 0, "pool_size": "64MiB"}


def test_w3_is_issue_40s_llama_and_w3l_its_large_batch():
    w = common.W3
    assert (w.layers, w.hidden, w.mlp, w.heads, w.kv_heads, w.vocab, w.batch, w.seq, w.attn) == \
        (16, 2048, 5632, 16, 4, 32000, 4, 2048, "sdpa")
    assert dataclasses.replace(common.W3L, name="W3", batch=4) == w and common.W3L.batch > w.batch
    assert {"W1", "W2", "W3", "W3L", "W3-tiny"} <= set(common.WORKLOADS)


def test_the_tiny_llama_trains_on_its_tokens_and_checkpoints_its_first_blocks():
    w = common.W3_TINY
    model, ids = w.build(CPU)
    assert ids.shape == (w.batch, w.seq) and ids.dtype == torch.long
    assert w.blocks(model) is model.model.layers and len(w.blocks(model)) == w.layers
    loss = w.objective(w.forward(model, ids))
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert not any(layer.gradient_checkpointing for layer in w.blocks(model))
    model, _ = w.build(CPU, ckpt=True)
    assert all(layer.gradient_checkpointing for layer in w.blocks(model))
    model, _ = dataclasses.replace(w, ckpt_blocks=1).build(CPU)
    assert [layer.gradient_checkpointing for layer in w.blocks(model)] == [True, False]


EAGER_ROWS = [{"method": "none"}, {"method": "checkpoint"}, {"method": "save_on_cpu"}, {"method": "storm"},
              {"method": "ckpt-first", "ckpt_blocks": 1}, {"method": "storm-budget", "budget_bytes": 1 << 16},
              {"method": "plan", "budget_bytes": 0}]


@pytest.mark.parametrize("row", EAGER_ROWS, ids=lambda r: r["method"])
def test_each_eager_w3_row_trains_on_the_cpu(row):
    w, method, opts = frontier.contender(common.W3_TINY, row, STORM, total_bytes=1 << 20)
    if method == "plan":  # peak= needs CUDA's allocator statistics; a budget plans the same way on the CPU
        opts = {**STORM, "budget": 0.5}
    t = common.Trainer(w, method, opts, CPU)
    try:
        t.warm(2)
        before = [p.detach().clone() for p in t.model.parameters()]
        assert t.step() > 0
        assert any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))  # SGD moved the weights
        if method == "storm":
            assert t.last.stats.offloaded > 0
        if method == "plan":  # settled on a plan that moves half the saves: offloaded or recomputed
            assert t.planner.settled and (t.planner.plan.offloaded or t.planner.plan.recomputed)
    finally:
        t.close()


@pytest.mark.parametrize("compile", ["graph", "blocks"])
def test_a_variant_compiles_at_its_own_activation_memory_budget(monkeypatch, compile):
    """A row's budget goes into what it compiles with (storm.partitioner's memory_budget, nothing
    offloaded unless the row offloads), not into torch's global config while its forward runs:
    dynamo would reuse the graph an earlier row's model of the same class compiled under another
    budget (tests/graph/test_rewrite.py shows the partitioner's budget at work)."""
    compiled: list[dict] = []

    def recording(model, options=None):
        compiled.append(options["custom_partitioner_fn"].options)
        return model

    monkeypatch.setattr(torch, "compile", recording)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, options=None: recording(self, options))
    base = common.TINY
    common.Variant(base, compile=compile, memory_budget=0.1).build(CPU)
    common.Variant(base, compile=compile, memory_budget=0.5, partitioner={**STORM, "budget": 1 << 20}).build(CPU)
    per_build = 1 if compile == "graph" else len(base.blocks(base.build(CPU)[0]))
    first, second = compiled[0], compiled[per_build]
    assert (first.memory_budget, first.budget) == (0.1, 0)
    assert (second.memory_budget, second.budget, second.mode) == (0.5, 1 << 20, STORM["mode"])
    assert len(compiled) == 2 * per_build


@pytest.mark.slow  # inductor compiles the tiny Llama three times: about a minute on 2 cores
@pytest.mark.parametrize("row", [{"method": "none", "compiled": "graph", "memory_budget": 0.1},
                                 {"method": "storm", "compiled": "graph"},
                                 {"method": "plan", "compiled": "blocks", "budget_bytes": 0}],
                         ids=["graph-budget-0.1", "graph-storm", "blocks-plan"])
def test_each_compiled_w3_row_trains_on_the_cpu(row):
    w, method, opts = frontier.contender(common.W3_TINY, row, STORM, total_bytes=1 << 20)
    if method == "plan":
        opts = {**STORM, "budget": 0.5}
    t = common.Trainer(w, method, opts, CPU)
    try:
        t.warm(2)
        assert t.step() > 0
        if row["compiled"] == "graph":
            assert isinstance(t.model, torch._dynamo.eval_frame.OptimizedModule)
        else:
            assert all(block._compiled_call_impl is not None for block in w.blocks(t.model))
        if method == "plan":
            assert t.planner.settled and (t.planner.plan.offloaded or t.planner.plan.recomputed)
    finally:
        t.close()


def test_storm_over_checkpointing_offloads_the_checkpointed_blocks_inputs():
    """The frontier's storm-checkpoint row: storm.offload around a model whose own (Hugging Face)
    checkpointing is on, as a user who has it on would add STORM; gradients as without STORM."""
    w, method, opts = frontier.contender(common.W3_TINY, {"method": "storm-checkpoint"}, STORM)
    assert (w.ckpt, method, opts) == (True, "storm", STORM)
    model, x = w.build(CPU)
    ref, _ = common.W3_TINY.build(CPU)  # the same seed: the same weights, no checkpointing
    with storm.offload(**opts) as ctx:
        loss = w.forward(model, x)
    ctx.synchronize()
    w.objective(loss).backward()
    w.objective(w.forward(ref, x)).backward()
    assert ctx.stats.offloaded > 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_torchtunes_offload_activations_imports_without_its_dataset_stack():
    try:
        offload_activations = common.torchtune_offload()
    except ImportError as e:
        pytest.skip(f"torchtune is not importable here: {e}")
    assert offload_activations.__name__ == "OffloadActivations"
    assert common.torchtune_offload() is offload_activations  # a second row finds it loaded
    if not torch.cuda.is_available():
        pytest.skip("OffloadActivations copies on CUDA streams: its rows run where CUDA is")
    w, method, opts = frontier.contender(common.W3_TINY, {"method": "torchtune-checkpoint"}, STORM)
    t = common.Trainer(w, method, opts, torch.device("cuda"))
    try:
        t.warm(1)
        assert t.step() > 0
    finally:
        t.close()


def test_a_row_that_cannot_run_leaves_its_reason_and_the_run_goes_on():
    class Unbuildable(common.Llama):
        def build(self, device, ckpt=False, seed=0):
            raise ImportError("transformers is not installed")

    w = Unbuildable(**dataclasses.asdict(common.W3_TINY))
    assert common.run(w, "none", 1, 1, {}, CPU) == {"error": "ImportError: transformers is not installed"}


def test_a_row_keeps_the_warnings_storm_gave_while_it_ran():
    class Warns(common.Llama):
        def build(self, device, ckpt=False, seed=0):
            logging.getLogger("storm").warning("storm.offload: the model runs inside a region compiled as one graph")
            logging.getLogger("storm").warning("storm.offload: the model runs inside a region compiled as one graph")
            raise RuntimeError("no device here")

    w = Warns(**dataclasses.asdict(common.W3_TINY))
    r = common.run(w, "storm", 1, 1, {}, CPU)
    assert r == {"error": "RuntimeError: no device here",
                 "warnings": ["storm.offload: the model runs inside a region compiled as one graph"]}
    assert not any(isinstance(h, common.WarningLog) for h in logging.getLogger("storm").handlers)


def test_the_duel_decides_the_verdicts_where_the_planner_was_timed_in_alternation():
    """Rows measured minutes apart compare the machine's drift too (a lent H200 at cd70d31: the
    plan's row 1.031x checkpointing's, 0.990x in alternation); and whole-graph full offload holds
    by its warning."""
    rows = [{"label": "checkpoint", "method": "checkpoint", "step_ms": 100.0, "peak_GiB": 2.0},
            {"label": "compiled", "method": "none", "compiled": "graph", "step_ms": 50.0, "peak_GiB": 5.0},
            {"label": "compiled storm-full", "method": "storm", "compiled": "graph", "step_ms": 200.0,
             "peak_GiB": 5.1, "warnings": ["storm.offload: ... runs inside a region that torch.compile compiled as "
                                           "one graph (the whole model compiled?) ..."]}]
    planner = [{"budget_bytes": 8 * GiB, "fits_cap": True, "step_ms": 103.0, "peak_cap_GiB": 2.0, "x_other": 1.03,
                "best_other": "ckpt-first-16"}]
    duel = [{"budget_bytes": 8 * GiB, "other": "ckpt-first-16", "ratio": 0.99, "ratio_95": [0.98, 1.0]}]
    sec = {"rows": rows, "planner": planner, "layers": 16, "duel": duel,
           "ckpt_budgets": {"checkpoint": 8 * GiB, "half_checkpoint": 9 * GiB}}
    verdicts = summary.must_show(sec)
    assert verdicts["plan_vs_best_other"]["worst_x_other"] == 0.99 and verdicts["plan_vs_best_other"]["holds"]
    at_ckpt = verdicts["plan_at_checkpoint_peak"]
    assert at_ckpt["x_checkpoint"] == 1.03 and at_ckpt["duel"]["ratio"] == 0.99 and at_ckpt["holds"]
    whole = verdicts["graph_compiled_full_offload"]
    assert whole["fraction_removed"] == -0.02 and whole["warned"] and whole["holds"]
    del sec["duel"], rows[-1]["warnings"]
    verdicts = summary.must_show(sec)
    assert not verdicts["plan_at_checkpoint_peak"]["holds"] and not verdicts["plan_vs_best_other"]["holds"]
    assert not verdicts["graph_compiled_full_offload"]["holds"]


class FakeRun:
    """common.run's results for W3's rows, made up: what each row was asked for is kept."""

    PEAKS = {"none": 10.0, "checkpoint": 2.001, "save_on_cpu": 1.0, "torchtune": 1.5, "storm": 1.2}

    def __init__(self):
        self.calls = []

    def __call__(self, w, method, steps, warmup, opts, device):
        self.calls.append((w, method, opts))
        if method == "torchtune" and isinstance(w, common.Variant):
            return {"error": "ImportError: torchtune is not installed"}  # a row that cannot run here
        compiled = getattr(w, "compile", None)
        if method == "plan":  # fits its cap; 100 ms at checkpointing's peak, 104 below it, 90 above
            peak = opts["peak"] / GiB
            return {"step_ms": 100.0 if abs(peak - 2.0) < 0.01 else 104.0 if peak < 2 else 90.0,
                    "peak_extra_GiB": peak}
        if compiled == "graph" and method == "storm":
            return {"step_ms": 200.0, "peak_extra_GiB": 4.0}
        if compiled == "graph" and w.partitioner is not None:  # storm.partitioner
            return {"step_ms": 150.0, "peak_extra_GiB": 2.0}
        if compiled == "graph":  # torch's activation_memory_budget: less memory, more time
            return {"step_ms": {1.0: 50.0, 0.5: 55.0, 0.1: 60.0}[w.memory_budget],
                    "peak_extra_GiB": {1.0: 5.0, 0.5: 4.0, 0.1: 3.0}[w.memory_budget]}
        if compiled == "blocks":
            return {"step_ms": 45.0, "peak_extra_GiB": 6.0}
        ckpt_blocks = getattr(w, "ckpt_blocks", None)
        peak = 10.0 - 8.0 * ckpt_blocks / w.layers if ckpt_blocks else self.PEAKS.get(method, 10.0)
        if method == "storm" and "budget" in opts:
            peak = 10.0 - opts["budget"] / GiB
        return {"step_ms": 100.0 if method == "checkpoint" else 120.0 if method != "none" else 80.0,
                "peak_extra_GiB": peak, "forward_ms": 25.0}


def test_frontier_measures_w3s_rows_at_checkpointings_caps_and_gives_the_must_show_verdicts(tmp_path):
    fake = FakeRun()
    args = argparse.Namespace(workloads=["W3-tiny"], batch=None, layers=None, steps=1, warmup=0, points=2,
                              budgets=None, pool_size="64MiB", min_bytes=1024, duel=0, resume=None,
                              out=str(tmp_path / "f.json"), compiled=True)
    results = frontier.measure(args, CPU, measure_row=fake, link={"d2h_GBps": 50.0, "h2d_GBps": 50.0})
    sec = results["W3-tiny"]
    labels = [r["label"] for r in sec["rows"]]
    assert {"none", "checkpoint", "save_on_cpu", "torchtune", "torchtune-checkpoint", "storm-full",
            "storm-checkpoint", "compiled",
            "compiled budget 0.5", "compiled budget 0.1", "compiled storm-full", "compiled storm-graph",
            "blocks-compiled"} <= set(labels)
    # the caps at checkpointing's peak (2.001 GiB, rounded up to a byte) and half of it are among the budgets,
    # each with a plan row
    cap = math.ceil(2.001 * GiB)
    # and, save_on_cpu having gone below checkpointing (to 1 GiB), that peak and halfway to checkpointing's
    assert sec["ckpt_budgets"] == {"checkpoint": 10 * GiB - cap, "half_checkpoint": 10 * GiB - cap // 2,
                                   "below_checkpoint": 10 * GiB - (cap + GiB) // 2, "least_other": 9 * GiB}
    assert set(sec["ckpt_budgets"].values()) <= set(sec["budgets"])
    assert {"plan 2.00GiB", "plan 1.00GiB"} <= set(labels)
    # a row that cannot run says why, and the run went on past it
    failed = next(r for r in sec["rows"] if r["label"] == "torchtune-checkpoint")
    assert failed["error"] == "ImportError: torchtune is not installed"
    # storm.plan on the blocks compiled one by one is capped at torch's budget 0.1 peak (3 GiB)
    w, method, opts = fake.calls[labels.index("blocks-compiled plan 3.00GiB")]
    assert (w.compile, method, opts["peak"]) == ("blocks", "plan", 3 * GiB)
    # every STORM row offloads down to --min-bytes (torchtune's min_offload_size by default)
    assert {c[2]["min_bytes"] for c in fake.calls if c[1] in ("storm", "plan")} == {1024}
    assert [(c[0].compile, c[0].memory_budget) for c in fake.calls if getattr(c[0], "compile", None) == "graph"
            and c[1] == "none" and c[0].partitioner is None] == [("graph", 1.0), ("graph", 0.5), ("graph", 0.1)]
    verdicts = sec["must_show"]
    # the plan's peak, measured equal to checkpointing's, fits the cap taken from it
    assert verdicts["plan_at_checkpoint_peak"]["x_checkpoint"] == 1.0 and verdicts["plan_at_checkpoint_peak"]["holds"]
    half = verdicts["plan_at_half_checkpoint_peak"]
    assert half["x_checkpoint"] == 1.04 and half["holds"] and half["cap_GiB"] == round(cap // 2 / GiB, 3)
    compiled = verdicts["blocks_compiled_plan_vs_budget_0.1"]
    assert compiled["fits_cap"] and compiled["x"] == 1.5 and not compiled["holds"]  # 90 ms against 60
    whole = verdicts["graph_compiled_full_offload"]
    assert whole["fraction_removed"] == round(1 - 4.0 / 5.0, 3)  # the hooks: too late to lower the peak
    assert whole["partitioner_fraction_removed"] == 0.6 and whole["partitioner_x_compiled"] == 3.0 and whole["holds"]
    w, method, opts = fake.calls[labels.index("compiled storm-graph")]
    assert (w.compile, w.memory_budget, method, w.partitioner["mode"]) == ("graph", None, "none", "embedded")
    # compiled rows are not the eager planner's "best other", though faster
    assert all(p["best_other"] is None or not p["best_other"].startswith(("compiled", "blocks"))
               for p in sec["planner"])
    written = json.loads((tmp_path / "f.json").read_text())
    assert written["W3-tiny"]["must_show"] == verdicts
    assert "issue 40's must-show" in summary.table("W3-tiny", sec)


def test_caps_come_from_exact_peaks_where_rows_have_them(tmp_path):
    """A peak in GiB rounded to 3 decimals is up to half a MiB off: on a lent H200 W1's cap at
    checkpointing's peak (0.606 GiB) fell 0.4 MiB below checkpointing's own peak, and the
    planner rightly said checkpointing every block did not fit it."""
    class Exact(FakeRun):
        def __call__(self, w, method, steps, warmup, opts, device):
            r = super().__call__(w, method, steps, warmup, opts, device)
            if method == "checkpoint":
                r["peak_bytes"] = int(2.0014 * GiB)  # reads 2.001 GiB
            return r

    args = argparse.Namespace(workloads=["W3-tiny"], batch=None, layers=None, steps=1, warmup=0, points=2,
                              budgets=None, pool_size="64MiB", min_bytes=1024, duel=0, resume=None,
                              out=str(tmp_path / "f.json"), compiled=False)
    sec = frontier.measure(args, CPU, measure_row=Exact(), link={"d2h_GBps": 50.0, "h2d_GBps": 50.0})["W3-tiny"]
    assert sec["ckpt_budgets"]["checkpoint"] == 10 * GiB - int(2.0014 * GiB)
    assert summary.peak_bytes({"peak_GiB": 2.001}) == math.ceil(2.001 * GiB)


def test_a_plan_slower_than_checkpointing_at_its_peak_fails_that_verdict():
    sec = {"rows": [{"label": "checkpoint", "method": "checkpoint", "step_ms": 100.0, "peak_GiB": 2.0}],
           "planner": [{"budget_bytes": 8 * GiB, "fits_cap": True, "step_ms": 101.0, "peak_cap_GiB": 2.0,
                        "x_other": 1.01}],
           "ckpt_budgets": {"checkpoint": 8 * GiB, "half_checkpoint": 9 * GiB}}
    verdicts = summary.must_show(sec)
    at_ckpt = verdicts["plan_at_checkpoint_peak"]
    assert not at_ckpt["holds"] and at_ckpt["x_checkpoint"] == 1.01
    assert not verdicts["plan_vs_best_other"]["holds"]
    assert verdicts["plan_at_half_checkpoint_peak"]["x_checkpoint"] is None  # no plan row at that cap
    assert not verdicts["blocks_compiled_plan_vs_budget_0.1"]["holds"]


def test_a_cap_another_method_fits_and_the_plan_does_not_fails_the_best_other_verdict():
    """A plan that misses a cap torchtune reaches is no better there than one slower than it;
    and a cap below every method's peak is marked as reached by none."""
    rows = [{"label": "checkpoint", "method": "checkpoint", "step_ms": 100.0, "peak_GiB": 2.0},
            {"label": "torchtune-checkpoint", "method": "torchtune-checkpoint", "step_ms": 130.0, "peak_GiB": 1.6}]
    planner = [{"budget_bytes": 8 * GiB, "fits_cap": True, "step_ms": 99.0, "peak_cap_GiB": 2.0, "x_other": 0.99,
                "best_other": "checkpoint"},
               {"budget_bytes": 8.4 * GiB, "fits_cap": False, "step_ms": 99.0, "peak_cap_GiB": 1.6,
                "best_other": "torchtune-checkpoint"},
               {"budget_bytes": 9 * GiB, "fits_cap": False, "step_ms": 99.0, "peak_cap_GiB": 1.0, "best_other": None}]
    sec = {"rows": rows, "planner": planner, "ckpt_budgets": {"checkpoint": 8 * GiB, "half_checkpoint": 9 * GiB}}
    verdicts = summary.must_show(sec)
    assert verdicts["plan_vs_best_other"] == {"worst_x_other": 0.99, "caps_missed_GiB": [1.6], "holds": False}
    half = verdicts["plan_at_half_checkpoint_peak"]
    assert half["least_other_peak_GiB"] == 1.6 and not half["reached_by_any"] and not half["holds"]
    assert verdicts["plan_at_checkpoint_peak"]["reached_by_any"]


def test_a_plan_that_says_it_does_not_fit_never_fits_its_cap_whatever_peak_was_measured():
    """On a lent H100 a W3 plan at half of checkpointing's peak fell back to checkpointing (fits
    False) and its row measured 0.79 GiB, below checkpointing's own 3.56: the verdict took it."""
    rows = [{"label": "none", "method": "none", "step_ms": 100.0, "peak_GiB": 4.0, "forward_ms": 30.0},
            {"label": "checkpoint", "method": "checkpoint", "step_ms": 120.0, "peak_GiB": 2.0},
            {"label": "plan", "method": "plan", "budget_bytes": 3 * GiB, "step_ms": 121.0, "peak_GiB": 0.79,
             "plan": {"fits": False}}]
    sec = {"rows": rows, "budgets": [3 * GiB], "total_bytes": 4 * GiB, "bytes_per_block": GiB // 4, "layers": 16,
           "ckpt_budgets": {"checkpoint": 2 * GiB, "half_checkpoint": 3 * GiB}}
    sec.update(summary.summarize(sec, {"d2h_GBps": 50.0, "h2d_GBps": 50.0}))
    (entry,) = sec["planner"]
    assert not entry["fits_cap"]
    assert not summary.must_show(sec)["plan_at_half_checkpoint_peak"]["holds"]
    rows[-1]["plan"]["fits"] = True
    sec.update(summary.summarize(sec, {"d2h_GBps": 50.0, "h2d_GBps": 50.0}))
    assert sec["planner"][0]["fits_cap"] and summary.must_show(sec)["plan_at_half_checkpoint_peak"]["holds"]
