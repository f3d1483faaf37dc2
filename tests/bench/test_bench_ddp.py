"""bench/ddp.py on CPU (gloo, the tiny workloads): ranks with no offload, an embedded store each and
one shared stormd, in one launch, get every step's loss and gradients bit-identical across the rows,
and the JSON has each row's figures per rank, the link floor, and what each mode page-locks and
takes to start."""

from __future__ import annotations

import pytest

from helpers import bench_module, bench_result, run_bench

ddp = bench_module("ddp")


def tiny_cpu_run(tmp_path, *args: str) -> dict:
    """bench/ddp.py's JSON from a run of the tiny workloads on CPU: 2 steps a row, 64 MiB pools."""
    out = tmp_path / "ddp.json"
    r = run_bench("ddp.py", "--tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--pool-size", "64MiB",
                  "--out", str(out), *args, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return bench_result(out)


@pytest.mark.slow  # two daemons, torchrun twice, two tiny models in three rows: tens of seconds on 2 cores
def test_one_and_two_cpu_ranks_step_bit_identically_in_every_row(tmp_path):
    # a run across two calls (a time limit after the first rank count, whose daemon had the run's pool):
    # --resume keeps the rank count the JSON holds and runs the other
    first = tiny_cpu_run(tmp_path, "--ranks", "1", "--models", "W1", "W3", "--rounds", "2",
                         "--daemon-pool-size", "128MiB")
    result = tiny_cpu_run(tmp_path, "--ranks", "1", "2", "--models", "W1", "W3", "--rounds", "2", "--resume")
    assert result["resumed_from"] == first["meta"] and result["runs"]["1"] == first["runs"]["1"]
    assert list(result["runs"]) == ["1", "2"]
    assert result["meta"]["device"] == "cpu" and result["wrapper"] == "ddp" and not result["peer_access"]
    assert result["rows"] == ["none", "embedded", "daemon"] and set(result["runs"]) == {"1", "2"}
    # the daemon's STATUS: no CUDA, nothing page-locked
    daemon = result["daemon"]
    assert daemon["start_s"] > 0 and daemon["page_lock_s"] is None and daemon["page_locked_bytes"] == 0
    assert daemon["spill"] == {"on": False, "written_bytes": 0}
    for n, run in result["runs"].items():
        ranks = int(n)
        assert run["ranks"] == ranks and len(run["link_together_GBps"]) == ranks
        assert set(run["models"]) == {"tiny", "W3-tiny"}
        for model in run["models"].values():
            for name, row in model["rows"].items():
                assert row["steps"] == 4 and row["identical_steps"] == [4] * ranks, (n, name, row)
                assert len(row["step_ms"]) == ranks and row["step_ms_median"] > 0
                assert len(row["round_ms"]) == ranks and all(len(r) == 2 and min(r) > 0 for r in row["round_ms"])
            for name in ("embedded", "daemon"):
                row = model["rows"][name]
                assert all(b > 0 for b in row["offloaded_bytes"]) and all(f > 0 for f in row["floor_ms"])
                assert all(s > 0 for s in row["step_over_floor"]) and len(row["to_host_bytes"]) == ranks
                assert all(p > 0 for p in row["pack_ms"]) and len(row["fetch_wait_ms"]) == ranks
            loop = model["rows"]["daemon"]["daemon_loop"]  # every rank's requests, read off the daemon once
            assert 0 < loop["busy_fraction"] < 1 and loop["us_per_request"] > 0, loop
            assert loop["requests_per_step"] >= ranks, loop
            assert len(model["daemon_over_embedded"]["per_rank"]) == ranks
            assert model["daemon_over_embedded"]["median"] > 0
            assert len(model["daemon_over_embedded"]["per_round"]) == 2  # --rounds 2
        locked, start = run["page_locked"], run["startup_s"]
        assert locked["embedded"]["bytes"] == 0 and locked["embedded"]["per_rank"] == [0] * ranks
        assert locked["embedded"]["pool_bytes"] == ranks * 64 << 20
        assert locked["daemon"]["bytes"] == 0 and locked["daemon"]["pool_bytes"] == 128 << 20  # 64MiB x 2 ranks
        assert locked["daemon"]["peak_bytes"] > 0 and locked["embedded"]["peak_bytes"] > 0
        assert len(start["embedded"]["per_rank"]) == ranks and all(s >= 0 for s in start["embedded"]["create"])
        assert start["daemon"]["start"] > 0 and len(start["daemon"]["connect_per_rank"]) == ranks


@pytest.mark.slow  # two daemons, torchrun once
def test_with_a_daemon_per_rank_each_rank_has_its_own_and_its_share_of_the_pool_spill_and_profiles(tmp_path):
    # four ranks: the all-reduce's order of addition then follows DDP's buckets, which the first
    # backward lays out again; every row steps identically all the same
    result = tiny_cpu_run(tmp_path, "--ranks", "4", "--models", "W1", "--rounds", "2", "--daemons", "2", "--spill",
                          "--spill-limit", "64MiB",  # stormd's default would need 16 GiB of free disk
                          "--profile", str(tmp_path / "profile"), "--switch-interval", "0.0005")
    assert result["daemon"]["daemons"] == 2
    assert result["runs"]["4"]["switch_interval_s"] == [0.0005] * 4  # each rank set it
    # --profile: per rank and row, torch.profiler's table and the training thread's cProfile; the first daemon's
    made = {p.name for p in (tmp_path / "profile").iterdir()}
    assert {f"ranks4-tiny-{row}-rank{r}{kind}" for row in ("none", "embedded", "daemon") for r in range(4)
            for kind in (".txt", ".cprofile.txt", ".trace.json.gz")} | {"stormd-cprofile.txt"} <= made, made
    assert "storm/session.py" in (tmp_path / "profile" / "ranks4-tiny-daemon-rank0.cprofile.txt").read_text()
    # each trace read into the JSON (bench/trace_gaps.py): on CPU no stream, but backward's nodes on the host
    read = result["profile"]["ranks4-tiny-daemon-rank0.trace.json.gz"]
    assert read["steps"] == [] and read["backward_host"]["nodes_ms"] > 0, read
    assert len(result["profile"]) == 3 * 4
    assert result["daemon"]["spill"] == {"on": True, "written_bytes": 0}  # both spill; the tiny steps fit the pools
    run = result["runs"]["4"]
    for row in run["models"]["tiny"]["rows"].values():
        assert row["identical_steps"] == [4] * 4, row
    # each daemon's pool is half of 64 MiB x 4 ranks; the rank's HELLO says its own daemon's
    assert run["page_locked"]["daemon"]["pool_bytes"] == 128 << 20


def test_rank_counts_are_powers_of_two_up_to_the_gpus_or_one_and_two_on_cpu():
    assert ddp.default_ranks(0) == [1, 2]
    assert ddp.default_ranks(1) == [1]
    assert ddp.default_ranks(3) == [1, 2]
    assert ddp.default_ranks(8) == [1, 2, 4, 8]


def test_the_floor_sends_out_at_the_first_speed_and_back_at_the_second():
    assert ddp.floor_ms(2_000_000_000, 1_000_000_000, [20.0, 10.0]) == pytest.approx(200.0)


def test_a_launch_fails_where_a_step_differed_or_nothing_was_offloaded():
    row = {"steps": 2, "identical_steps": [2, 2], "offloaded_bytes": [1, 1]}
    run = {"models": {"W1": {"rows": {"none": {"steps": 2, "identical_steps": [2, 2]},
                                      "embedded": row, "daemon": dict(row)}}}}
    assert ddp.passed(run)
    run["models"]["W1"]["rows"]["daemon"]["identical_steps"] = [2, 1]
    assert not ddp.passed(run)
    run["models"]["W1"]["rows"]["daemon"] = {**row, "offloaded_bytes": [1, 0]}
    assert not ddp.passed(run)


def test_daemon_over_embedded_is_each_ranks_step_ratio_their_median_and_each_rounds():
    def rank(embedded_ms: float, daemon_ms: float, daemon_rounds: list[float]) -> dict:
        rows = {"none": {"step_ms": 1.0, "round_ms": [1.0, 1.0], "steps": 2, "identical_steps": 2},
                "embedded": {"step_ms": embedded_ms, "round_ms": [10.0, 10.0], "steps": 2, "identical_steps": 2},
                "daemon": {"step_ms": daemon_ms, "round_ms": daemon_rounds, "steps": 2, "identical_steps": 2}}
        pool = {"pool_bytes": 8, "peak_bytes": 4, "page_locked_bytes": 8}
        return {"link_alone_GBps": [1, 1], "link_together_GBps": [1, 1], "proc_status_kB": {},
                "switch_interval_s": 0.005, "models": {"W1": {"workload": {}, "rows": rows}},
                "pools": {"embedded": pool, "daemon": pool},
                "startup_s": {"create": 0.5, "page_lock": 1.0, "connect": 0.1}}

    run = ddp.summarize_launch([rank(10.0, 12.0, [13.0, 11.0]), rank(10.0, 11.0, [12.0, 10.0])],
                               {"start_s": 3.0, "page_lock_s": 2.0, "page_locked_bytes": 8})
    # per round: the ranks' medians, 12.5 and 10.5 against 10
    assert run["models"]["W1"]["daemon_over_embedded"] == {"median": 1.15, "per_rank": [1.2, 1.1],
                                                           "per_round": [1.25, 1.05]}
    assert run["models"]["W1"]["rows"]["daemon"]["step_ms"] == [12.0, 11.0]
    assert run["page_locked"]["embedded"]["bytes"] == 16 and run["page_locked"]["daemon"]["bytes"] == 8
    assert run["startup_s"]["embedded"]["per_rank"] == [1.5, 1.5] and run["startup_s"]["daemon"]["start"] == 3.0


def test_the_daemons_load_is_its_loops_share_of_the_rows_wall_time_and_host_time_a_request():
    loop = {"requests": 0, "busy_s": 0.0, "wall_s": 0.0}
    figures = ddp.loop_figures({"requests": 400, "busy_s": 0.02, "wall_s": 0.1}, steps=4)
    assert figures == {"busy_fraction": 0.2, "us_per_request": 50.0, "requests_per_step": 100.0}
    assert ddp.loop_figures(loop, steps=4) == {"busy_fraction": None, "us_per_request": None, "requests_per_step": 0.0}


def test_a_budget_is_a_fraction_or_bytes_or_none():
    assert ddp.budget("0.25") == 0.25
    assert ddp.budget("2GiB") == "2GiB"
    assert ddp.budget(None) is None
