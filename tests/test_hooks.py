"""storm.offload on CPU tensors, through the embedded store and through a real stormd process:
gradients must be bit-identical to training without offload; views, in-place changes, dropped
graphs, retain_graph, codecs, and when each key is freed."""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import storm
from helpers import assert_same_grads, chain_grad, chain_of_saves, relu_mlp
from storm.examples.models import GPT, ResNet, ViewNet, same_bits


@pytest.fixture(params=["embedded", "daemon"])
def opts(request, tmp_path):
    """Keyword arguments for storm.offload that select one backend; every tensor is offloaded."""
    if request.param == "embedded":
        yield {"mode": "embedded", "min_bytes": 0}
        return
    d = request.getfixturevalue("daemon")
    yield {"mode": "daemon", "socket": d.endpoint, "min_bytes": 0}


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
                    "past the budget": ({"min_bytes": 0, "budget": 2}, storm.Keep.BUDGET),
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


@pytest.mark.parametrize("call,bad", [("allow_prefetch", "lots"), ("allow_prefetch", -5), ("allow_prefetch", None),
                                      ("drain", -1), ("drain", None), ("drain", "lots")])
def test_a_bad_size_given_to_a_method_is_refused_and_the_step_goes_on(call, bad):
    """allow_prefetch and drain take bytes as offload_at_most does: a bad value is refused before
    anything changes, so the step's backward still runs and is bit-exact (allow_prefetch('1GiB')
    raised a raw TypeError and left the room on the step, so backward raised it again; -5 and -1
    were taken)."""
    x = torch.randn(128, 128, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = x.tanh().tanh()
        with pytest.raises(ValueError, match=f"{call}'s (nbytes|limit) must be bytes: an int >= 0 or a size"):
            getattr(ctx, call)(bad)
        loss = h.tanh().sum()
    loss.backward()
    assert same_bits(x.grad, chain_grad(x, 3))
    with storm.offload(mode="embedded", min_bytes=0) as ctx:  # a size string is bytes, as elsewhere
        ctx.drain("1GiB")
        ctx.allow_prefetch("1GiB")


def test_a_context_is_exited_in_the_thread_that_entered_it():
    """torch keeps saved-tensor hooks per thread: exiting a context entered in another thread
    (or one never entered) is refused with a clear error before torch's hook stack is touched,
    where torch raised an INTERNAL ASSERT; the entering thread exits it as usual."""
    ctx = storm.offload(mode="embedded", min_bytes=0)
    with pytest.raises(RuntimeError, match="was not entered"):
        ctx.__exit__(None, None, None)
    with ThreadPoolExecutor(1) as worker:  # one thread for both calls
        worker.submit(ctx.__enter__).result()
        with pytest.raises(RuntimeError, match="entered in another thread: a context covers the thread that "
                                               "entered it"):
            ctx.__exit__(None, None, None)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing popped here
        worker.submit(ctx.__exit__, None, None, None).result()
    with pytest.raises(RuntimeError, match="was not entered"):  # a second exit
        with storm.offload(mode="embedded") as c:
            pass
        c.__exit__(None, None, None)


def test_small_tensors_stay():
    x = torch.randn(4, 4, requires_grad=True)
    with storm.offload(mode="embedded") as ctx:  # default min_bytes is 64 KiB
        x.exp().sum().backward()
    assert ctx.stats.offloaded == 0 and ctx.stats.kept == {storm.Keep.SMALL: 1}


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
    from storm.mover import Mover
    from storm.replies import Resolved

    copies_done = threading.Event()

    class Running:  # a CUDA event of a copy the GPU has not run yet
        def query(self) -> bool:
            return copies_done.is_set()

        def synchronize(self) -> None:
            copies_done.wait()

        done, wait = query, synchronize

    real_get = Mover.get

    def unfinished(self, *a, **k):
        return Copy(Resolved(dataclasses.replace(real_get(self, *a, **k).result(), event=Running())))

    monkeypatch.setattr(Mover, "get", unfinished)
    with storm.offload(mode="embedded", min_bytes=0, max_held_bytes=0) as ctx:
        x, loss = chain_of_saves()
    loss.backward()
    assert same_bits(x.grad, chain_grad(x))
    store = ctx._session.backend.service.store
    assert ctx.stats.fetched == 6 and store.node_stats()["keys"] == 6
    copies_done.set()
    ctx.synchronize()  # polls, and sends the FREE the keys gathered for (mover.FREE_BATCH)
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


def test_a_put_whose_frame_overflowed_is_stored_again_raw(monkeypatch):
    """The session's side of frames (CUDA tensors only; simulated here): a put that lands incomplete
    is put again, raw, under a new key while its tensor is still held; the old key is freed, and
    tensors of its kind do not take that codec again (here the CPU's auto: raw from then on)."""
    from storm.copies.base import Copy, Landed
    from storm.mover import Mover
    from storm.replies import Resolved

    class Overflowed(Landed):
        def incomplete(self) -> bool:
            return True

    requests = []
    real_put = Mover.put

    def put(self, req):
        requests.append(req)
        put = real_put(self, req)
        if req.codec == "raw":
            return put
        landed = put.result()
        return Copy(Resolved(Overflowed(**{f.name: getattr(landed, f.name) for f in dataclasses.fields(landed)})))

    monkeypatch.setattr(Mover, "put", put)
    x = torch.randn(256, 256, requires_grad=True)
    for step in (1, 2):
        x.grad = None
        with storm.offload(mode="embedded", min_bytes=0, codec="auto") as ctx:
            y = x.exp()  # exp saves its result
        ctx.synchronize()  # landed (and stored again, raw) before backward, which would drop a put not begun
        y.sum().backward()
        assert same_bits(x.grad, x.detach().exp())
        store = ctx._session.backend.service.store
        assert store.node_stats()["keys"] == 0
        assert ctx.stats.frame_overflows == (1 if step == 1 else 0)
        assert ctx.stats.stored_bytes == ctx.stats.offloaded_bytes == 256 * 256 * 4
    assert [r.codec for r in requests] == ["auto", "raw", "raw"]
    assert requests[0].key != requests[1].key


def test_a_context_used_as_a_decorator_reports_its_latest_calls_step():
    """Each decorated call is its own step (contextlib's _recreate_cm); the decorating context's
    stats are the latest call's, where they said it had never been entered."""
    lin = nn.Linear(64, 64)
    ctx = storm.offload(mode="embedded", min_bytes=0)
    with pytest.raises(RuntimeError, match="not been entered"):
        ctx.stats
    forward = ctx(lambda n: lin(torch.randn(n, 64)).sigmoid().sum())
    forward(128).backward()
    first = ctx.stats
    forward(256).backward()
    assert ctx.stats is not first and ctx.stats.offloaded_bytes > first.offloaded_bytes > 0
