"""A bare ZeroMQ client for speaking (and mis-speaking) the protocol to stormd in tests."""

from __future__ import annotations

import itertools
import os
import socket

import torch
import zmq
from torch import nn

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
        return unpack(self.sock.recv())

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


def relu_mlp() -> tuple[nn.Module, torch.Tensor]:
    """A model whose saved activations are half zeros (ReLU outputs): every codec has work to do."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)), \
        torch.randn(512, 256)
