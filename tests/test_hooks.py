"""storm.offload on CPU tensors, through the embedded store and through a real stormd process:
gradients must be bit-identical to training without offload."""

from __future__ import annotations

import contextlib
import copy
import gc
import logging

import threading

import pytest
import torch
from torch import nn

import storm
import storm.session as session_mod
from storm.examples.models import GPT, ResNet, ViewNet, same_bits

from helpers import relu_mlp


@pytest.fixture(params=["embedded", "daemon"])
def opts(request, tmp_path):
    """Keyword arguments for storm.offload that select one backend; every tensor is offloaded."""
    if request.param == "embedded":
        yield {"mode": "embedded", "min_bytes": 0}
        return
    d = request.getfixturevalue("daemon")
    yield {"mode": "daemon", "socket": d.endpoint, "min_bytes": 0}


def grads(model: nn.Module, loss_fn, seed: int, offload_opts: dict | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if offload_opts is None:
        loss = loss_fn(model)
    else:
        with storm.offload(**offload_opts) as ctx:
            loss = loss_fn(model)
        assert ctx.stats.offloaded > 0, ctx.stats
    loss.backward()
    if offload_opts is not None:
        ctx.synchronize()  # copies still running would hold pool space into the caller's next step
    return [p.grad.clone() for p in model.parameters()]


def assert_same_grads(model: nn.Module, loss_fn, opts: dict) -> None:
    plain, offloaded = copy.deepcopy(model), copy.deepcopy(model)
    g0 = grads(plain, loss_fn, 1234, None)
    g1 = grads(offloaded, loss_fn, 1234, opts)
    assert len(g0) == len(g1) > 0
    for (name, _), a, b in zip(model.named_parameters(), g0, g1):
        assert same_bits(a, b), f"gradient of {name} differs with offload"


def test_gpt_with_dropout_bit_exact(opts):
    torch.manual_seed(0)
    model = GPT(seq_len=32, d_model=64, n_heads=4, n_layers=2, dropout=0.1)
    idx = torch.randint(0, 256, (4, 33))
    assert_same_grads(model, lambda m: m.loss(idx[:, :-1], idx[:, 1:]), opts)


def test_resnet_batchnorm_inplace_relu_bit_exact(opts):
    torch.manual_seed(0)
    model = ResNet()
    x = torch.randn(4, 3, 16, 16)
    assert_same_grads(model, lambda m: m(x).logsumexp(-1).sum(), opts)


def test_model_saving_views_bit_exact(opts):
    torch.manual_seed(0)
    model = ViewNet()
    x = torch.randn(16, 64)
    assert_same_grads(model, lambda m: m(x).square().sum(), opts)


class SaveView(torch.autograd.Function):
    """Saves whatever view it is given and checks in backward that it comes back exactly."""

    @staticmethod
    def forward(ctx, x, view, expect):
        ctx.save_for_backward(view)
        ctx.expect = expect
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (view,) = ctx.saved_tensors
        dtype, shape, strides, offset, raw = ctx.expect
        assert view.dtype == dtype and tuple(view.shape) == shape
        assert view.stride() == strides and view.storage_offset() == offset
        assert same_bits(view, raw)
        return g * 2, None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int64, torch.int8, torch.bool])
def test_views_come_back_with_exact_dtype_shape_strides_offset(opts, dtype):
    base = (torch.randn(40, 30) * 100).to(dtype)
    if dtype.is_floating_point:  # special values must survive as bits
        flat = base.view(-1)
        flat[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]).to(dtype)
    view = base[3:35:2, 5:25].t()  # non-contiguous, offset into the storage
    expect = (view.dtype, tuple(view.shape), view.stride(), view.storage_offset(), view.clone())
    x = torch.randn(8, requires_grad=True)
    with storm.offload(**opts) as ctx:
        y = SaveView.apply(x, view, expect)
    assert ctx.stats.offloaded == 1
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((8,), 2.0))


