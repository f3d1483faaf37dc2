"""storm/restore.py: backward's unpacks, from the tensor still held or from the store; what they keep
of the fetched bytes, what prefetch fetches after them, the free at backward's end, and the error an
in-place change gets."""

from __future__ import annotations

import pytest
import torch

import storm
from helpers import puts_held_back


def test_a_view_unpacked_from_its_held_tensor_counts_so_no_fetched_bytes_wait_for_it():
    """A storage three ops saved: backward unpacks the first view while its copy still runs (from the
    held tensor), the copy lands, the other two views are fetched. Every view was unpacked, so the
    fetched bytes are not kept for another (with retain_graph they would stay as long as the graph)."""
    session = storm.registry.session_for("embedded", None, None)
    x, w1, w2 = (torch.randn(256, 256, requires_grad=True) for _ in range(3))
    with puts_held_back(session) as gate:
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            a = torch.relu(x * 1.0)  # relu saves a, and so do both products
            b, c = a * w1, a * w2
            loss = b.sum() + c.sum()

        def copies_land(g: torch.Tensor) -> torch.Tensor:  # after c's product unpacked a, before b's
            gate.set()
            session.synchronize()
            return g

        b.register_hook(copies_land)
        loss.backward(retain_graph=True)
    stored = next(s for s in ctx.saves if s.nbytes == a.untyped_storage().nbytes())
    assert (stored.unpacks, stored.handles) == (3, 3)
    assert ctx.stats.fetched >= 1  # the views after the first came from the store
    assert stored.key not in session.restorer._awaited


def test_prefetch_does_not_fetch_again_a_save_unpacked_from_its_held_tensor():
    """The last save is unpacked while its copy runs; the copies land and the caller lets prefetch
    fetch ahead (as storm.plan does at each block): the saves still to come are fetched, that one not."""
    session = storm.registry.session_for("embedded", None, None)
    fetched: list[int] = []
    prefetch = session.restorer.prefetch
    real = prefetch.fetch
    x = torch.randn(256, 256, requires_grad=True)
    with puts_held_back(session) as gate:
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            e1 = (x * 1.0).exp()
            e2 = e1.exp()
            loss = e2.exp().sum()  # its exp saves e3 (index 2): unpacked first, from its held tensor

        def copies_land(g: torch.Tensor) -> torch.Tensor:
            gate.set()
            session.synchronize()
            ctx.allow_prefetch(1 << 30)
            return g

        e2.register_hook(copies_land)
        prefetch.fetch = lambda s: (fetched.append(s.index), real(s))[1]
        try:
            loss.backward(retain_graph=True)
        finally:
            prefetch.fetch = real
    assert 2 not in fetched and set(fetched) <= {0, 1}, fetched
    assert not prefetch.copies and prefetch.nbytes == 0  # every fetch ahead was unpacked


def test_a_backward_that_raised_leaves_the_next_backward_of_its_step_freeing_at_its_end():
    """autograd runs no end-of-backward callback for a backward that raised: the backward that runs
    again on the retained graph queues its own, so that what it let go of leaves the store as it ends."""
    session = storm.registry.session_for("embedded", None, None)

    def keys() -> int:
        return session.mover.request("STATS").result(timeout=30)["session"]["keys"]

    def step(fail_first: bool) -> int:
        x = torch.randn(256, 256, requires_grad=True)
        with storm.offload(mode="embedded", min_bytes=0):
            e1 = (x * 1.0).exp()
            loss = e1.exp().exp().sum()
        session.synchronize()
        if fail_first:
            def fails(g: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("a hook failed")
            hook = e1.register_hook(fails)  # after the first unpacks
            with pytest.raises(RuntimeError, match="a hook failed"):
                loss.backward(retain_graph=True)
            hook.remove()
        loss.backward()
        del loss, e1
        return keys()

    assert step(False) == 0
    assert step(True) == 0


def test_an_in_place_change_of_a_save_the_store_refused_says_the_store_refused_it():
    """A save larger than the pool stays on its device (kept); changed in place after synchronize(),
    its unpack's error says so, not that STORM's copy was unfinished."""
    x = torch.randn(1024, 1024, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0, pool_size="1MiB") as ctx:
        y = (x * 2).exp()  # exp saves its 4 MiB output
        loss = y.sum()
    ctx.synchronize()
    assert ctx.stats.kept
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(storm.StormInPlaceError, match="the store refused it") as raised:
        loss.backward()
    assert "before STORM finished copying" not in str(raised.value)
