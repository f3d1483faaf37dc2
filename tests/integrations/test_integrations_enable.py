"""storm.enable: the model's repeated blocks found, STORM on for every forward with grad and off
for the others, bit-identical training, and disable() leaving the model as it was."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import storm
from integrations_clock import SETTLE_STEPS, StillClock
from storm.blocks import find_blocks
from storm.examples.models import GPT, GPTBlock, same_bits

transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers installed")


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=4)
    return transformers.LlamaForCausalLM(config)


class Experts(nn.Module):
    """A layer with more like modules than the model has layers (an MoE's experts): the layers must win."""

    def __init__(self, d: int = 16, n: int = 8):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


class Titan(nn.Module):
    """torchtitan keeps its layers in a ModuleDict; each layer here holds an experts list."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Experts() for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.ReLU()])  # a list, but of two classes
        self.single = nn.ModuleList([nn.Linear(8, 8)])  # one module repeats nothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mixed[1](self.mixed[0](self.single[0](self.a(x)))))


class Holder(nn.Module):
    """A model with a submodule called ``module`` beside parameters of its own: no wrapper."""

    def __init__(self):
        super().__init__()
        self.module = gpt()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx) * self.scale


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=64, seq_len=32, d_model=32, n_heads=2, n_layers=3)


def train_gpt(model: nn.Module, steps: int, handle: storm.Enabled | None = None) -> tuple[list, list]:
    """``steps`` SGD steps from seed 1; the losses and each step's gradients. With a handle, each
    step must have run in a context of its own, and without a plan offloaded."""
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 32))
        opt.zero_grad(set_to_none=True)
        last = handle.last if handle is not None else None
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        if handle is not None:
            assert handle.last is not last and (handle.planner is not None or handle.last.stats.offloaded > 0)
        opt.step()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    return losses, grads


def assert_same(want: tuple[list, list], got: tuple[list, list]) -> None:
    for step, (a, b) in enumerate(zip(want[0], got[0])):
        assert same_bits(a, b), f"loss of step {step} differs"
    for step, (ga, gb) in enumerate(zip(want[1], got[1])):
        assert all(same_bits(a, b) for a, b in zip(ga, gb)), f"gradients of step {step} differ"


def hooks_of(model: nn.Module) -> list:
    """Every hook and instance-level forward of the model and its modules."""
    return [(name, dict(m._forward_pre_hooks), dict(m._forward_hooks), set(m._forward_hooks_always_called),
             m.__dict__.get("forward")) for name, m in model.named_modules()]


@pytest.mark.parametrize("make, where, cls, n", [
    (tiny_llama, "model.layers", "LlamaDecoderLayer", 3),
    (gpt, "blocks", "GPTBlock", 3),
    (lambda: nn.Sequential(*(GPTBlock(16, 2, 0.0) for _ in range(4))), "", "GPTBlock", 4),
    (Titan, "layers", "Experts", 3),
])
def test_enable_finds_the_models_repeated_blocks(make, where, cls, n):
    """One list each, as before lists of several kinds and models of several lists were found."""
    model = make()
    found = find_blocks(model)
    assert (found.lists, found.where, found.left) == (((where, n),), where, ())
    assert {type(b).__name__ for b in found.blocks} == {cls}
    assert found.blocks == list(model.get_submodule(where).children())
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0)
    assert handle.blocks == found.blocks and handle.planner.blocks == found.blocks and handle.where == where
    handle.disable()


def test_a_model_without_repeated_blocks_is_refused_with_what_was_looked_for():
    with pytest.raises(ValueError, match=r"found no repeated blocks in NoBlocks: it looks for an nn.ModuleList.*"
                                         r"pass blocks="):
        storm.enable(NoBlocks(), budget=0.5)
    handle = storm.enable(NoBlocks(), blocks=[NoBlocks().a], budget=0.5)  # blocks= overrides the search
    assert len(handle.blocks) == 1
    handle.disable()
    with pytest.raises(TypeError, match="blocks= is for a plan"):
        storm.enable(gpt(), blocks=gpt().blocks)


def test_offload_on_every_forward_trains_bit_identical_and_disable_restores_the_model():
    model, ref = gpt(), gpt()
    before = hooks_of(model)
    want = train_gpt(ref, 3)
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    assert hooks_of(model) != before
    assert_same(want, train_gpt(model, 3, handle))
    handle.disable()
    handle.disable()  # a second disable does nothing
    assert hooks_of(model) == before
    last = handle.last
    train_gpt(model, 1)
    assert handle.last is last  # no hook is left to begin a step


def test_full_offload_of_a_cpu_model_keeps_the_stores_codec_and_a_given_codec_is_kept():
    """Frames are for CUDA saves: a model on the CPU gets no codec of storm.enable's (the store's
    applies), and a codec given is the one every step takes (test_gpu.py: "auto" on CUDA)."""
    model = gpt()
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    train_gpt(model, 1, handle)
    assert handle.last.options["codec"] is None
    handle.disable()
    handle = storm.enable(model, mode="embedded", min_bytes=0, codec="raw")
    train_gpt(model, 1, handle)
    assert handle.last.options["codec"] == "raw"
    handle.disable()


def test_a_plan_settles_and_every_step_stays_bit_identical():
    model, ref = gpt(), gpt()
    before = hooks_of(model)
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0, clock=StillClock())
    assert_same(train_gpt(ref, SETTLE_STEPS), train_gpt(model, SETTLE_STEPS, handle))
    assert handle.planner.settled, handle.explain()
    assert "storm.plan on 3 blocks at blocks (GPTBlock)" in handle.explain()
    handle.disable()
    assert hooks_of(model) == before  # the planner's hooks and recomputed blocks' forwards too


@pytest.mark.parametrize("plan", [False, True])
def test_forwards_without_grad_get_no_context_and_are_no_plan_step(plan):
    model = gpt()
    handle = storm.enable(model, mode="embedded", min_bytes=0, **({"budget": 0.5} if plan else {}))
    idx = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        model(idx)
    with torch.inference_mode():
        model(idx)
    model.eval()
    with torch.no_grad():
        model(idx)
    assert handle.last is None
    if plan:
        assert handle.planner.explain() == ("storm.plan: no plan yet; the next step is traced with every save "
                                            "offloaded (what each block saves)")
    model.train()
    model(idx).sum().backward()
    assert handle.last is not None and handle.last.stats.offloaded > 0
    handle.disable()


def test_enabling_a_model_twice_or_a_part_of_it_is_refused_until_disabled():
    model = gpt()
    handle = storm.enable(model, mode="embedded")
    with pytest.raises(RuntimeError, match="already on for GPT: call disable"):
        storm.enable(model)
    with pytest.raises(RuntimeError, match="already on for GPT, which holds this GPTBlock"):
        storm.enable(model.blocks[0])
    handle.disable()
    inner = storm.enable(model.blocks[1], mode="embedded")
    with pytest.raises(RuntimeError, match="already on for GPTBlock, a module of this GPT"):
        storm.enable(model)
    inner.disable()
    storm.enable(model, mode="embedded").disable()


@pytest.mark.parametrize("model", [None, "model", lambda x: x, nn.Linear])
def test_what_is_no_module_instance_is_refused(model):
    """None, a name, a function or a model's class gave an AttributeError or TypeError from deep
    inside storm.enable."""
    with pytest.raises(TypeError, match="storm.enable takes an nn.Module instance"):
        storm.enable(model)


def test_the_refusal_of_a_second_enable_says_where_the_first_handle_is():
    """Whoever enabled the model (a callback, a helper) may not have handed its handle over: the
    error names where to find it, and storm.enabled.handle_of finds it."""
    model = gpt()
    handle = storm.enable(model, mode="embedded")
    with pytest.raises(RuntimeError, match=r"storm.enabled.handle_of\(the GPT\)"):
        storm.enable(model)
    assert storm.enabled.handle_of(model) is handle
    handle.disable()
    assert storm.enabled.handle_of(model) is None


def test_modules_given_as_a_generator_count_in_every_step():
    """modules=model.modules() is read once: the second step keeps the module state too (the first
    step's context used the generator up)."""
    class WithBuffer(nn.Linear):  # its forward saves its buffer
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (super().forward(x) @ self.b).sum()

    model = WithBuffer(128, 128)
    model.register_buffer("b", torch.randn(128, 128))
    handle = storm.enable(model, mode="embedded", min_bytes=0, modules=model.modules())
    kept = []
    for _ in range(2):
        model(torch.randn(4, 128)).backward()
        kept.append(handle.last.stats.kept.get(storm.Keep.MODULE_STATE))
    handle.disable()
    assert kept == [1, 1]


def test_a_forward_that_raises_ends_its_step():
    model = gpt()
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    with pytest.raises(IndexError):
        model(torch.full((2, 32), 1000))  # out of the embedding's range
    handle.disable()  # refused if the failed forward had left its step open


class Interrupted(nn.Module):
    """Raises KeyboardInterrupt (Ctrl-C in a notebook) in its forward while ``interrupt`` is set;
    with ``nested``, calls itself once within its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.interrupt, self.nested = False, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:
            self.nested = False
            x = self(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
            if self.interrupt:
                raise KeyboardInterrupt
        return x


@pytest.mark.parametrize("then", ["forward", "disable"])
def test_a_forward_interrupted_by_keyboard_interrupt_ends_its_step(then, caplog):
    """torch runs no always_call forward hook for a KeyboardInterrupt: the step stayed open, every
    later forward was taken as nested in it (no new step) and disable() refused for good. A
    forward the model calls within its own still joins the open step."""
    torch.manual_seed(0)
    model = Interrupted()
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    x = torch.randn(8, 32)
    model.nested = True
    model(x).sum().backward()
    assert handle.last.stats.offloaded > 0 and not handle._open
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.interrupt = False
    if then == "forward":
        interrupted = handle.last
        with caplog.at_level(logging.WARNING, logger="storm"):
            model(x).sum().backward()
        assert handle.last is not interrupted and not handle._open
        assert any("KeyboardInterrupt" in r.getMessage() for r in caplog.records)
    handle.disable()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_after_a_forward_interrupted_deeper_in_the_stack_a_nested_call_joins_the_next_step(caplog):
    """The next step is measured from its own call's depth, not the interrupted one's: a forward
    interrupted further down the stack than the next is called from left its depth behind, and the
    next step's nested call, between the two depths, was taken as interrupting it too."""
    torch.manual_seed(0)
    model = Interrupted()
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    x = torch.randn(8, 32)

    def deep(n: int) -> torch.Tensor:
        return model(x) if n == 0 else deep(n - 1)

    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        deep(20)
    model.interrupt, model.nested = False, True
    with caplog.at_level(logging.WARNING, logger="storm"):
        model(x).sum().backward()
    assert sum("KeyboardInterrupt" in r.getMessage() for r in caplog.records) == 1  # the real one alone
    assert not handle._open and handle.last.stats.offloaded > 0
    handle.disable()


class BadBatch(nn.Module):
    """Raises in its stem, after a save and before any block, on a batch that is not finite."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if not torch.isfinite(x).all():
            raise ValueError("bad batch")
        for b in self.blocks:
            h = torch.tanh(b(h))
        return h.sum()


def test_a_first_forward_that_raises_before_the_blocks_is_not_taken_for_a_compiled_graph(caplog):
    """A traced step with saves and no block run reads as blocks run inside a graph compiled as one,
    which was said to an eager model whose first batch raised; its step now knows it raised."""
    model = BadBatch()
    handle = storm.enable(model, budget=0.3, mode="embedded", min_bytes=0, clock=StillClock())
    bad = torch.randn(4, 8)
    bad[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="storm"), pytest.raises(ValueError):
        model(bad)
    assert not handle.last.completed
    with caplog.at_level(logging.WARNING, logger="storm"):
        for _ in range(3):
            model(torch.randn(4, 8)).backward()
    assert handle.last.completed
    handle.disable()
    assert not any("compiled as one graph" in r.getMessage() for r in caplog.records)


def test_a_model_with_a_submodule_called_module_is_no_wrapper():
    model = Holder()
    handle = storm.enable(model, budget=0.5, mode="embedded", min_bytes=0)
    assert handle.model is model and handle.blocks == list(model.module.blocks)
    handle.disable()


DDP_RUN = """
import datetime, faulthandler, sys
faulthandler.dump_traceback_later(240)  # a stalled collective shows where, before the parent's deadline
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import storm
from test_integrations_enable import assert_same, gpt, train_gpt
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=120))
try:
    want = train_gpt(DistributedDataParallel(gpt()), 2)
    ddp = DistributedDataParallel(gpt())
    handle = storm.enable(ddp, budget=0.5, mode="embedded", min_bytes=0)
    assert handle.model is ddp.module and handle.blocks == list(ddp.module.blocks)
    assert_same(want, train_gpt(ddp, 2, handle))
    handle.disable()
