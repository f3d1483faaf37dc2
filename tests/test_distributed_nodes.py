"""Several nodes, simulated on one host (issue 41): two node ranks of torchrun (one process each,
gloo), each "node" with its own stormd and socket. Each rank finds its own node's daemon, as on a
real cluster, and DDP's losses and gradients are bit-identical to the same run without STORM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import storm
from conftest import start_daemon, stop_daemon
from stormd.ctl import request

RANK_SCRIPT = Path(__file__).resolve().parent / "multinode_rank.py"
NODES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_each_with_its_own_stormd_train_ddp_bit_identical(tmp_path):
    for n in range(NODES):
        (tmp_path / f"node{n}").mkdir()
    daemons = [start_daemon(tmp_path / f"node{n}", "--pool-size", "64MiB") for n in range(NODES)]
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    try:
        nodes = []
        for n, d in enumerate(daemons):
            # what differs between two real nodes: the daemon each node's ranks find (here by
            # $STORMD_SOCKET; on a node, stormd's default socket in its runtime directory)
            env = {**os.environ, "STORMD_SOCKET": d.endpoint, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(n),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   str(RANK_SCRIPT), str(out)]
            log = (tmp_path / f"node{n}.log").open("w")
            nodes.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        for n, p in enumerate(nodes):
            try:
                rc = p.wait(timeout=600)  # two torch processes and their rendezvous, on a loaded machine
            except subprocess.TimeoutExpired:
                for q in nodes:
                    q.kill()
                log_text = (tmp_path / f"node{n}.log").read_text()
                pytest.fail(f"node {n}'s torchrun still running after 600 s:\n{log_text}")
            assert rc == 0, (tmp_path / f"node{n}.log").read_text()
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES)]
        for r, _ in zip(ranks, daemons):
            assert r["same_losses"] and r["same_gradients"], r
            assert r["offloaded"] > 0 and r["backend"].startswith(f"stormd at {daemons[r['node']].endpoint} "), r
        # each daemon served its own node's rank, and only it
        for d in daemons:
            status = request(d.endpoint, "STATUS", 30)
            assert status["traffic"]["puts"] > 0, status
        assert {r["node"] for r in ranks} == set(range(NODES))
    finally:
        storm.close_all()
        for d in daemons:
            stop_daemon(d)
