"""Recompute: a block's forward that keeps only its inputs and runs again in backward.

storm.plan sets it as a recomputed block's ``forward``. Two forms:

- Reentrant (the default): forward runs without autograd, and backward recomputes the block
  and runs a nested backward through it, as torch.utils.checkpoint's use_reentrant=True form
  does; written out here (``_Reentrant``) because a recomputed block's Python is step time on
  a host-bound step, and torch's generic form enters autocast and RNG contexts and scans its
  arguments at every call, which shows in forward's host time and so in a host-bound step's
  (docs/results.md has the comparison of the forms). It costs the host
  less than the non-reentrant form, whose Python hooks pack and unpack every tensor the block
  saves, in forward as well; a host-bound step pays all of it.
- Non-reentrant (torch.utils.checkpoint, use_reentrant=False): for keyword arguments, which the
  reentrant form does not take, for a block holding an nn.MultiheadAttention in eval mode (whose
  forward takes its fast path without autograd, as the reentrant form's forward runs: another
  computation than training without STORM's), and ``reentrant=False``; it also works with
  torch.autograd.grad and backward(inputs=...). Tensors among the keyword arguments are passed
  to torch's checkpoint positionally, so that it saves them as the others.

What the reentrant form's nested backward holds is kept to what the non-reentrant one holds
(their difference decides which form fits a tight cap):

- Each tensor the recompute saves is handed to the node that saved it when that node runs
  (``_Saved``), and dropped then, as the non-reentrant form's hooks do; autograd would keep it
  until the node finishes, beside the node's own temporaries (a bias gradient's reduction
  buffer, say).
- The rebuilt output goes before the nested backward runs (``_release``).

Under no_grad the block just runs. The recompute draws the same random numbers as forward
(dropout masks), on the CPU and the block's device, and runs under forward's autocast.

A recompute runs the block's code a second time, so whatever the block changes besides its
output happens twice. Hugging Face's layers write the model's KV cache as they run (``use_cache``
is on in their configs by default): the replay would append to it again and compute attention
over the keys twice. As transformers' own gradient checkpointing does, a recomputed block is
called with ``use_cache=False`` and without its cache (``cache``, ``past_key_values``,
``past_key_value``, ``layer_past``), unless its class says it only reads the cache
(``_can_checkpoint_with_cache``), with a warning once; a cache passed by position (GPT-2's
blocks) is named and turned off as well. BatchNorm and InstanceNorm layers in training keep
running statistics: the replay normalizes by the batch's statistics as forward did, but leaves
the running ones as forward left them (``Recompute.replaying``), or each step would count every
batch twice.

The reentrant form takes a block's top-level tensors: a block given tensors within a container (a
tuple, a namedtuple, a list, a dict of any kind) takes the non-reentrant form. Under
``backward(create_graph=True)`` the reentrant form raises (its gradients would not carry the graph
back through the block's inputs): the non-reentrant form differentiates twice as the block run
plainly does. Its nested backward sums the gradients of an input's uses within the block before
autograd adds those of its uses outside (``x = x + block(x)``, one encoder output given to every
decoder block), where autograd alone adds each as it comes: the last bits may differ, and only
``reentrant=False`` is exact there (README says so).
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("storm")

# the keyword arguments Hugging Face's layers take their KV cache by (the name changed over versions)
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


class Recompute:
    """A block's forward (``forward``, the block's own bound method) recomputed in backward,
    in the reentrant form unless ``reentrant=False``. A tensor that requires grad (``_grad``,
    empty) goes in beside the inputs, so that the block's parameters get their gradients where
    its input does not require grad (the first block's). ``hand_over=False`` leaves the
    reentrant recompute's saved tensors to autograd, which keeps them as it keeps a block's
    that is not recomputed: storm.plan measures what that holds (Planner.kept_extra)."""

    def __init__(self, forward: Callable[..., Any], device: torch.device, reentrant: bool = True,
                 hand_over: bool = True):
        self.forward, self.device, self.reentrant, self.hand_over = forward, device, reentrant, hand_over
        # a bound method's module (within torch.compile's wrapper where compiled): its class may keep a KV cache
        inner = getattr(forward, "_torchdynamo_orig_callable", forward)
        self.block = getattr(inner, "__self__", getattr(inner, "__wrapped__", None))
        # its layers whose state a replay would update a second time: BatchNorm's and InstanceNorm's
        # that keep running statistics
        self._stateful = [m for m in self.block.modules() if isinstance(m, _NormBase) and m.track_running_stats] \
            if isinstance(self.block, torch.nn.Module) else []
        # where the block takes its KV cache positionally (GPT-2's block(hidden, cache, mask, ...)): the
        # names of its leading parameters, so that a call passing a cache there goes by keyword
        names = _positional_names(forward)
        self._positional = names if any(n in CACHE_KWARGS or n == "use_cache" for n in names) else ()
        self._grad = torch.empty(0, device=device, requires_grad=True)
        self._parameters = list(self.block.parameters()) if isinstance(self.block, torch.nn.Module) else []
        # layers whose forward takes another path without autograd (torch's attention fast path, in
        # eval mode): the reentrant form's forward runs without it, so it would compute otherwise
        self._grad_mode_paths = [m for m in self.block.modules() if isinstance(m, torch.nn.MultiheadAttention)] \
            if isinstance(self.block, torch.nn.Module) else []
        # eager even inside a compiled block's region: dynamo would trace the autograd Function and its
        # RNG and autocast state away; a compiled block's own forward is compiled apart (planner/wiring.py).
        # Wrapped here, not where the class is defined: torch.compiler.disable imports torch._dynamo,
        # which `import storm` would then pay
        self._eager = torch.compiler.disable(self._call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eager(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self._needs_grad(args, kwargs):
            return self.forward(*args, **kwargs)
        if self._caches_positionally(args):
            args, kwargs = (), {**dict(zip(self._positional, args)), **kwargs}
        # the reentrant Function takes only top-level tensors: tensors within any container argument
        # (a tuple, a namedtuple, a dict of any kind) would not be detached and their gradients not returned
        if kwargs or not self.reentrant or any(not m.training for m in self._grad_mode_paths) \
                or any(not isinstance(a, (torch.Tensor, *_PLAIN)) and _holds_tensor(a) for a in args):
            contexts = {"context_fn": lambda: (nullcontext(), self.replaying())} if self._stateful else {}
            # the keyword arguments' tensors go positionally, so that torch's checkpoint saves them
            # as it saves the positional ones (through the saved-tensor hooks: STORM may offload
            # them) instead of holding them in its closure: a Hugging Face layer's rotary tables
            # (and `call` refers to none of the tensors: its closure lives as long as the graph)
            tensors, rebuild = _tensors_apart(self._without_cache(kwargs))
            n = len(args)

            def call(*flat: Any) -> Any:
                return self.forward(*flat[:n], **rebuild(flat[n:]))

            return checkpoint(call, *args, *tensors, use_reentrant=False, **contexts)
        out = _Reentrant.apply(self, self._grad, *args)
        return tree_unflatten(list(out[1:]), out[0].spec) if type(out) is tuple and out and type(out[0]) is _Nested \
            else out

    def _needs_grad(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether a gradient flows through the block: an input or a parameter requires grad (a
        frozen block of a fine-tuned model has none: it runs as it is, and nothing is recomputed)."""
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
            or any(p.requires_grad for p in self._parameters) \
            or any(isinstance(a, torch.Tensor) and a.requires_grad for a in tree_flatten(kwargs)[0])

    def _caches_positionally(self, args: tuple) -> bool:
        """Whether ``args`` pass a KV cache (or use_cache) by position, which _without_cache turns
        off by keyword only."""
        return any(name in CACHE_KWARGS and a is not None or name == "use_cache" and a
                   for name, a in zip(self._positional, args))

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Within: the block's BatchNorm and InstanceNorm layers in training leave their running
        statistics and batch count as they were: a momentum of 0 (the batch's statistics still
        normalize), then the statistics put back as they were. Turning tracking off instead would
        change which tensors batch_norm saves, which torch's non-reentrant checkpoint refuses."""
        frozen = [(m, m.momentum, [b.clone() for b in _statistics(m)]) for m in self._stateful if m.training]
        for m, _, _ in frozen:
            m.momentum = 0.0
        try:
            yield
        finally:
            for m, momentum, kept in frozen:
                m.momentum = momentum
                for b, was in zip(_statistics(m), kept):
                    b.copy_(was)

    def _without_cache(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with a Hugging Face layer's KV cache turned off (see the module's
        docstring); a block whose class only reads the cache keeps it."""
        turned_off = {"use_cache": False} if kwargs.get("use_cache") else {}
        if not getattr(self.block, "_can_checkpoint_with_cache", False):
            turned_off.update((k, None) for k in CACHE_KWARGS if kwargs.get(k) is not None)
        if not turned_off:
            return kwargs
        _warn_cache_off(type(self.block).__name__, tuple(turned_off))
        return {**kwargs, **turned_off}


@functools.cache
def _warn_cache_off(block: str, names: tuple[str, ...]) -> None:
    """Once per block class and arguments turned off."""
    log.warning("storm: %s is recomputed in backward, which would write its KV cache a second time and change "
                "what it computes; it runs with %s, as transformers' gradient checkpointing does", block,
                ", ".join("use_cache=False" if n == "use_cache" else f"{n}=None" for n in names))


class _Reentrant(torch.autograd.Function):
    """The reentrant recompute: forward keeps the inputs (tensors through save_for_backward,
    which checks them for in-place changes), the RNG states and the autocast settings; backward
    runs the block again under them and backward through it."""

    @staticmethod
    def forward(ctx: Any, rec: Recompute, _grad: torch.Tensor, *args: Any) -> Any:
        ctx.rec, ctx.state = rec, _State(rec.device)
        ctx.tensor_at = frozenset(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        ctx.args = [None if i in ctx.tensor_at else a for i, a in enumerate(args)]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        return _outputs(rec.forward(*args))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("storm: a block recomputed in the reentrant form (storm.plan's default) cannot run "
                               "its backward under torch.autograd.grad or backward(inputs=...); pass "
                               "reentrant=False to storm.plan")
        if torch.is_grad_enabled():  # the engine runs backward functions in grad mode only under create_graph
            raise RuntimeError("storm: a block recomputed in the reentrant form (storm.plan's default) cannot run "
                               "its backward with create_graph=True (a gradient penalty, a Hessian-vector "
                               "product): the gradients it returns would carry no graph through the block's "
                               "inputs; pass reentrant=False to storm.plan")
        rec, saved = ctx.rec, iter(ctx.saved_tensors)
        args = [_detached(next(saved)) if i in ctx.tensor_at else a for i, a in enumerate(ctx.args)]
        hooks = torch.autograd.graph.saved_tensors_hooks(_Saved, _Saved.take) if rec.hand_over else nullcontext()
        with ctx.state.restored(), torch.enable_grad(), hooks, rec.replaying():
            try:
                out = _outputs(rec.forward(*args))
            except RuntimeError as e:
                if "leaf Variable that requires grad is being used in an in-place operation" not in str(e):
                    raise
                raise RuntimeError(f"storm: {type(rec.block).__name__} changes its input in place (an in-place "
                                   f"activation on it, say); a recomputed block runs again on the input forward "
                                   f"gave it, which that would change: make the op out of place, or leave the "
                                   f"block out of the plan (blocks=)") from e
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            raise RuntimeError("storm: a recomputed block's outputs do not require grad; nothing to recompute")
        for o, _ in pairs:
            _release(o)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if isinstance(a, torch.Tensor) else None for a in args))


def _positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``forward``'s parameters that a call may pass by position, up to the first
    that cannot be named (positional-only, *args): those after it are not mapped."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return ()
    names = []
    for p in params:
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        names.append(p.name)
    return tuple(names)


def _statistics(m: _NormBase) -> list[torch.Tensor]:
    """What a replay must put back of a norm layer: its batch count, and an InstanceNorm's running
    statistics, whose momentum-0 update is averaged over the batch (the last bit may move). A
    BatchNorm's momentum-0 update leaves its statistics exactly as they were, and its backward
    may read them: they are not written again."""
    kept = [m.num_batches_tracked] if isinstance(m, _BatchNorm) else [m.running_mean, m.running_var,
                                                                       m.num_batches_tracked]
    return [b for b in kept if b is not None]


# values that hold no tensor, as torch's pytree would find none in them
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
# keyword arguments' tensors, and what puts tensors in their places again
Apart = tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], dict]]


def _tensors_apart(kwargs: dict[str, Any]) -> Apart:
    """``kwargs``' tensors, and how to put tensors in their places again: a dict like ``kwargs``.
    By hand where each value is a tensor, a tuple of tensors (rotary tables) or holds none (a
    Hugging Face layer's keyword arguments): it runs as a block's forward starts and again as it
    is recomputed, and torch's pytree took several times as long there; otherwise through the
    pytree, which finds tensors in nested containers too."""
    tensors: list[torch.Tensor] = []
    # per keyword: -1 one tensor, k >= 0 a tuple of k tensors, -2 the value itself (no tensor:
    # rebuild's closure lives as long as the graph, and must hold none)
    shape: list[tuple[str, int, Any]] = []
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            shape.append((name, -1, None))
            tensors.append(value)
        elif type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value):
            shape.append((name, len(value), None))
            tensors.extend(value)
        elif isinstance(value, _PLAIN):
            shape.append((name, -2, value))
        else:
            return _tensors_apart_by_pytree(kwargs)

    def rebuild(given: Sequence[torch.Tensor]) -> dict:
        out, j = {}, 0
        for name, k, value in shape:
            if k == -1:
                out[name], j = given[j], j + 1
            elif k >= 0:
                out[name], j = tuple(given[j:j + k]), j + k
            else:
                out[name] = value
        return out

    return tensors, rebuild


def _tensors_apart_by_pytree(kwargs: dict[str, Any]) -> Apart:
    """_tensors_apart through torch's pytree."""
    leaves, spec = tree_flatten(kwargs)
    at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    rest = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def rebuild(given: Sequence[torch.Tensor]) -> dict:
        out = list(rest)
        for i, t in zip(at, given):
            out[i] = t
        return tree_unflatten(out, spec)

    return [leaves[i] for i in at], rebuild


def _holds_tensor(a: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(a)[0])


class _Nested:
    """Heads the outputs of a block whose output is not a tensor or a tuple of them (a dict, a
    Hugging Face ModelOutput, nested tuples): an autograd Function tracks only the tensors it
    returns at its top level, so those of such an output would get no gradient."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any):
        self.spec = spec


def _outputs(out: Any) -> Any:
    """A block's output as the reentrant Function returns it: as it is where it is a tensor or a
    flat tuple, else its leaves after a _Nested (Recompute._call puts it back together)."""
    if isinstance(out, torch.Tensor) or type(out) is tuple and not any(isinstance(o, (tuple, list, dict)) for o in out):
        return out
    leaves, spec = tree_flatten(out)
    return (_Nested(spec), *leaves)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """The recompute's own leaf over an input: its gradient is the input's."""
    return t.detach().requires_grad_(t.requires_grad)


def _autocast(device_type: str) -> tuple[torch.dtype, bool] | None:
    """Autocast's dtype and cache setting for ``device_type``; None where it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


class _State:
    """What forward ran under and its recompute must too: the CPU's and the block's device's
    RNG states (the same dropout masks) and autocast's settings."""

    __slots__ = ("device", "cpu_rng", "device_rng", "autocast")

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = _device_rng(device)
        types = ("cpu",) if device.type == "cpu" else (device.type, "cpu")
        self.autocast = {t: _autocast(t) for t in types}

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Forward's RNG states and autocast within; the RNG states as they were after (backward
        goes on drawing where it was)."""
        cpu_rng, device_rng = torch.get_rng_state(), _device_rng(self.device)
        torch.set_rng_state(self.cpu_rng)
        if device_rng is not None:
            torch.get_device_module(self.device).set_rng_state(self.device_rng, self.device)
        try:
            with ExitStack() as stack:
                for t, setting in self.autocast.items():
                    if _autocast(t) != setting:  # entered only where backward's differs: each costs the host
                        stack.enter_context(torch.autocast(t, enabled=False) if setting is None else
                                            torch.autocast(t, dtype=setting[0], cache_enabled=setting[1]))
                yield
        finally:
            torch.set_rng_state(cpu_rng)
            if device_rng is not None:
                torch.get_device_module(self.device).set_rng_state(device_rng, self.device)


def _device_rng(device: torch.device) -> torch.Tensor | None:
    """The RNG state of ``device``'s default generator; None for the CPU (kept beside it)."""
    return None if device.type == "cpu" else torch.get_device_module(device).get_rng_state(device)


class _Saved:
    """A tensor the recompute saved, until the node that saved it takes it in the nested
    backward. A second taking (a custom Function reading ``ctx.saved_tensors`` twice) is an
    error, as in torch's non-reentrant checkpoint."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        # detached: its own tensor over the same storage, which _release leaves alone when the
        # saved tensor is the block's output (exp's backward saves its result)
        self.tensor: torch.Tensor | None = tensor.detach()

    def take(self) -> torch.Tensor:
        t, self.tensor = self.tensor, None
        if t is None:
            raise RuntimeError("storm Recompute: a tensor the recomputed block saved was unpacked twice in one "
                               "backward (a custom Function reading ctx.saved_tensors twice?): read them once "
                               "and keep them, as torch's non-reentrant checkpoint also asks")
        return t


def _release(out: Any) -> None:
    """Let the reentrant recompute's rebuilt output go before the nested backward runs: that
    backward needs only its graph (``grad_fn``) and shape, and would otherwise keep the block's
    output alive beside everything the block's backward holds, one block's output more at the
    step's peak. The tensor
    keeps its shape over a one-element stride-0 buffer; a node that saved the output (``exp``'s
    backward) holds its own reference to the storage, so its gradient is unchanged and only the
    unshared bytes go. Views, leaves (a block that returns its input) and what is not a tensor
    are left alone."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None and not out._is_view():
        out.data = torch.empty((), dtype=out.dtype, device=out.device).expand(out.shape)
