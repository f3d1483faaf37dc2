"""What several test files share: a bare ZeroMQ client for speaking (and mis-speaking) the protocol to
stormd, gradients with and without storm.offload, small models, a fake put, and running bench/ scripts."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch
import zmq
from torch import nn

import storm
from storm.copies.base import Route
from storm.examples.models import same_bits
from stormd.wire.protocol import PROTOCOL_VERSION, pack, unpack


class RawClient:
    def __init__(self, endpoint: str, timeout_ms: int = 5000):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)
        self.auth: dict = {}

    def send_frames(self, *frames: bytes) -> dict:
        self.sock.send_multipart(list(frames))
        return self.recv()

    def recv(self) -> dict:
        """The next reply, past the daemon's unasked messages (probe: true; a probe asks whether this
        socket is still there, whenever some client socket disconnects; STOPPING), which clients drop."""
        return unpack(self.recv_frame())

    def recv_frame(self) -> bytes:
        """recv()'s reply as its frame came."""
        while unpack(frame := self.sock.recv()).get("probe"):
            pass
        return frame

    def call(self, op: str, **fields) -> dict:
        msg = {"op": op, "id": next(self.ids), **self.auth, **fields}
        return self.send_frames(pack(msg))

    def hello(self) -> dict:
        r = self.call("HELLO", version=PROTOCOL_VERSION, pid=os.getpid(), host=socket.gethostname())
        assert r["ok"], r
        self.auth = {"session": r["session"], "token": r["token"]}
        return r

    def close(self) -> None:
        self.sock.close(linger=0)


def put_fields(key: int, nbytes: int, step: int = 1) -> dict:
    return {"key": key, "step": step, "nbytes": nbytes, "dtype": "uint8", "shape": [nbytes], "strides": [1],
            "storage_offset": 0, "codec": "raw"}


def offload_one_step(**options) -> storm.Offload:
    """One small training step through storm.offload with ``options``; its context."""
    lin = torch.nn.Linear(64, 64)
    with storm.offload(min_bytes=0, **options) as ctx:
        loss = lin(torch.randn(16, 64)).tanh().sum()
    loss.backward()
    return ctx


def relu_mlp() -> tuple[nn.Module, torch.Tensor]:
    """A model whose saved activations are half zeros (ReLU outputs): every codec has work to do."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)), \
        torch.randn(512, 256)


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


def chain_of_saves(n: int = 6):
    """n tanh layers of 64 KiB outputs each: every output is saved by the next op."""
    x = torch.randn(128, 128, requires_grad=True)
    h = x
    for _ in range(n):
        h = h.tanh()
    return x, h.sum()


def chain_grad(x: torch.Tensor, n: int = 6) -> torch.Tensor:
    x2 = x.detach().requires_grad_()
    h = x2
    for _ in range(n):
        h = h.tanh()
    h.sum().backward()
    return x2.grad



BENCH = Path(__file__).resolve().parent.parent / "bench"
PROVENANCE = {"device", "torch", "date", "commit", "command"}  # what every benchmark's JSON "meta" holds


# the bench/ modules that scripts import by name, each after those before it
BENCH_SHARED = ("common", "summary", "trace_gaps")


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py imported as the module ``name``, for tests of a script's functions. A script
    run as ``python bench/<name>.py`` has bench/ on its path and imports its siblings (BENCH_SHARED)
    by name; here those are loaded the same way first, so no test edits sys.path."""
    for shared in BENCH_SHARED[:BENCH_SHARED.index(name) if name in BENCH_SHARED else None]:
        bench_module(shared)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_bench(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python bench/<script> *args``, as a user runs it; its output captured as text."""
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout)


def bench_result(path: Path) -> dict:
    """A benchmark's JSON, checked to say which code produced it, where and how."""
    result = json.loads(path.read_text())
    meta = result["meta"]
    assert PROVENANCE <= set(meta), meta
    assert meta["commit"] and meta["command"].split()[1].endswith(".py"), meta
    return result


class Put:
    """A put (the copy queue's view of one) that finishes when waited for, saying so in ``waited``."""

    def __init__(self, key: int = 0, waited: list[int] | None = None):
        self.key, self.waited, self.finished = key, waited if waited is not None else [], False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True
        self.waited.append(self.key)


@contextlib.contextmanager
def puts_held_back(session) -> Iterator[threading.Event]:
    """Within: the session's puts to the host wait until the yielded event is set (their saves stay
    HELD, on the device, until then)."""
    handler = session.mover._handlers[Route.HOST]
    gate, real = threading.Event(), handler._put

    def held_back(req):
        gate.wait(timeout=60)
        return real(req)

    handler._put = held_back
    try:
        yield gate
    finally:
        gate.set()
        handler._put = real
