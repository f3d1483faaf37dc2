"""bench/common.py: the results' provenance, the workloads' smoke size, and the benchmarks' stop of
their stormd, which says BYE for the benchmark's own sessions first."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import torch

import storm
from helpers import bench_module, bench_result
from storm.planner import Plan
from storm.planner.records import BlockTrace, Trace

common = bench_module("common")


def test_results_carry_their_provenance_and_stormd_commit_names_the_code(tmp_path, monkeypatch):
    monkeypatch.setenv("STORM_COMMIT", "abc1234")  # the lent machine's copy of the tree has no .git of its own
    # a benchmark's command line (pytest's own is another process's under pytest-xdist: "python -c")
    monkeypatch.setattr(sys, "argv", ["bench/offload.py", "--workloads", "tiny"])
    out = tmp_path / "sub" / "r.json"
    common.write(out, {"rows": [1]}, "cpu", cpu_threads=2)
    result = bench_result(out)
    assert result["rows"] == [1]
    assert result["meta"]["commit"] == "abc1234" and result["meta"]["device"] == "cpu"
    assert result["meta"]["command"].endswith("bench/offload.py --workloads tiny")
    assert result["meta"]["cpu_threads"] == 2 and result["meta"]["torch"] == torch.__version__


def test_without_stormd_commit_the_checkouts_head_is_recorded(monkeypatch):
    monkeypatch.delenv("STORM_COMMIT", raising=False)
    head = common.commit()
    assert head == "unknown" or len(head.removesuffix("+uncommitted")) == 40


def test_a_tree_that_differs_from_its_head_is_recorded_as_such(tmp_path, monkeypatch):
    """A tree whose tracked files differ from HEAD ran code no commit holds (the lent machine's copy
    of a tree came with an older .git): its HEAD alone would name other code. Untracked files
    (results, carried wheels) change nothing."""
    monkeypatch.delenv("STORM_COMMIT", raising=False)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("add", "code.py")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "result.json").write_text("{}")
    assert common.commit(tmp_path) == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert common.commit(tmp_path) == head + "+uncommitted"


def test_percentile_is_the_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert common.percentile(values, 0.0) == 1.0
    assert common.percentile(values, 0.5) == 3.0
    assert common.percentile(values, 0.99) == 5.0


def test_workloads_by_name_at_another_batch_or_depth():
    assert [w.name for w in common.workloads(["W2", "tiny"])] == ["W2", "tiny"]
    (w,) = common.workloads(["W1"], batch=256)  # moved here from test_bench_offload.py with offload.workloads
    assert (w.name, w.batch, w.layers) == ("W1_B256", 256, 12)
    (w,) = common.workloads(["W3"], layers=4)
    assert (w.name, w.layers, w.batch, w.hidden) == ("W3_L4", 4, 4, 2048)


def test_the_tiny_workload_builds_a_bf16_model_of_its_size():
    model, x = common.TINY.build(torch.device("cpu"))
    assert len(model.blocks) == common.TINY.layers and x.shape == (2, 32, 64) and x.dtype == torch.bfloat16
    assert model(x).shape == x.shape


def test_stop_says_bye_so_a_session_holding_keys_does_not_wait_out_the_drain_deadline(tmp_path):
    log = tmp_path / "stormd.log"
    proc, endpoint = common.start_daemon(tmp_path, "64MiB", "--drain-timeout", "20", log=log)
    try:
        x = torch.randn(1 << 19, requires_grad=True)  # 2 MiB: offloaded
        with storm.offload(mode="daemon", socket=endpoint) as ctx:
            y = x.exp()  # saves its output; no backward, so the store keeps it
        ctx.synchronize()
        assert storm.stats(mode="daemon", socket=endpoint)["node"]["keys"] >= 1
        common.stop_daemon(proc)  # without its BYE, stormd would hold on for its 20 s deadline and say so
        assert proc.returncode == 0
        text = log.read_text()
        assert "drained: no client holds a tensor" in text and "drain deadline passed" not in text, text
        del y
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_plans_summary_carries_the_plans_the_planner_measured_and_by_how_much_each_went_over():
    """Where no plan fits, the planner measures plans in turn: the row keeps that course, the
    plans in the order measured and each one's step over (under) its target."""
    def plan(offloaded: int, inputs: int) -> Plan:
        return Plan(offloaded=offloaded, recomputed=frozenset(range(offloaded, 4)), offload_budget=None,
                    max_held_bytes=32 << 20, prefetch_bytes=0, predicted_peak=1 << 30, predicted_cost_ms=1.0,
                    fits=False, inputs_offloaded=inputs)

    first, second = plan(0, 4), plan(1, 2)
    measured = {p.shape: dataclasses.replace(p, measured_over=over) for p, over in ((first, 96 << 20),
                                                                                    (second, -(1 << 20)))}
    pl = SimpleNamespace(plan=second, settled=True, target=1 << 30, besides=1 << 20, kept_extra=0, start_extra=0,
                         trials=[], state=SimpleNamespace(measured=measured), trace=traced(),
                         peak_moments=lambda: None, traced_moments=lambda: None)
    rows = common.plan_summary(pl)["measured"]
    assert [(r["offloaded_blocks"], r["inputs_offloaded_blocks"], r["over_MiB"]) for r in rows] == [(0, 4, 96.0),
                                                                                                  (1, 2, -1.0)]
    assert rows[0]["recomputed"] == 4 and rows[0]["max_held_MiB"] == 32.0
    summary = common.plan_summary(pl)  # the traced times the link model's backward is set against
    assert summary["blocks_forward_ms"] == 4.0 and summary["blocks_backward_ms"] == 2.5


def traced() -> Trace:
    """A trace of 4 blocks of 1 ms forward, their backward timed at 2.5 ms."""
    return Trace([BlockTrace(forward_ms=1.0) for _ in range(4)], backward_device_ms=2.5)


def test_a_plans_summary_says_what_the_planner_measured_of_the_plan_in_force():
    """A trial that keeps its alternative applies the plan as it was made, while the planner keeps
    its measure apart (state.measured, by shape): the summary's over_bytes is that measure (before:
    None, and the zoo judged a duel's plan by a shorter key that plans of two copy queues share)."""
    made = Plan(offloaded=0, recomputed=frozenset(range(4)), offload_budget=0, max_held_bytes=0, prefetch_bytes=0,
                predicted_peak=1 << 30, predicted_cost_ms=1.0, fits=True)
    measured = {made.shape: dataclasses.replace(made, measured_over=-(3 << 20))}
    moments = [(5 << 20, 4 << 20), (6 << 20, None), (7 << 20, 7 << 20)]  # two blocks' backward, backward's start
    pl = SimpleNamespace(plan=made, settled=True, target=1 << 30, besides=1 << 20, kept_extra=0, start_extra=0,
                         trials=[], state=SimpleNamespace(measured=measured), trace=traced(),
                         peak_moments=lambda: moments, traced_moments=lambda: None)
    summary = common.plan_summary(pl)
    assert made.measured_over is None and summary["over_bytes"] == -(3 << 20)
    # where the prediction missed, moment by moment: block 0's backward held 1 MiB less than predicted
    assert summary["moments_MiB"] == {"predicted": [5.0, 6.0, 7.0], "measured": [4.0, None, 7.0]}
    assert summary["traced_moments_MiB"] is None
    pl.state.measured = {}
    assert common.plan_summary(pl)["over_bytes"] is None  # not measured
