"""What offloading W1's first saves costs with STORM's budget, against the least a hook can do.

    python bench/hook_floor.py --out bench/results/hook-floor-w1.json

"min" is a minimal torch.autograd.graph.saved_tensors_hooks offload: each contiguous save of
at least 1 MiB, until the budget, is copied into a slice of one pinned buffer on one side
stream (record_stream lets its memory go when the copy is done) and everything comes back on
another at backward's first unpack; no store, no bookkeeping, no memory bound. "storm" is
storm.offload(budget=B) (embedded store); "storm-hooks" its hooks with nothing offloaded (a
1-byte budget). Variants run in turn, --rounds times, medians of their steps. Then one
instrumented run of each at 1 GiB: the training thread's time in the hooks, and for STORM
per function (pack, unpack and what they call). On a launch-bound model the host time a hook
adds is step time; what "min" adds is what any per-tensor hook pays on that host. With
--plan-caps, storm.plan(peak=cap) too, on a model of its own, its settled plan run as storm.plan
runs it ("plan-CAP": STORM's hooks come off after the last offloaded block) and with the hooks
left on ("plan-CAP-hooks-on"); a plan that offloads nothing installs no hooks in either.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import storm  # noqa: E402
import storm.prefetch as prefetch  # noqa: E402
import storm.session as session  # noqa: E402
import storm.transfer as transfer  # noqa: E402
import storm.gpu as gpu  # noqa: E402
from offload import plan_summary, write  # noqa: E402
from profile_step import medians, timed_step  # noqa: E402
from workloads import W1  # noqa: E402

GiB = 1 << 30
spent: dict[str, float] = collections.defaultdict(float)  # training-thread seconds per wrapped function
calls: collections.Counter = collections.Counter()


def timed(label: str, f: Callable) -> Callable:
    @functools.wraps(f)
    def g(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t0
            calls[label] += 1
    return g


class MinOffload:
    """The least a saved-tensors hook can do to offload the first ``budget`` bytes."""

    def __init__(self, budget: int, pinned: torch.Tensor):
        self.budget, self.pinned = budget, pinned
        self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self.offset, self.items, self.fetched = 0, [], None
        self.pack, self.unpack = timed("min.pack", self._pack), timed("min.unpack", self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        n = t.numel() * t.element_size()
        if (n < (1 << 20) or self.offset + n > self.budget or isinstance(t, torch.nn.Parameter)
                or not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != n):
            return t
        self.d2h.wait_stream(torch.cuda.current_stream())
        dst = self.pinned[self.offset:self.offset + n]
        with torch.cuda.stream(self.d2h):
            dst.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        t.record_stream(self.d2h)
        self.offset += n
        self.items.append((dst, t.dtype, t.shape))
        return len(self.items) - 1

    def _unpack(self, p: Any) -> torch.Tensor:
        if self.fetched is None:  # backward's first unpack: everything comes back
            self.fetched = {}
            self.h2d.wait_stream(self.d2h)
            for i in reversed(range(len(self.items))):
                with torch.cuda.stream(self.h2d):
                    buf = torch.empty(self.items[i][0].numel(), dtype=torch.uint8, device="cuda")
                    buf.copy_(self.items[i][0], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.h2d)
                self.fetched[i] = (buf, ev)
        if isinstance(p, torch.Tensor):
            return p
        buf, ev = self.fetched[p]
        torch.cuda.current_stream().wait_event(ev)
        buf.record_stream(torch.cuda.current_stream())
        _, dtype, shape = self.items[p]
        return buf.view(dtype).view(shape)


def step(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, kind: str, budget: int,
         pinned: torch.Tensor) -> dict[str, float]:
    def minimal() -> torch.autograd.graph.saved_tensors_hooks:
        m = MinOffload(budget, pinned)
        return torch.autograd.graph.saved_tensors_hooks(m.pack, m.unpack)

    scopes = {"none": None, "min": minimal,
              "storm": lambda: storm.offload(mode="embedded", pool_size="8GiB", min_bytes=1 << 20, budget=budget)}
    return timed_step(model, x, opt, scopes[kind])


class Planned:
    """W1 under storm.plan(peak=cap) on a model of its own (the plan sets its blocks' forwards).
    Once the plan has settled, its steps run as storm.plan runs them or, with ``hooks_on``, with
    STORM's hooks left on past the offloaded blocks (as before stop_offloading): the same plan."""

    def __init__(self, cap: float):
        torch.manual_seed(0)
        self.model, self.x = W1.build(torch.device("cuda"))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.planner = storm.plan(self.model.blocks, peak=int(cap * GiB), mode="embedded", pool_size="8GiB",
                                  min_bytes=1 << 20)
        for _ in range(20):  # the traces, the measured planned steps and a trial of two plans
            self.step(False)
            if self.planner.settled:
                break

    def step(self, hooks_on: bool) -> dict[str, float]:
        def scope() -> storm.Offload:
            ctx = self.planner.step()
            if hooks_on:
                ctx.stop_offloading = lambda: False
            return ctx

        return timed_step(self.model, self.x, self.opt, scope)



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.45, 1.0], help="GiB offloaded")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--plan-caps", type=float, nargs="*", default=[], metavar="GiB",
                   help="also storm.plan(peak=cap), its hooks off past the offloaded blocks and left on")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, x = W1.build(torch.device("cuda"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    pinned = torch.empty(4 << 30, dtype=torch.uint8).pin_memory()
    variants = [("none", "none", 0)]
    for b in args.budgets:
        variants += [(f"min-{b:g}", "min", int(b * GiB)), (f"storm-{b:g}", "storm", int(b * GiB))]
    variants.append(("storm-hooks", "storm", 1))
    runs: dict[str, Callable[[], dict[str, float]]] = {
        name: functools.partial(step, model, x, opt, kind, b, pinned) for name, kind, b in variants}
    plans = {}
    for cap in args.plan_caps:
        plans[f"plan-{cap:g}"] = planned = Planned(cap)
        runs[f"plan-{cap:g}"] = functools.partial(planned.step, False)
        runs[f"plan-{cap:g}-hooks-on"] = functools.partial(planned.step, True)
    samples = collections.defaultdict(list)
    for _ in range(args.rounds):  # in turn, so a drifting host drifts for all
        for name, run in runs.items():
            for _ in range(3):
                run()
            samples[name] += [run() for _ in range(args.steps)]
    rows = {name: medians(s) for name, s in samples.items()}
    rows.update({f"{name} plan": plan_summary(planned.planner) for name, planned in plans.items()})
    for name, row in rows.items():
        print(name, row, flush=True)
    for name, f in [("save (pack)", "save"), ("_offload", "_offload"), ("poll", "poll"), ("load (unpack)", "load"),
                    ("_restore", "_restore"), ("_passed", "_passed"),
                    ("end_step", "end_step"), ("drain", "drain")]:
        setattr(session.ClientSession, f, timed(name, getattr(session.ClientSession, f)))
    prefetch.Prefetcher.ahead = timed("prefetch.ahead", prefetch.Prefetcher.ahead)
    transfer.Mover.put = timed("mover.put", transfer.Mover.put)
    transfer.Mover.get = timed("mover.get", transfer.Mover.get)
    gpu.DeviceStreams.to_host = timed("streams.to_host", gpu.DeviceStreams.to_host)
    gpu.DeviceStreams.to_device = timed("streams.to_device", gpu.DeviceStreams.to_device)
    session.consume = timed("consume", session.consume)
    session.record_ready = timed("record_ready", session.record_ready)
    instrumented = {}
    for kind in ("min", "storm"):
        for _ in range(3):
            step(model, x, opt, kind, GiB, pinned)
        spent.clear()
        calls.clear()
        got = [step(model, x, opt, kind, GiB, pinned) for _ in range(args.steps)]
        instrumented[f"{kind}-1"] = {"step": medians(got), "per_function": {
            k: {"calls_per_step": calls[k] / args.steps, "us_per_call": round(spent[k] / calls[k] * 1e6, 1),
                "ms_per_step": round(spent[k] / args.steps * 1e3, 3)} for k in spent}}
        print(f"instrumented {kind}-1", instrumented[f"{kind}-1"], flush=True)
    write(args, {"W1": rows, "instrumented": instrumented})
    return 0


if __name__ == "__main__":
    sys.exit(main())