def test_same_storage_saved_twice_is_stored_once(opts):
    lin = nn.Linear(32, 32)
    inp = torch.randn(64, 32)
    with storm.offload(**opts) as ctx:
        h = lin(inp)
        loss = (h.sin() * h.cos()).sum()  # sin and cos both save h
    assert ctx.stats.deduplicated >= 1
    loss.backward()
    g = lin.weight.grad.clone()
    lin.zero_grad()
    h = lin(inp)
    (h.sin() * h.cos()).sum().backward()
    assert same_bits(g, lin.weight.grad)


def test_inplace_modification_before_copy_is_an_error(opts):
    x = torch.randn(256, 64, requires_grad=True)
    with storm.offload(**opts):
        y = x.exp()           # exp saves its output
        y.add_(1)             # modified before STORM checked its copy
    with pytest.raises(storm.StormInPlaceError, match="modified in place"):
        y.sum().backward()


def test_inplace_modification_of_a_kept_tensor_is_an_error():
    x = torch.randn(8, 8, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=1 << 20) as ctx:  # everything stays where it is
        y = x.exp()
        y.mul_(3)
    assert ctx.stats.offloaded == 0
    with pytest.raises(storm.StormInPlaceError, match=r"\(8, 8\) float32 tensor \(saved for ExpBackward0\)"):
        y.sum().backward()


@pytest.mark.parametrize("way", ["small", "past the budget", "refused", "offloaded"])
def test_a_graph_dropped_without_backward_takes_its_saves_with_it(way):
    """tanh saves its output: held with its grad_fn, whose node holds what pack returned, it formed
    a cycle through C++ that no garbage collector sees, and a step that never ran its backward
    (skipped, or an evaluation under grad) kept its saves for the life of the process."""
    from torch.multiprocessing.reductions import StorageWeakRef

    opts, reason = {"small": ({"min_bytes": 1 << 30}, storm.Keep.SMALL),
                    "past the budget": ({"min_bytes": 0, "budget": 1}, storm.Keep.BUDGET),
                    "refused": ({"min_bytes": 0, "pool_size": "16KiB"}, storm.Keep.POOL_FULL),
                    "offloaded": ({"min_bytes": 0}, None)}[way]
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    with storm.offload(mode="embedded", **opts) as ctx:
        h = torch.tanh(lin(x))
        y = torch.tanh(lin(h))
    saved = StorageWeakRef(h.untyped_storage())
    ctx.synchronize()
    assert (reason in ctx.stats.kept) if reason else ctx.stats.offloaded == 2, ctx.stats
    del h, y
    ctx.synchronize()
    gc.collect()
    assert saved.expired()


def test_inplace_modification_after_copy_uses_saved_value(opts):
    x = torch.randn(256, 64, requires_grad=True)
    with storm.offload(**opts) as ctx:
        y = x.exp()
        ctx.synchronize()     # STORM holds its own copy from here on
        y.add_(1)
    y.sum().backward()
    assert same_bits(x.grad, x.detach().exp())  # d/dx exp(x) from the value at save time


def test_retain_graph_unpacks_twice(opts):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(128, 32)
    ref = copy.deepcopy(model)
    out = ref(x).sum()
    out.backward(retain_graph=True)
    out.backward()
    with storm.offload(**opts):
        out = model(x).sum()
    out.backward(retain_graph=True)
    out.backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert same_bits(a.grad, b.grad)


class MaskedScale(torch.autograd.Function):
    """Saves a bool mask and int64 indices, as dropout and gather/embedding do."""

    @staticmethod
    def forward(ctx, x, mask, idx):
        ctx.save_for_backward(mask, idx)
        return (x * mask).index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        mask, idx = ctx.saved_tensors
        gx = torch.zeros(mask.shape, dtype=g.dtype).index_add_(0, idx, g)
        return gx * mask, None, None


def test_bool_and_integer_tensors(opts):
    x = torch.randn(500, 40, requires_grad=True)
    mask = torch.rand(500, 40) > 0.5
    idx = torch.randint(0, 500, (700,))
    with storm.offload(**opts) as ctx:
        y = MaskedScale.apply(x, mask, idx)
    assert ctx.stats.offloaded == 2
    y.sum().backward()
    expect = torch.zeros(500, 40).index_add_(0, idx, torch.ones(700, 40)) * mask
    assert same_bits(x.grad, expect)


