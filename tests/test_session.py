"""storm/session.py's process-wide sessions: one per backend, whichever threads ask for it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import storm
import storm.session as session_mod


def test_threads_that_begin_together_share_one_session(monkeypatch):
    """Two sessions over one store session would number their keys alike (DUPLICATE_KEY) and each
    start a Mover; the first construction is held open so that, unguarded, every thread builds one."""
    built = []
    real = session_mod.ClientSession

    class Slow(real):
        def __init__(self, backend):
            built.append(self)
            time.sleep(0.5)  # the others reach session_for meanwhile
            super().__init__(backend)

    monkeypatch.setattr(session_mod, "ClientSession", Slow)
    monkeypatch.setattr(session_mod, "_sessions", {})
    got: list = []
    start = threading.Barrier(4)

    def first_step() -> None:
        start.wait()
        got.append(session_mod.session_for("embedded", None, "1MiB"))

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


def test_close_all_before_backward_is_storm_unavailable_saying_what_happened():
    """The store's bytes go with close_all(): backward got 'cannot schedule new futures after
    shutdown' from the mover's executor, and saves after it inside the context the same."""
    x = torch.randn(64, 64, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0):
        loss = x.exp().sum()
    storm.close_all()
    with pytest.raises(storm.StormUnavailable, match="close_all.*once backward has run"):
        loss.backward()
    with pytest.raises(storm.StormUnavailable, match="close_all.*inside this step's context"):
        with storm.offload(mode="embedded", min_bytes=0):
            h = x.exp()
            storm.close_all()
            h.exp()
    with storm.offload(mode="embedded", min_bytes=0) as ctx:  # a new session after that
        loss = x.exp().sum()
    loss.backward()
    assert ctx.stats.offloaded == 1
