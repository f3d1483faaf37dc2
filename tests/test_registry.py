"""storm/registry.py: the process's sessions, one per backend, whichever threads ask for it."""

from __future__ import annotations

import threading
import time

import torch

import storm.registry as registry


def test_threads_that_begin_together_share_one_session(monkeypatch):
    """Each session starts a Mover (a worker thread) of its own: the first construction is held open
    so that, unguarded, every thread builds one."""
    built = []
    real = registry.ClientSession

    class Slow(real):
        def __init__(self, backend, **options):
            built.append(self)
            time.sleep(0.5)  # the others reach session_for meanwhile
            super().__init__(backend, **options)

    monkeypatch.setattr(registry, "ClientSession", Slow)
    monkeypatch.setattr(registry, "_sessions", {})
    got: list = []
    start = threading.Barrier(4)

    def first_step() -> None:
        start.wait()
        got.append(registry.session_for("embedded", None, "1MiB"))

    threads = [threading.Thread(target=first_step) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert len(got) == 4 and len(built) == 1 and all(s is built[0] for s in got), (len(got), len(built))
    finally:
        for s in built:
            s.close()


def test_stats_reads_the_session_the_steps_took_whatever_its_pool_size():
    """storm.stats() without a pool_size reports the session of the last step (its pool given as
    storm.offload's pool_size): it opened another session, with a new embedded store and pool."""
    import storm
    x = torch.randn(64, 64, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0, pool_size=(2 << 20) + 4096):  # a pool no other test asks for
        loss = x.exp().sum()
    with registry._sessions_lock:
        sessions = len(registry._sessions)
    assert storm.stats("embedded")["session"]["puts"] == 1  # it waits for the step's copy
    with registry._sessions_lock:
        assert len(registry._sessions) == sessions
    loss.backward()