def test_no_grad_region_inside(opts):
    lin = nn.Linear(16, 16)
    x = torch.randn(32, 16)
    with storm.offload(**opts) as ctx:
        with torch.no_grad():
            stats_before = lin(x).mean()  # nothing is saved here
        saved_before = ctx.stats.saved
        loss = (lin(x).relu() * stats_before).sum()
    assert saved_before == 0 and ctx.stats.saved > 0
    loss.backward()
    g = lin.weight.grad.clone()
    lin.zero_grad()
    (lin(x).relu() * stats_before).sum().backward()
    assert same_bits(g, lin.weight.grad)


def test_nested_hooks_innermost_wins(opts):
    lin = nn.Linear(64, 64)
    x = torch.randn(64, 64)
    with storm.offload(**opts) as outer:
        with torch.autograd.graph.save_on_cpu():
            loss = lin(x).tanh().sum()
    assert outer.stats.saved == 0  # save_on_cpu took them all
    loss.backward()
    with torch.autograd.graph.save_on_cpu():
        with storm.offload(**opts) as inner:
            loss2 = lin(x).tanh().sum()
    assert inner.stats.offloaded > 0
    g = lin.weight.grad.clone()
    lin.zero_grad()
    loss2.backward()
    assert same_bits(g, lin.weight.grad)


def test_decorator_forms():
    lin = nn.Linear(64, 64)
    x = torch.randn(128, 64)

    @storm.offload
    def bare():
        return lin(x).sigmoid().sum()

    @storm.offload(mode="embedded", min_bytes=0)
    def configured():
        return lin(x).sigmoid().sum()

    results = []
    for f in (bare, configured, lambda: lin(x).sigmoid().sum()):
        lin.zero_grad()
        f().backward()
        results.append(lin.weight.grad.clone())
    assert same_bits(results[0], results[2]) and same_bits(results[1], results[2])
    with pytest.raises(TypeError):
        storm.offload(42)


def test_parameters_and_module_state_stay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256))
    x = torch.randn(64, 256)
    with storm.offload(mode="embedded", min_bytes=0, modules=model) as ctx:
        model(x).sum().backward()
    assert ctx.stats.kept.get(storm.Keep.PARAMETER, 0) >= 1  # the linear layer saves its weight
    assert ctx.stats.kept.get(storm.Keep.MODULE_STATE, 0) >= 1  # BatchNorm saves its running stats
    assert ctx.stats.offloaded >= 1


def test_small_tensors_stay():
    x = torch.randn(4, 4, requires_grad=True)
    with storm.offload(mode="embedded") as ctx:  # default min_bytes is 64 KiB
        x.exp().sum().backward()
    assert ctx.stats.offloaded == 0 and ctx.stats.kept == {storm.Keep.SMALL: 1}