finally:
    dist.destroy_process_group()
print("ok")
"""


def test_a_ddp_wrapped_model_is_unwrapped_and_trains_bit_identical(tmp_path):
    """In a process of its own, as a DDP rank runs: gloo's threads and store stay out of the test
    process, and a collective that never returns fails this test instead of stalling the suite."""
    here = str(Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, "-c", DDP_RUN, here, str(tmp_path / "pg")], capture_output=True,
                       text=True, timeout=600)  # a torch import and two tiny trainings, on a loaded machine
    assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["ok"], r.stdout + r.stderr


class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return self(h, depth - 1) if depth else h


class Scaled(nn.Module):
    """Returns a parameter as it is beside its output, as a model with a learned temperature does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), self.scale


def test_a_parameter_the_forward_returns_gets_no_hook_and_joins_no_later_forward():
    """A step watches its forward's outputs until backward reaches them; a leaf returned as it is
    belongs to no graph of that forward: hooked, it gained one hook a step for good, and after a
    forward whose graph was dropped the next forward was joined into that dead step."""
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(32, 64)
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    try:
        for _ in range(5):
            out, scale = model(x)
            (out.square().sum() * scale).backward()
        assert not model.scale._backward_hooks
        dropped = model(x)[0].sum()  # a forward whose graph goes unused
        evaluated = handle.last
        del dropped
        out, scale = model(x)
        assert handle.last is not evaluated
        (out.sum() * scale).backward()
    finally:
        handle.disable()


