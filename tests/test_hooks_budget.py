"""storm.offload(budget=...) and the hooks' pacing: which saves a byte or fraction budget
offloads, stop_offloading and offload_at_most, and prefetch paced by the saves kept."""

from __future__ import annotations

import contextlib

import pytest
import torch

import storm
import storm.session as session_mod
from helpers import chain_grad, chain_of_saves
from storm.examples.models import same_bits


def test_byte_budget_offloads_the_earliest_saves_only():
    with storm.offload(mode="embedded", min_bytes=0, budget=3 * 128 * 128 * 4) as ctx:
        x, loss = chain_of_saves()
    ctx.synchronize()
    # The fourth save is over the budget: it and the last two stay on the device, and
    # saves past the first one over the budget are not counted.
    assert ctx.stats.offloaded == 3 and ctx.stats.kept == {storm.Keep.BUDGET: 1} and ctx.stats.saved == 4
    assert ctx.stats.offloaded_bytes == 3 * 128 * 128 * 4
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    loss.backward()
    assert same_bits(x.grad, chain_grad(x))
    # Backward reaching the kept save started the fetches of the offloaded ones before it.
    assert ctx.stats.prefetch_hits == 3


@pytest.mark.parametrize("outer", [False, True])
def test_saves_past_the_budget_stay_with_storm(outer):
    """Past the budget STORM's hooks stay on: the saves stay on the device with STORM, also
    nested in save_on_cpu (which would otherwise take them to the host)."""
    with torch.autograd.graph.save_on_cpu() if outer else contextlib.nullcontext():
        with storm.offload(mode="embedded", min_bytes=0, budget=3 * 128 * 128 * 4) as ctx:
            x, loss = chain_of_saves()
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            assert top is not None and top[0].__qualname__.startswith("Offload.")
    ctx.synchronize()
    assert ctx.stats.offloaded == 3 and ctx.stats.kept == {storm.Keep.BUDGET: 1}
    loss.backward()
    assert same_bits(x.grad, chain_grad(x))