def test_embedded_pool_full_keeps_tensors_on_their_device_and_says_so_once(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    x = torch.randn(256, 128)
    with caplog.at_level(logging.WARNING, logger="storm"):
        assert_same_grads(model, lambda m: m(x).square().sum(), {"mode": "embedded", "min_bytes": 0,
                                                                  "pool_size": "300KiB"})
        with storm.offload(mode="embedded", min_bytes=0, pool_size="300KiB") as ctx:
            loss = model(x).square().sum()
        # the mover's replies decide what was kept: read before backward, which would take each save
        # from its tensor, so a copy the mover had not begun would be dropped, never refused
        ctx.synchronize()
        loss.backward()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1 and ctx.stats.offloaded >= 1
    said = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(said) == 1 and "no room" in said[0] and "pool_size" in said[0], said  # two steps, one line


def test_a_full_embedded_pool_names_no_daemon_setting(caplog):
    """The embedded store runs stormd's store code, whose POOL_FULL names stormd's spill
    settings; a storm.offload user cannot set those."""
    x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB saves: four fill the pool
    with caplog.at_level(logging.WARNING, logger="storm"):
        with storm.offload(mode="embedded", min_bytes=0, pool_size="1MiB") as ctx:
            y = x
            for _ in range(6):
                y = y.exp()
        ctx.synchronize()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1
    said = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(said) == 1 and "does not spill" in said[0] and "spill_dir" not in said[0], said


def test_saves_the_store_refused_go_without_the_garbage_collector():
    """A refusal's traceback runs through the frames that saved the tensor (the embedded store
    answers on the training thread) and through the put's, which hold its storage: kept where
    the traceback's frames could reach them, each step's refused saves stayed on the device
    until the garbage collector ran."""
    from torch.multiprocessing.reductions import StorageWeakRef

    lin = nn.Linear(256, 256)
    saved = []
    gc.disable()
    try:
        for _ in range(3):
            x = torch.randn(64, 256, requires_grad=True)
            with storm.offload(mode="embedded", min_bytes=0, pool_size="16KiB") as ctx:
                h = torch.relu(lin(x))  # relu and tanh save their outputs: what the store refuses
                saved.append(StorageWeakRef(h.untyped_storage()))
                y = torch.tanh(lin(h))
            del h
            ctx.synchronize()  # every refusal read (a copy not begun before backward would be dropped)
            assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1
            y.sum().backward()
            del y
        ctx.synchronize()  # the tensors are the session's to let go of now
        assert [r.expired() for r in saved] == [True, True, True]
    finally:
        gc.enable()


def test_daemon_pool_full_keeps_tensors(small_daemon):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(64, 64)
    opts = {"mode": "daemon", "socket": small_daemon.endpoint, "min_bytes": 0}
    assert_same_grads(model, lambda m: m(x).square().sum(), opts)
    with storm.offload(**opts) as ctx:
        loss = model(x).square().sum()
    ctx.synchronize()
    loss.backward()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1


def test_keys_are_freed_when_the_graph_goes(opts):
    lin = nn.Linear(128, 128)
    x = torch.randn(256, 128)
    for _ in range(3):
        with storm.offload(**opts) as ctx:
            loss = lin(x).relu().sum()
        ctx.synchronize()  # stored before backward: a copy not begun when backward takes its tensor is dropped
        assert ctx.stats.offloaded > 0
        loss.backward()
        del loss
    s = storm.stats(mode=opts["mode"], socket=opts.get("socket"))
    assert s["session"]["keys"] == 0 and s["session"]["held_bytes"] == 0
    assert s["session"]["puts"] >= 6


def test_mode_daemon_without_daemon_fails_clearly(env_without_socket):
    with pytest.raises(storm.StormUnavailable, match="no stormd socket"):
        with storm.offload(mode="daemon"):
            pass


def test_auto_falls_back_to_embedded_and_says_so_once(env_without_socket, caplog):
    lin = nn.Linear(64, 64)
    with caplog.at_level(logging.INFO, logger="storm"):
        for _ in range(3):
            with storm.offload(min_bytes=0) as ctx:
                lin(torch.randn(32, 64)).sum().backward()
    assert ctx.backend_name == "embedded store"
    lines = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(lines) == 1 and "embedded store" in lines[0], lines


def test_auto_uses_a_running_daemon(daemon, monkeypatch):
    monkeypatch.setenv("STORMD_SOCKET", daemon.endpoint)
    with storm.offload(min_bytes=0) as ctx:
        nn.Linear(8, 8)(torch.randn(4, 8)).sum().backward()
    assert ctx.backend_name.startswith("stormd at " + daemon.endpoint)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="mode"):
        with storm.offload(mode="fast"):
            pass
    for name in ("min_bytes", "prefetch_bytes", "max_held_bytes"):
        for bad in (-1, "lots", None, True):
            with pytest.raises(ValueError, match=f"{name} must be bytes.*got {bad!r}"):
                storm.offload(**{name: bad})
    sized = storm.offload(min_bytes="1KiB", prefetch_bytes="64MiB", max_held_bytes=1 << 20)
    assert [sized.options[k] for k in ("min_bytes", "prefetch_bytes", "max_held_bytes")] == [1024, 64 << 20, 1 << 20]
    with pytest.raises(ValueError, match="size"):
        with storm.offload(mode="embedded", pool_size="lots"):
            pass


