"""bench/daemon.py: its CPU split (stormd on physical cores of its own, the training process on the
others: bench/profile_step.py --daemon-cores), checked on this machine's kernel; and its stop, which
says BYE for the benchmark's own sessions first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import storm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from daemon import parse_cpu_list, physical_cores, split_cores, start_daemon, stop_daemon, thread_cpus  # noqa: E402


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5}
    assert parse_cpu_list("") == set()


def test_the_split_keeps_smt_siblings_together_and_gives_stormd_the_last_cores():
    cores = [frozenset({0, 8}), frozenset({1, 9}), frozenset({2, 10}), frozenset({3, 11})]
    assert split_cores(cores, 1) == ({3, 11}, {0, 8, 1, 9, 2, 10})
    assert split_cores(cores, 3) == ({1, 9, 2, 10, 3, 11}, {0, 8})
    for n in (0, 4):
        with pytest.raises(ValueError, match="1 to 3 of the 4 physical cores"):
            split_cores(cores, n)


def test_this_machines_cores_cover_exactly_the_cpus_this_process_may_use():
    cores = physical_cores()
    assert set().union(*cores) == os.sched_getaffinity(0)
    assert sum(len(c) for c in cores) == len(os.sched_getaffinity(0))  # no CPU in two cores


def test_a_pinned_stormd_runs_every_thread_on_its_cpus_only(tmp_path):
    mine = os.sched_getaffinity(0)
    cpus = {min(mine)}
    proc, _ = start_daemon(tmp_path, "64MiB", cpus=cpus)
    try:
        threads = thread_cpus(proc.pid)
        assert len(threads) > 1  # its event loop and ZeroMQ's I/O thread at least
        assert all(allowed == cpus for allowed in threads.values()), threads
        assert os.sched_getaffinity(0) == mine  # the parent's own is untouched
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.parametrize("flags, says", [(["--daemon-cores", "1"], "--daemon-cores needs --daemon"),
                                         (["--daemon", "--daemon-cores", "4096"], "physical cores this process")])
def test_profile_step_refuses_a_split_it_cannot_make_before_touching_the_gpu(tmp_path, flags, says):
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "bench" / "profile_step.py"),
                        *flags, "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_stop_says_bye_so_a_session_holding_keys_does_not_wait_out_the_drain_deadline(tmp_path):
    log = tmp_path / "stormd.log"
    proc, endpoint = start_daemon(tmp_path, "64MiB", "--drain-timeout", "20", log=log)
    try:
        x = torch.randn(1 << 19, requires_grad=True)  # 2 MiB: offloaded
        with storm.offload(mode="daemon", socket=endpoint) as ctx:
            y = x.exp()  # saves its output; no backward, so the store keeps it
        ctx.synchronize()
        assert storm.stats(mode="daemon", socket=endpoint)["node"]["keys"] >= 1
        stop_daemon(proc)  # without its BYE, stormd would hold on for its 20 s deadline and say so
        assert proc.returncode == 0
        text = log.read_text()
        assert "drained: no client holds a tensor" in text and "drain deadline passed" not in text, text
        del y
    finally:
        if proc.poll() is None:
            proc.kill()
