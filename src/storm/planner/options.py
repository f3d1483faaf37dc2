"""storm.plan's options, checked before any block is seen: storm.enable and its callbacks check
theirs with them before the Trainer hands them a model."""

from __future__ import annotations

from typing import Any

from stormd.wire.sizes import parse_size

from ..hooks import Offload, parse_budget
from .trial import Clock


def plan_options(budget: int | float | str | None, peak: int | str | None, reentrant: bool, clock: Clock | None,
                 offload_options: dict[str, Any]) -> tuple[int | float | None, int | None, dict[str, Any]]:
    """storm.plan's options checked as far as they can be without the blocks (whether peak= can be
    measured depends on their device): the budget as given (bytes, or a fraction of the traced
    step's), the peak in bytes, and the storm.offload options given, as checked ("512MiB" read as
    bytes; codec=None left out: no codec given). Refused now, not at the first step; storm.enable's
    callbacks check theirs here before they have a model."""
    if "budget" in offload_options or (budget is None) == (peak is None):
        raise TypeError("storm.plan takes one of budget= (the GPU memory saved activations may take: bytes or "
                        "a fraction of a step's) and peak= (the step's peak GPU memory above its start, bytes); "
                        "it sets storm.offload's budget itself")
    if not isinstance(reentrant, bool):  # "no" would be taken as True
        raise ValueError(f"reentrant must be True or False; got {reentrant!r}")
    if clock is not None and not all(callable(getattr(clock, f, None)) for f in ("host", "mark", "elapsed_ms")):
        raise TypeError(f"clock must be None (the compute stream's timings on CUDA, else the host's) or a "
                        f"storm.planner.Clock (an object with host(), mark() and elapsed_ms()); got {clock!r}")
    checked = Offload(**offload_options).options
    # codec=None is no codec given: the plan's choice of frames, as where it is left out (a config
    # passing every option would otherwise override each step's codec with the store's)
    return (parse_budget(budget), None if peak is None else _parse_peak(peak),
            {k: checked[k] for k in offload_options if not (k == "codec" and checked[k] is None)})


def _parse_peak(peak: int | str) -> int:
    bad = ValueError(f"peak must be bytes (an int or a size such as '6GiB'), got {peak!r}")
    if isinstance(peak, (bool, float)):  # a fraction of what? peak is the step's own memory
        raise bad
    try:
        value = parse_size(peak)
    except ValueError:
        raise bad from None
    if value < 0:
        raise bad
    return value
