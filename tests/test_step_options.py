"""Each storm.offload context's options serve its own step (storm/saved.py StepOptions), in
forward and in backward, however contexts of one process interleave: the session is shared by
every context and thread, so an option written onto it served whichever step came next."""

from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch
from torch import nn

import storm

A = {"codec": "raw", "prefetch_bytes": 0, "verify": True}
B = {"codec": "auto", "prefetch_bytes": 1 << 30, "verify": False}


def in_turns(stages: list[tuple[int, Callable[[], None]]], threads: int) -> None:
    """Run the stages in their order; with two threads, stage (i, fn) runs on thread i, so the
    contexts of one step are entered and exited by one thread while the other thread's run between."""
    if threads == 1:
        for _, fn in stages:
            fn()
        return
    turn, cond, errors = [0], threading.Condition(), []

    def worker(me: int) -> None:
        for n, (who, fn) in enumerate(stages):
            if who != me:
                continue
            with cond:
                assert cond.wait_for(lambda: turn[0] == n or errors, timeout=120), "a stage never came"
            if errors:
                return
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below, and the other thread stops
                errors.append(e)
            with cond:
                turn[0] += 1
                cond.notify_all()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    if errors:
        raise errors[0]


def relu_model(seed: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU()), torch.randn(512, 64)


def flip_a_byte_of_each_stored_tensor(ctx: storm.Offload) -> int:
    backend = ctx._session.backend
    keys = [s.key for s in ctx.saves if s.in_store]
    for k in keys:
        r = backend.request("GET", key=k).result(5)
        backend.pool.view(r["offset"], r["nbytes"])[r["nbytes"] // 2] ^= 0x10
    return len(keys)


@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_codec_and_prefetch_window_are_the_steps_own(threads):
    """A's saves after B's context came are still encoded with A's codec, and A's backward fetches
    with A's window; B's with B's."""
    (ma, xa), (mb, xb) = relu_model(0), relu_model(1)
    a, b = storm.offload(mode="embedded", min_bytes=0, **A), storm.offload(mode="embedded", min_bytes=0, **B)
    out: dict[str, torch.Tensor] = {}

    def a_begins() -> None:
        a.__enter__()
        out["ha"] = ma[:2](xa)

    def b_runs() -> None:
        with b:
            out["lb"] = mb(xb).sum()

    def a_ends() -> None:
        out["la"] = ma[2:](out.pop("ha")).sum()
        a.__exit__(None, None, None)
        a.synchronize()
        out["la"].backward()

    in_turns([(0, a_begins), (1, b_runs), (0, a_ends)], threads)
    b.synchronize()
    out["lb"].backward()
    assert a.stats.offloaded >= 3 and b.stats.offloaded >= 3
    assert a.stats.stored_bytes == a.stats.offloaded_bytes  # raw: every save after B's context too
    assert b.stats.stored_bytes < b.stats.offloaded_bytes  # ReLU outputs compress
    assert a.stats.prefetch_hits == 0  # window 0: each fetch waits for its unpack
    assert b.stats.prefetch_hits > 0


@pytest.mark.parametrize("threads", [1, 2], ids=["one thread", "two threads"])
def test_a_step_that_verifies_verifies_its_fetches_after_a_step_that_does_not(threads):
    (ma, xa), (mb, xb) = relu_model(0), relu_model(1)
    a, b = storm.offload(mode="embedded", min_bytes=0, **A), storm.offload(mode="embedded", min_bytes=0, **B)
    out: dict[str, torch.Tensor] = {}

    def a_forward() -> None:
        with a:
            out["la"] = ma(xa).sum()
        a.synchronize()
        assert flip_a_byte_of_each_stored_tensor(a) >= 1

    def b_forward() -> None:
        with b:
            out["lb"] = mb(xb).sum()

    def a_backward() -> None:
        with pytest.raises(storm.StormIntegrityError, match="no longer match their checksum"):
            out["la"].backward()

    in_turns([(0, a_forward), (1, b_forward), (0, a_backward)], threads)
    out["lb"].backward()