def test_a_forward_called_inside_the_models_own_forward_belongs_to_the_open_step():
    x = torch.randn(4, 16)
    with storm.offload(mode="embedded", min_bytes=0) as whole:
        Recursive()(x, depth=2).sum()
    model = Recursive()
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    model(x, depth=2).sum().backward()
    assert handle.last.stats.offloaded == whole.stats.offloaded > 0  # one scope: the outermost call's
    handle.disable()


class Meeting(nn.Module):
    """A model whose forward waits until every thread running it is inside it."""

    def __init__(self, threads: int):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
        self.inside = threading.Barrier(threads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.inside.wait(120)
        return self.b(h).sum()


@pytest.mark.parametrize("round", range(20))
def test_threads_in_one_enabled_models_forward_at_once_each_keep_their_own_step(round):
    """Each thread's forward has its own context: one thread's forward hook never exits another's
    (an error, and saved-tensor hooks left installed in both), and both train bit-identical."""
    threads = 2
    model = Meeting(threads)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(round * 10 + i)) for i in range(threads)]
    params = list(model.parameters())
    model.inside = threading.Barrier(1)
    expected = [torch.autograd.grad(model(x), params) for x in xs]
    model.inside = threading.Barrier(threads)
    handle = storm.enable(model, mode="embedded", min_bytes=0)
    start, results, errors = threading.Barrier(threads), [None] * threads, []

    def train(i: int) -> None:
        try:
            start.wait(120)
            loss = model(xs[i])
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # none left on
            results[i] = torch.autograd.grad(loss, params)
        except BaseException as e:  # noqa: BLE001 - the test fails below on any thread's error
            errors.append(e)

    workers = [threading.Thread(target=train, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert not errors, errors
    assert all(same_bits(g, w) for got, want in zip(results, expected) for g, w in zip(got, want))
    assert handle.last.stats.offloaded > 0
    handle.disable()


def test_import_storm_needs_no_framework():
    """storm and storm.integrations import no training framework: each integration's module does."""
    code = ("import sys, storm, storm.integrations; "
            "print(sorted({'transformers', 'lightning', 'accelerate'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def whole_graph_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compiled as one graph" in r.getMessage()]


@pytest.mark.parametrize("how", ["compile-then-enable", "enable-then-compile", "per-block"])
def test_offload_on_a_compiled_model_trains_bit_identical_and_warns_once_for_one_graph(how, caplog, recwarn):
    """Issue 40 item 3: a model compiled as one graph hands its saves over only after its forward
    (no peak lowered): one warning names per-block compile, whether the model was compiled before
    storm.enable (seen at enable) or after (a probe hook dynamo traces sees it). Blocks compiled one
    by one are no such case. Each way every step offloads and trains bit-identical to the same
    compiled model without STORM, and dynamo never traces the enable hooks (it would run them
    only when it compiles, or break its graph inside STORM's session code, which it says)."""
    from storm.compiled import warn_whole_graph
    warn_whole_graph.cache_clear()

    def build() -> nn.Module:
        torch._dynamo.reset()
        model = gpt()
        if how == "per-block":
            for b in model.blocks:
                b.compile(backend="aot_eager")
        elif how == "compile-then-enable":
            model.compile(backend="aot_eager")
        return model

    want = train_gpt(build() if how != "enable-then-compile" else torch.compile(gpt(), backend="aot_eager"), 3)
    model = build()
    with caplog.at_level(logging.WARNING, logger="storm"):
        handle = storm.enable(model, mode="embedded", min_bytes=0)
        trained = torch.compile(model, backend="aot_eager") if how == "enable-then-compile" else model
        got = train_gpt(trained, 3, handle)
    handle.disable()
    assert_same(want, got)
    assert not [str(w.message) for w in recwarn if "Dynamo" in str(w.message)]
    warned = whole_graph_warnings(caplog)
    if how == "per-block":
        assert warned == []
    else:
        assert len(warned) == 1 and "b.compile()" in warned[0] and "storm.enable" in warned[0], warned
