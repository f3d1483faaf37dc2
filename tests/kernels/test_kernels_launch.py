"""kernels.gpu.launch on the CPU: the key it finds compiled kernels by tells apart what
Triton's JIT specializes on (the GPU test checks it against the JIT itself)."""
from __future__ import annotations

import pytest
import torch

launch = pytest.importorskip("storm.kernels.gpu.launch")


def test_the_key_tells_apart_what_the_jit_specializes_on() -> None:
    spec = launch._spec
    x = torch.zeros(8, dtype=torch.int64)
    assert spec(x) != spec(x[1:])                    # 16-byte aligned or not
    assert spec(x) != spec(x.view(torch.int32))      # the pointer's type
    assert spec(x[2:]) == spec(x)                    # 16 bytes on: aligned again
    assert spec(1) != spec(2) and spec(16) != spec(17) and spec(16) == spec(32)
    assert spec(2**31 - 1) != spec(2**31) and spec(2**63 - 1) != spec(2**63)
    assert spec(-3) == spec(3) and spec(True) != spec(1) and spec(None) != spec(0)
    assert spec(0.5) == spec(2.0) != spec(2)         # floats are fp32 whatever their value


def test_interpreted_kernels_go_through_the_interpreter() -> None:
    """A function that is not a compiled JIT kernel (the interpreter's) is launched as it is."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = launch.Launcher(Kernel())
    launcher[(3,)](1, 2, BLOCK=4)
    assert calls == [((3,), (1, 2), {"BLOCK": 4})] and not launcher.compiled


def test_a_launch_hook_sends_launches_through_the_jit() -> None:
    """Triton keeps launch hooks in chains, empty by default: only a hook in one counts."""
    from triton import knobs

    assert not launch._hooked()
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch._hooked()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch._hooked()
