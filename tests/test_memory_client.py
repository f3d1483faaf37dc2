"""A training process's share of the node's pool and its own host memory stay bounded over
many steps, whatever the mover's pace and whenever the garbage collector runs."""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import threading
import weakref
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import storm
from conftest import start_daemon, stop_daemon
from storm.connection import DaemonConnection
from storm.examples.models import same_bits
from storm.policy import Policy
from storm.saved import StepOptions
from storm.session import ClientSession


def small_mlp() -> tuple[nn.Module, torch.Tensor]:
    """A model whose step offloads four storages of 16 to 64 KiB: bookkeeping, not bandwidth."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)), \
        torch.randn(64, 64)


@contextlib.contextmanager
def mover_held_back(session: ClientSession):
    """The session's mover starts no copy until the block ends: a mover that falls behind the
    training thread, without depending on either one's speed."""
    gate = threading.Event()
    session.mover._worker.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()


def train_step(session: ClientSession, model: nn.Module, x: torch.Tensor) -> None:
    """A step as storm.offload runs it, on a session of the test's own (storm.offload keeps one
    session per process and endpoint; these tests need several clients of one daemon)."""
    # saving never waits for a held-back mover
    step, policy = session.new_step(options=StepOptions(max_held_bytes=1 << 30)), Policy(min_bytes=0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: session.save(t, step, policy), session.load):
        loss = model(x).square().sum()
    session.end_step(step)
    loss.backward()


def test_saves_backward_took_before_the_mover_reached_them_take_no_pool_space():
    """Backward unpacks a save whose copy has not begun from its still-held tensor. Such a key kept
    the extent its PUT reserved at save time until the mover came to it, so a mover behind the
    training thread held a backlog of extents many times the working set, and filled the node's
    pool. Its copy is dropped now, and a CPU put reserves nothing before the mover starts it."""
    model, x = small_mlp()
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    opts = {"mode": "embedded", "min_bytes": 0, "pool_size": "64MiB",
            "max_held_bytes": "1GiB"}  # far above 50 steps: saving never waits for the held-back mover
    session = storm.registry.session_for("embedded", None, "64MiB")
    store = session.backend.service.store
    with mover_held_back(session):
        for step in range(50):
            model.zero_grad(set_to_none=True)
            with storm.offload(**opts) as ctx:
                loss = model(x).square().sum()
            assert ctx.stats.offloaded == 4
            loss.backward()
            assert ctx.stats.copies_dropped == 4
            assert ctx.stats.dropped_bytes == ctx.stats.offloaded_bytes > 0  # every save dropped, in bytes
            node = store.node_stats()
            assert (node["keys"], node["used"]) == (0, 0), \
                f"after step {step}: the store holds {node['keys']} keys of {node['used']} bytes"
    ctx.synchronize()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))
    assert store.session_stats(session.backend.session)["puts"] == 0  # the mover was spared every copy
    assert store.node_stats()["keys"] == 0


def test_clients_whose_movers_fall_behind_are_not_refused_for_a_full_pool(tmp_path):
    """Four clients of one daemon, each step saving about 150 KB, on a 2 MiB pool: PUTs sent at
    save time, ahead of movers that had fallen behind, took the pool from all of them."""
    d = start_daemon(tmp_path, "--pool-size", "2MiB", "--no-metrics")
    model, x = small_mlp()
    sessions: list[ClientSession] = []
    try:
        for _ in range(4):
            sessions.append(ClientSession(DaemonConnection(d.endpoint)))
        with contextlib.ExitStack() as held_back:
            for s in sessions:
                held_back.enter_context(mover_held_back(s))
            for _ in range(5):
                for s in sessions:
                    train_step(s, model, x)
        for _ in range(5):  # and with the movers at their own pace
            for s in sessions:
                train_step(s, model, x)
        for s in sessions:
            s.synchronize()
        stats = [s.mover.request("STATS").result(timeout=30) for s in sessions]
        assert stats[0]["node"]["errors"].get("POOL_FULL", 0) == 0, stats[0]["node"]
        assert [st["session"]["pool_full"] for st in stats] == [0] * 4
        assert [st["session"]["keys"] for st in stats] == [0] * 4
    finally:
        for s in sessions:
            s.close()
            s.backend.close()
        stop_daemon(d)
    assert d.proc.returncode == 0, d.output()


@pytest.fixture(params=["embedded", "daemon"])
def opts(request):
    if request.param == "embedded":
        return {"mode": "embedded", "min_bytes": 0}
    return {"mode": "daemon", "socket": request.getfixturevalue("daemon").endpoint, "min_bytes": 0}


@contextlib.contextmanager
def no_garbage_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_finished_step_is_freed_without_the_garbage_collector(opts):
    """Each Stored and its Step referred to each other: every step left its saves' bookkeeping
    (Stored, Step, Copy, Future and its lock, StorageWeakRef) to the cycle collector, and the
    host's heap grew between its runs (next test)."""
    model, x = small_mlp()
    with no_garbage_collector():
        steps, saves = [], []
        for _ in range(5):
            with storm.offload(**opts) as ctx:
                loss = model(x).square().sum()
            loss.backward()
            steps.append(weakref.ref(ctx._step))
            saves += [weakref.ref(s) for s in ctx._step.order]
        ctx.synchronize()
        del ctx, loss
        assert len(saves) == 20
        alive = sum(r() is not None for r in steps + saves)
        assert alive == 0, f"{alive} of 5 steps and their 20 saves outlived them (held only by reference cycles)"
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free: STORM's must not be among it
        gc.collect()
        ours = collections.Counter(type(o).__name__ for o in gc.garbage
                                   if type(o).__module__.startswith("storm") or isinstance(o, Future))
        assert not ours, ours


def rss_anon() -> int:
    """This process's private resident bytes (its heaps; not the pool's shared pages)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/self/status")


def test_host_memory_stays_flat_over_steps():
    """A plain loop through the embedded store. Without the garbage collector only reference counting
    frees, so each step's leftovers show at once: the objects left in cycles pinned the heap
    around each step's freed tensors, and the heap grew by about a step's activations a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1))
    x = torch.randn(256, 1024)  # 1 MiB saves, five a step
    with no_garbage_collector():
        for step in range(50):
            if step == 10:
                warm = rss_anon()
            with storm.offload(mode="embedded", pool_size="256MiB"):
                loss = model(x).square().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
        grown = rss_anon() - warm
    assert grown < 32 << 20, f"private RSS grew by {grown >> 20} MiB over 40 steps of 5 MiB of saves each"
