"""Triton launches without the JIT's work on every call.

A launch through ``kernel[grid](...)`` binds and specializes every argument, builds the
cache key and checks the kernel's globals before it launches: far more host time than the
same launch through the compiled kernel's launcher (docs/results.md has both, measured). A
codec's call is a few launches, and at its start the device waits for each, so the codecs'
kernels are wrapped in ``Launcher``, which saves part of it: its first
launch of each specialization goes through the JIT, which compiles or finds the kernel and
returns it; later ones go to that compiled kernel, found again by what the JIT specializes
on (``_spec``: each tensor's dtype and 16-byte alignment, each integer's width and whether
it is 1 or a multiple of 16), the keyword arguments (constexprs, num_warps) and the device,
and launched as the JIT launches it. tests/kernels/test_kernels_gpu.py checks that it finds
the kernel the JIT would. Under TRITON_INTERPRET, and while a launch hook is set (a
profiler's), every launch goes through the JIT.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import triton
from triton import knobs

from . import current_stream


def _spec(arg: Any) -> Any:
    """What the JIT specializes a kernel on for ``arg``, as a key."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float  # an fp32 argument, whatever its value
    if isinstance(arg, bool) or not isinstance(arg, int):
        return type(arg), arg
    return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, -2**63 <= arg < 2**63


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton 3.6 on keeps them in HookChains, empty
    unless one is added."""
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


class Launcher:
    """``kernel[grid](*args, **kwargs)`` for a ``@triton.jit`` kernel, past the JIT once the
    kernel for these arguments' specialization is compiled. Positional arguments are the
    kernel's first parameters, keywords the rest (by name) and launch options."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.jit = isinstance(fn, triton.runtime.JITFunction)  # not the interpreter's
        self.names = [p.name for p in fn.params] if self.jit else []
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if self.jit and not _hooked():
            device = torch.cuda.current_device()
            key = (device, tuple(map(_spec, args)), tuple(kwargs.items()))
            kernel = self.compiled.get(key)
            if kernel is None:
                self.compiled[key] = self.fn[grid](*args, **kwargs)
                return
            # the call the JIT ends with (no hooks, so no launch metadata)
            kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                       current_stream(device), kernel.function, kernel.packed_metadata, None, None,
                       None, *args, *(kwargs[name] for name in self.names[len(args):]))
            return
        self.fn[grid](*args, **kwargs)