def test_stop_offloading_takes_the_hooks_off_for_the_rest_of_forward(monkeypatch):
    """After stop_offloading the later saves pass through no STORM hook (autograd keeps them and
    checks them for in-place changes itself); what was offloaded before comes back bit-exact."""
    x = torch.randn(128, 128, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = x
        for _ in range(3):
            h = h.tanh()
        assert ctx.stop_offloading() and not ctx.stop_offloading()  # once: the hooks are off
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        monkeypatch.setattr(session_mod.ClientSession, "save", lambda *a: pytest.fail("a save reached STORM"))
        monkeypatch.setattr(session_mod.ClientSession, "save_past_budget",
                            lambda *a: pytest.fail("a save reached STORM"))
        for _ in range(3):
            h = h.tanh()
        later = h.exp()
    monkeypatch.undo()
    assert ctx.stats.offloaded == 3 and ctx.stats.saved == 3 and not ctx.stats.kept
    ctx.synchronize()
    later.sum().backward()
    expected = x.detach().clone().requires_grad_()
    h = expected
    for _ in range(6):
        h = h.tanh()
    h.exp().sum().backward()
    assert same_bits(x.grad, expected.grad)
    assert ctx.stats.fetched == 3
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        ctx.stop_offloading()
        y = torch.randn(8, requires_grad=True).exp()
        y.add_(1)  # exp saved its output: autograd's own version check sees this
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_offload_at_most_offloads_that_many_more_bytes_then_keeps_the_rest():
    """From offload_at_most(n) on, saves are offloaded while they fit in n more bytes; the first
    that does not and every later one stay, as past a budget; gradients are bit-exact."""
    x = torch.randn(128, 128, requires_grad=True)
    size = 128 * 128 * 4
    with pytest.raises(RuntimeError, match="not been entered"):
        storm.offload(mode="embedded").offload_at_most(0)
    for bad in (-1, 1.5, "lots", None):
        with pytest.raises(ValueError, match="nbytes must be bytes: an int >= 0 or a size such as '256MiB'"):
            storm.offload(mode="embedded").offload_at_most(bad)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = x
        for _ in range(2):
            h = h.tanh()
        ctx.offload_at_most(2 * size + size // 2)
        for _ in range(4):
            h = h.tanh()
    assert ctx.stats.offloaded == 4 and ctx.stats.kept == {storm.Keep.BUDGET: 1}  # the first past it counted
    ctx.synchronize()
    h.sum().backward()
    assert same_bits(x.grad, chain_grad(x))


def test_stop_offloading_changes_nothing_under_other_hooks():
    """Inside another saved_tensors_hooks (a checkpointed block, save_on_cpu) the innermost hooks
    are not STORM's: stop_offloading leaves them, and STORM's, in place."""
    outer = torch.autograd.graph.save_on_cpu()
    with outer:
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            ours = torch._C._autograd._top_saved_tensors_default_hooks(False)
            with torch.autograd.graph.save_on_cpu():
                inner = torch._C._autograd._top_saved_tensors_default_hooks(False)
                assert not ctx.stop_offloading()
                assert torch._C._autograd._top_saved_tensors_default_hooks(False) == inner
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) == ours
            assert ctx.stop_offloading()
        # ours came off once: leaving the context takes nothing more off the stack
        assert torch._C._autograd._top_saved_tensors_default_hooks(False)[0] is outer.pack_hook
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not storm.offload(mode="embedded").stop_offloading()  # not entered


def test_markers_past_the_budget_pace_prefetch(monkeypatch):
    """Past the budget one save in about MARKER_SPACING is a marker; as backward unpacks each, the
    offloaded saves (needed last) may come back by the bytes saved since the marker before,
    and not more: the prefetch window opens only at the first offloaded save unpacked."""
    one = 128 * 128 * 4
    monkeypatch.setattr(session_mod, "MARKER_SPACING", 2 * one)
    paced = []  # markers that measured the room backward made
    from storm.prefetch import Prefetcher

    allowance_at = Prefetcher.allowance_at
    monkeypatch.setattr(Prefetcher, "allowance_at",
                        lambda self, step, marker: (paced.append(marker), allowance_at(self, step, marker))[1])
    x = torch.randn(128, 128, requires_grad=True)
    seen: dict[int, int] = {}
    with storm.offload(mode="embedded", min_bytes=0, budget=4 * one) as ctx:
        h = [x]
        for _ in range(12):  # save k is layer k's output; saves 1-4 are offloaded
            h.append(h[-1].tanh())
        for k in (11, 10, 8):  # its gradient is ready once layer k + 1's backward has unpacked save k + 1
            h[k].register_hook(lambda g, k=k: seen.__setitem__(k, ctx._session.restorer.prefetch.nbytes))
        loss = h[-1].sum()
    # save 5 is the first over the budget (a marker); then markers at saves 7, 9 and 11
    ctx.synchronize()  # prefetch waits at a save whose copy is still running
    loss.backward()
    assert seen == {11: 0, 10: 2 * one, 8: 4 * one}
    assert ctx.stats.prefetch_hits == 4
    assert len(paced) == 2  # the markers at saves 7 and 5 come once all four are fetched: nothing to pace
    assert same_bits(x.grad, chain_grad(x, 12))


def test_a_paced_context_s_markers_fetch_nothing_ahead(monkeypatch):
    """storm.plan's steps pace prefetch from their start (PlanStep.paced): past their budget the
    markers measure nothing, and until the plan's hooks allow it only the unpacks fetch (the
    saves of test_markers_past_the_budget_pace_prefetch, whose markers fetched four ahead)."""
    from storm.planner.trace import PlanStep

    one = 128 * 128 * 4
    monkeypatch.setattr(session_mod, "MARKER_SPACING", 2 * one)
    x = torch.randn(128, 128, requires_grad=True)
    with PlanStep(mode="embedded", min_bytes=0, budget=4 * one, prefetch_bytes=0) as ctx:
        h = [x]
        for _ in range(12):
            h.append(h[-1].tanh())
        loss = h[-1].sum()
    ctx.synchronize()
    loss.backward()
    assert ctx.stats.fetched == ctx.stats.offloaded == 4
    assert ctx.stats.prefetch_hits == 0
    assert same_bits(x.grad, chain_grad(x, 12))


def test_copies_may_run_behind_by_what_the_last_step_saved_past_its_budget():
    """Forward's peak is at its end: until the saves past the budget that the last step made
    have come, copies may wait beyond max_held_bytes without raising it. Forward's end waits
    until at most max_held_bytes do."""
    one = 128 * 128 * 4
    limits = []
    for _ in range(2):
        with storm.offload(mode="embedded", min_bytes=0, budget=2 * one, max_held_bytes=one) as ctx:
            x = torch.randn(128, 128, requires_grad=True)
            h = x
            for i in range(6):
                h = h.tanh()
                if i == 1:  # both offloaded saves are in; none past the budget yet
                    limits.append(ctx._session.copy_queue.limit(ctx._step))
            loss = h.sum()
        assert ctx._session.copy_queue.nbytes <= one
        assert ctx._step.past_budget_bytes == 3 * one  # saves 4-6; save 3 was the first over the budget
        loss.backward()
        assert same_bits(x.grad, chain_grad(x))
    assert limits == [one, one + 3 * one]


def test_fraction_budget_follows_the_previous_step():
    offloaded = []
    for _ in range(3):
        with storm.offload(mode="embedded", min_bytes=0, budget=0.5) as ctx:
            x, loss = chain_of_saves()
        loss.backward()
        assert same_bits(x.grad, chain_grad(x))
        offloaded.append(ctx.stats.offloaded)
    assert offloaded == [6, 3, 3]  # the first step has no previous one to take half of


def test_a_zero_budget_installs_no_hooks_and_keeps_fractions_of_the_last_full_step(monkeypatch):
    """budget=0: nothing may be offloaded, so no save goes through STORM at all (storm.plan's
    recompute-only plans then cost nothing per save), and a later fraction budget still
    measures against the last step that offloaded all."""
    x = torch.randn(64, 256, requires_grad=True)
    one = x.numel() * x.element_size()

    def forward() -> torch.Tensor:
        h = x
        for _ in range(6):
            h = torch.tanh(h * 1.5)  # six fresh tensors of `one` bytes
        return h.sum()

    with storm.offload(mode="embedded", min_bytes=0) as full:
        forward().backward()
    assert full.stats.offloaded == 6
    save = session_mod.ClientSession.save
    monkeypatch.setattr(session_mod.ClientSession, "save", lambda *a: pytest.fail("a save reached STORM"))
    with storm.offload(mode="embedded", min_bytes=0, budget=0) as none:
        loss = forward()
    loss.backward()
    assert none.stats.saved == 0 and none.stats.offloaded == 0
    monkeypatch.setattr(session_mod.ClientSession, "save", save)
    with storm.offload(mode="embedded", min_bytes=0, budget=0.5) as half:
        forward().backward()
    assert half.stats.offloaded_bytes == 3 * one


def test_keep_leaves_those_storages_on_the_device_and_offloads_the_rest():
    """keep(tensors): saves of those storages, views included, stay (Keep.SHARED) for the rest of
    the step, and the step's other saves go as before; the next step keeps nothing; gradients are
    bit-exact. Anything but tensors is refused."""
    x = torch.randn(128, 128, requires_grad=True)
    with pytest.raises(RuntimeError, match="not been entered"):
        storm.offload(mode="embedded").keep([x])
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        with pytest.raises(TypeError, match="keep\\(\\) takes tensors; got int"):
            ctx.keep([1])
        shared = x * 2           # saves nothing itself
        ctx.keep([shared[:64]])  # a view: its storage is kept
        h = shared * shared      # saves shared twice: both kept
        for _ in range(2):
            h = h.tanh()         # two saves offloaded
    assert ctx.stats.offloaded == 2 and ctx.stats.kept == {storm.Keep.SHARED: 2}
    assert shared.untyped_storage()._cdata not in {s.weak.cdata for s in ctx.saves}
    ctx.synchronize()
    h.sum().backward()
    ref = x.detach().requires_grad_()
    s = ref * 2
    (s * s).tanh().tanh().sum().backward()
    assert same_bits(x.grad, ref.grad)
    with storm.offload(mode="embedded", min_bytes=0) as again:
        (shared.detach() * 2).requires_grad_().tanh()
    assert again.stats.offloaded == 1 and storm.Keep.SHARED not in again.stats.kept


def test_a_storage_made_where_a_kept_one_was_freed_is_offloaded():
    """keep() holds its storages by a weak reference: one freed, a new storage the allocator makes at
    its address is no kept one (before: its saves stayed on the device as a shared input)."""
    x = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = x
        for _ in range(8):
            mask = torch.randn(256, 256)
            ctx.keep([mask])  # a block's own mask, then freed
            del mask
            h = torch.tanh(h)  # a fresh storage, saved by tanh
    assert ctx.stats.offloaded == 8 and storm.Keep.SHARED not in ctx.stats.kept
    ctx.synchronize()
    h.sum().backward()


def chain_of(n: int, width: int) -> torch.Tensor:
    """A forward of ``n`` saves of 64 x ``width`` floats each."""
    h = torch.randn(64, width, requires_grad=True)
    for _ in range(n):
        h = torch.tanh(h * 1.5)
    return h.sum()


def test_two_models_trained_in_turn_each_go_by_their_own_steps_for_a_fraction_budget():
    """A fraction budget is of the last step of the same kind (by its first save): with two models
    in turn, each offloads half of its own saves (before: of the other model's, so the large one
    offloaded nothing after the small one's step)."""
    got: dict[str, list[int]] = {"large": [], "small": []}
    for _ in range(3):
        for name, n, width in (("large", 8, 1024), ("small", 2, 256)):
            with storm.offload(mode="embedded", min_bytes=0, budget=0.5) as ctx:
                loss = chain_of(n, width)
            loss.backward()
            got[name].append(ctx.stats.offloaded_bytes)
    one_large, one_small = 64 * 1024 * 4, 64 * 256 * 4
    assert got == {"large": [8 * one_large] + [4 * one_large] * 2, "small": [2 * one_small] + [one_small] * 2}


def test_the_copy_queue_past_a_budget_goes_by_the_last_step_of_the_same_kind():
    """A step's copies may run behind by what the last step saved past its budget: that of its own
    kind, not another model's (before: a model that saved nothing past its budget had the other's
    bytes as room, its copy queue holding many times max_held_bytes)."""
    session = storm.registry.session_for("embedded", None, None)
    one = 128 * 128 * 4

    def limit_of(n: int, width: int, budget: int) -> int:
        with storm.offload(mode="embedded", min_bytes=0, budget=budget, max_held_bytes=one) as ctx:
            h = torch.randn(128, width, requires_grad=True)
            for i in range(n):
                h = h.tanh()
                if i == 0:
                    limit = session.copy_queue.limit(ctx._step)
            loss = h.sum()
        loss.backward()
        return limit

    limit_of(18, 128, 2 * one)  # saves 16 past its budget
    assert limit_of(2, 64, 4 * one) == one  # another kind, nothing past its budget
    assert limit_of(18, 128, 2 * one) > one  # the first kind again: its own past-budget bytes
