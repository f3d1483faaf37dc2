"""storm.graph's ops (storm/graph/ops.py) called as a compiled graph calls them: the graph may
overwrite a saved tensor once ``released`` has run and overwrite what ``load`` gave it, and
neither reaches the bytes another load gets."""

from __future__ import annotations

import pytest
import torch

import storm  # noqa: F401  (storm.graph registers the ops)
import storm.graph  # noqa: F401
from storm.errors import StormError

CPU = torch.device("cpu")
ops = torch.ops.storm


def saved(x: torch.Tensor, pool_size: int | None = None) -> torch.Tensor:
    token = ops.save(x, None, [], "embedded", None, pool_size, 1 << 29)
    return ops.released(token, x)


def load(token: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return ops.load(token, list(like.shape), list(like.stride()), like.dtype, like.device)


def test_the_graph_may_overwrite_a_saved_tensor_once_released():
    x = torch.randn(512, 64)
    expected = x.clone()
    token = saved(x)
    x.fill_(7.0)  # the graph reuses the buffer for another tensor
    assert torch.equal(load(token, expected), expected)


@pytest.mark.parametrize("pool_size", [None, 4096], ids=["stored", "no room in the store"])
def test_each_load_gets_its_own_bytes(pool_size):
    x = torch.randn(512, 64).t()  # a transposed view: its strides come back as they were
    expected = x.clone()
    token = saved(x, pool_size)
    first = load(token, x)
    assert first.stride() == x.stride()
    first.zero_()  # the graph reuses what it loaded, say for a gradient it returns
    assert torch.equal(load(token, x), expected)  # a second backward (retain_graph)


def test_the_graph_asking_for_another_shape_than_was_saved_is_an_error_naming_both():
    token = saved(torch.randn(512, 64))
    with pytest.raises(StormError, match=r"\(512, 64\) torch.float32.*expects \(64, 512\)"):
        ops.load(token, [64, 512], [512, 1], torch.float32, CPU)


def test_a_token_that_lost_what_it_carries_is_named():
    with pytest.raises(StormError, match="storm token lost what it carries"):
        ops.load(torch.empty(0, dtype=torch.uint8), [4], [1], torch.float32, CPU)


def test_views_of_one_tensor_are_stored_once_and_each_comes_back_as_it_was():
    qkv = torch.randn(256, 3, 64)
    q, k = qkv[:, 0], qkv[:, 1].t()  # views of one storage, as a projection's q and k are
    first = ops.save(q, None, [], "embedded", None, None, 1 << 29)
    second = ops.save(k, first, [], "embedded", None, None, 1 << 29)
    tokens = [ops.released(first, q), ops.released(second, k)]
    expected = [q.clone(), k.clone()]
    qkv.fill_(0.0)  # the graph reuses the memory
    assert all(torch.equal(load(t, view), e) for t, view, e in zip(tokens, (q, k), expected))
    assert storm.stats("embedded")["session"]["puts"] == 1


def test_a_view_saved_after_the_copy_of_its_storage_is_done_is_that_copy_until_let_go():
    """A compiled graph's memory is unchanged until it lets a save go: a second view of a stored
    storage is the stored copy even once that copy is done (it was put again, as if let go)."""
    from storm.registry import session_for
    qkv = torch.randn(256, 3, 64)
    q, k = qkv[:, 0], qkv[:, 1]
    first = ops.save(q, None, [], "embedded", None, None, 1 << 29)
    session_for("embedded", None, None).synchronize()  # q's copy done, its tensor let go of by the session
    second = ops.save(k, first, [], "embedded", None, None, 1 << 29)
    assert storm.stats("embedded")["session"]["puts"] == 1
    tokens = [ops.released(first, q), ops.released(second, k)]
    third = ops.save(qkv[:, 2], second, tokens, "embedded", None, None, 1 << 29)  # after the graph let go
    assert storm.stats("embedded")["session"]["puts"] == 2
    assert all(torch.equal(load(t, v), v) for t, v in zip(tokens, (q, k)))
    load(ops.released(third, qkv[:, 2]), qkv[:, 2])


def test_a_graphs_step_lets_its_copies_run_behind_by_the_partitioners_held_bytes():
    """storm.partitioner(held_bytes=...) places the releases; the session's copy queue, which makes
    forward wait for copies, is bound by the same figure (it kept the default's 512 MiB)."""
    x = torch.randn(64, 64)
    token = ops.save(x, None, [], "embedded", None, None, 4 << 30)
    assert token.storm_saved.step.options.max_held_bytes == 4 << 30
    load(ops.released(token, x), x)


@pytest.mark.parametrize("round", range(20))
def test_two_threads_save_release_and_load_through_one_session_started_together(round):
    """Two threads each run a compiled graph's saves (storm.partitioner in two threads, one context
    each): they share the process's session, so one thread's poll resolves the copies the other is
    letting go of. The interpreter switches threads as often as it can."""
    import sys
    import threading
    start, errors, graphs = threading.Barrier(2), [], 2

    def graph(seed: int) -> None:
        try:
            xs = [torch.randn(64, 32, generator=torch.Generator().manual_seed(seed * 1000 + i)) for i in range(60)]
            expected = [x.clone() for x in xs]
            start.wait()
            tokens = [saved(x) for x in xs]
            for x in xs:
                x.fill_(float("nan"))  # the graph reuses the buffers
            assert all(torch.equal(load(t, e), e) for t, e in zip(tokens, expected))
        except BaseException as e:  # noqa: BLE001 - the test fails below on any thread's error
            errors.append(e)

    threads = [threading.Thread(target=graph, args=(i,)) for i in range(graphs)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