def test_per_layer_counters_and_report():
    torch.manual_seed(0)
    model = GPT(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    idx = torch.randint(0, 256, (2, 17))
    with storm.offload(mode="embedded", min_bytes=0, modules=model) as ctx:
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    ctx.synchronize()
    loss.backward()
    st = ctx.stats
    assert "blocks.1.mlp.1" in st.layers and st.layers["blocks.1.mlp.1"].offloaded == 1  # the GELU input
    for name in ("saved", "offloaded", "offloaded_bytes", "stored_bytes", "fetched", "kept_bytes"):
        assert getattr(st, name) == sum(getattr(c, name) for c in st.layers.values()), name
    report = ctx.report()
    assert report.splitlines()[0].split()[:3] == ["layer", "saved", "offloaded"]
    assert report.splitlines()[-1].split()[:3] == ["total", str(st.saved), str(st.offloaded)]


def chain_of_saves(n: int = 6):
    """n tanh layers of 64 KiB outputs each: every output is saved by the next op."""
    x = torch.randn(128, 128, requires_grad=True)
    h = x
    for _ in range(n):
        h = h.tanh()
    return x, h.sum()


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
    """Past the budget one save in about MARK_BYTES is a marker; as backward unpacks each, the
    offloaded saves (needed last) may come back by the bytes saved since the marker before,
    and not more: the prefetch window opens only at the first offloaded save unpacked."""
    one = 128 * 128 * 4
    monkeypatch.setattr(session_mod, "MARK_BYTES", 2 * one)
    paced = []  # markers that measured the room backward made
    from storm.prefetch import Prefetcher

    room_made = Prefetcher.room_made
    monkeypatch.setattr(Prefetcher, "room_made",
                        lambda self, step, marker: (paced.append(marker), room_made(self, step, marker))[1])
    x = torch.randn(128, 128, requires_grad=True)
    seen: dict[int, int] = {}
    with storm.offload(mode="embedded", min_bytes=0, budget=4 * one) as ctx:
        h = [x]
        for _ in range(12):  # save k is layer k's output; saves 1-4 are offloaded
            h.append(h[-1].tanh())
        for k in (11, 10, 8):  # its gradient is ready once layer k + 1's backward has unpacked save k + 1
            h[k].register_hook(lambda g, k=k: seen.__setitem__(k, ctx._session.prefetch.nbytes))
        loss = h[-1].sum()
    # save 5 is the first over the budget (a marker); then markers at saves 7, 9 and 11
    ctx.synchronize()  # prefetch waits at a save whose copy is still running
    loss.backward()
    assert seen == {11: 0, 10: 2 * one, 8: 4 * one}
    assert ctx.stats.prefetch_hits == 4
    assert len(paced) == 2  # the markers at saves 7 and 5 come once all four are fetched: nothing to pace
    assert same_bits(x.grad, chain_grad(x, 12))


def chain_grad(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    x2 = x.detach().requires_grad_()
    h = x2
    for _ in range(n):
        h = h.tanh()
    h.sum().backward()
    return x2.grad


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
                    limits.append(ctx._session._held_limit(ctx._step))
            loss = h.sum()
        assert ctx._session._held_bytes <= one
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


def test_bad_budgets_are_refused():
    for bad in (0.0, 1.5, -3, "much", True):
        with pytest.raises(ValueError):
            storm.offload(budget=bad)


def test_store_holds_nothing_once_backward_ends():
    """The last handles die as backward finishes; their keys are freed then, not at the next step."""
    with storm.offload(mode="embedded", min_bytes=0, max_held_bytes=0) as ctx:  # every copy done in forward
        x, loss = chain_of_saves()
    loss.backward()
    store = ctx._session.backend.service.store
    assert ctx.stats.offloaded == 6 and store.node_stats()["keys"] == 0


def test_a_key_is_freed_only_once_the_copy_out_of_it_is_done(monkeypatch):
    """Unpack returns as soon as a CUDA copy out of the pool is queued; until the GPU has run it,
    the extent must stay allocated, or the next PUT (of any process) could overwrite it first.
    Reads that report themselves unfinished stand in for such copies here."""
    from storm.copies.base import Copy
    from storm.replies import Resolved
    from storm.transfer import Mover

    copies_done = threading.Event()

    class Running:
        def done(self) -> bool:
            return copies_done.is_set()

        def wait(self) -> None:
            copies_done.wait()

    class UnfinishedRead(Copy):
        __slots__ = ()

        @property
        def event(self) -> Running:
            return Running()

    real_get = Mover.get
    monkeypatch.setattr(Mover, "get", lambda self, *a, **k: UnfinishedRead(Resolved(real_get(self, *a, **k))))
    with storm.offload(mode="embedded", min_bytes=0, max_held_bytes=0) as ctx:
        x, loss = chain_of_saves()
    loss.backward()
    assert same_bits(x.grad, chain_grad(x))
    store = ctx._session.backend.service.store
    assert ctx.stats.fetched == 6 and store.node_stats()["keys"] == 6
    copies_done.set()
    ctx._session.poll()
    assert store.node_stats()["keys"] == 0


def test_a_saved_tensor_can_be_read_outside_backward():
    """grad_fn._saved_* unpacks with no backward running (no end-of-backward callback to queue)."""
    x = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        y = x.exp()
    ctx.synchronize()
    assert ctx.stats.offloaded == 1
    assert same_bits(y.grad_fn._saved_result, x.detach().exp())
    y.sum().backward()
    assert same_bits(x.grad, x.detach().exp())


def test_codec_auto_stores_fewer_bytes_and_gradients_stay_bit_exact():
    m, x = relu_mlp()
    ref = copy.deepcopy(m)
    ref(x).sum().backward()
    with storm.offload(mode="embedded", min_bytes=0, codec="auto") as ctx:
        loss = m(x).sum()
    ctx.synchronize()
    loss.backward()
    assert all(same_bits(a.grad, b.grad) for a, b in zip(m.parameters(), ref.parameters()))
    st = ctx.stats
    assert st.fetched == st.offloaded > 0 and st.stored_bytes < 0.8 * st.offloaded_bytes  # ReLU outputs: zeros
    session = ctx._session.backend.service.store.session_stats(ctx._session.backend.session)
    assert session["raw_bytes_in"] > session["bytes_in"]


@pytest.mark.parametrize("verify", [True, False])  # caught by the pool checksum, or by the encoding's own
def test_a_corrupted_encoding_is_an_integrity_error_not_a_tensor(verify):
    m, x = relu_mlp()
    with storm.offload(mode="embedded", min_bytes=0, codec="zero", verify=verify) as ctx:
        loss = m(x).sum()
    ctx.synchronize()
    pool, store = ctx._session.backend.pool, ctx._session.backend.service.store
    entries = store._of(ctx._session.backend.session).entries.values()
    e = next(e for e in entries if e.codec == "zero")
    pool.view(e.offset + e.nbytes - 1, 1).bitwise_not_()  # the last payload byte
    with pytest.raises(storm.StormIntegrityError):
        loss.backward()


def test_an_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="codec"):
        storm.offload(codec="gzip")


def test_a_put_whose_frame_overflowed_is_stored_again_raw(monkeypatch):
    """The session's side of frames (CUDA tensors only; simulated here): a put that lands incomplete
    is put again, raw, under a new key while its tensor is still held; the old key is freed, and
    tensors of its kind are stored raw from then on."""
    from storm.copies.base import Copy
    from storm.replies import Resolved
    from storm.transfer import Mover

    class Overflowed(Copy):
        __slots__ = ()

        def incomplete(self) -> bool:
            return True

    requests = []
    real_put = Mover.put

    def put(self, req):
        requests.append(req)
        copy = real_put(self, req)
        return Overflowed(Resolved(copy)) if req.encode else copy

    monkeypatch.setattr(Mover, "put", put)
    x = torch.randn(256, 256, requires_grad=True)
    for step in (1, 2):
        x.grad = None
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            y = x.exp()  # exp saves its result
        ctx.synchronize()  # landed (and stored again, raw) before backward, which would drop a put not begun
        y.sum().backward()
        assert same_bits(x.grad, x.detach().exp())
        store = ctx._session.backend.service.store
        assert store.node_stats()["keys"] == 0
        assert ctx.stats.frame_overflows == (1 if step == 1 else 0)
        assert ctx.stats.stored_bytes == ctx.stats.offloaded_bytes == 256 * 256 * 4
    assert [r.encode for r in requests] == [True, False, False]
    assert requests[0].key != requests[1].key


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


BAD_OPTIONS = [
    ({"pool_size": -1}, "pool_size must be bytes: at least 4KiB: an int or a size such as '512MiB'; got -1"),
    ({"pool_size": "-1"}, "pool_size must be bytes: at least 4KiB.*got '-1'"),
    ({"pool_size": "abc"}, "pool_size must be bytes: at least 4KiB.*got 'abc'"),
    ({"pool_size": 0}, "pool_size must be bytes: at least 4KiB.*got 0"),
    ({"pool_size": "0"}, "pool_size must be bytes: at least 4KiB.*got '0'"),
    ({"pool_size": 1.5}, "pool_size must be bytes.*got 1.5"),
    ({"min_bytes": 1.5}, "min_bytes must be bytes: an int >= 0 or a size such as '256MiB'; got 1.5"),
    ({"min_bytes": "1.5"}, "min_bytes must be bytes.*got '1.5'.*not a whole number of bytes"),
    ({"prefetch_bytes": "-1"}, "prefetch_bytes must be bytes.*got '-1'"),
    ({"max_held_bytes": 2.5}, "max_held_bytes must be bytes.*got 2.5"),
    ({"budget": "abc"}, r"budget must be bytes \(an int >= 0 or a size such as '8GiB'\) or a fraction in \(0, 1\], "
                        r"got 'abc'"),
    ({"budget": -1}, "budget must be bytes.*got -1"),
    ({"budget": 1.5}, "budget must be bytes.*fraction in .0, 1.*got 1.5"),
    ({"mode": "deamon"}, "mode must be one of 'auto', 'daemon', 'embedded'; got 'deamon'"),
    ({"codec": "lz4"}, "codec must be None .*got 'lz4'"),
    ({"socket": "http://host/x"}, "socket 'http://host/x': use a path, ipc://PATH or tcp://127.0.0.1:PORT"),
    ({"verify": "no"}, "verify must be True or False; got 'no'"),
]


@pytest.mark.parametrize("options,message", BAD_OPTIONS, ids=[repr(o) for o, _ in BAD_OPTIONS])
def test_each_bad_option_is_refused_where_it_is_given_naming_it(options, message):
    """Issue 38, item 12: refused by the constructor (not at ``with``), naming the option and what
    it accepts. On main pool_size=0 became 2 GiB, min_bytes=1.5 became 1, '-1' and 'abc' gave
    "cannot read size" without the option's name, a misspelt mode passed until ``with``."""
    with pytest.raises(ValueError, match=message):
        storm.offload(**options)
    with pytest.raises(ValueError, match=message):  # storm.plan passes the options on, checked as early
        storm.plan([nn.Linear(2, 2)], **{"budget": 1.0, **options})


@pytest.mark.parametrize("variable,value,message", [
    ("STORM_POOL_SIZE", "abc", "STORM_POOL_SIZE must be bytes: at least 4KiB.*got 'abc'"),
    ("STORM_POOL_SIZE", "0", "STORM_POOL_SIZE must be bytes: at least 4KiB.*got '0'"),
    ("STORMD_SOCKET", "udp://127.0.0.1:1", "STORMD_SOCKET: socket 'udp://127.0.0.1:1': use a path"),
])
def test_a_bad_environment_variable_is_named(variable, value, message, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        storm.offload()


def test_sizes_given_are_read_as_whole_bytes(monkeypatch):
    monkeypatch.setenv("STORM_POOL_SIZE", "8MB")
    o = storm.offload(min_bytes="1.5KiB", prefetch_bytes=0, max_held_bytes="1GB", mode="embedded")
    assert [o.options[k] for k in ("min_bytes", "prefetch_bytes", "max_held_bytes", "pool_size")] == \
        [1536, 0, 10**9, 8 * 10**6]
    with o:
        pass
    assert o._session.backend.pool.size == 8 * 10**6
