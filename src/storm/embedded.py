"""The embedded store: stormd's Service and pool inside the training process.

It is what ``mode='auto'`` falls back to when no daemon answers, so a new user
gets offload with nothing to start. Requests run through the daemon's store
code, minus ZeroMQ and minus the schema check that guards the daemon from
other processes (these come from this library, in this process); they
complete at once. Without a pool_size its pool grows on demand
(stormd/growth.py).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from typing import Any

from stormd.embedded import close_service, embedded_service, pool_text
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, Request

from .replies import Resolved


class EmbeddedStore:
    alive = True  # nothing to lose: it lives and dies with this process
    loss = None

    def __init__(self, pool_size: int | None, **host: Any):
        """``pool_size``: the pool's fixed size; None: it grows on demand up to a cap from free host
        memory, shared by the embedded stores of the host. ``host``: embedded_service's stand-ins for
        the host and the growth (room=, extend=, initial=, min_step=, ledger=; tests)."""
        self.service = embedded_service(pool_size, **host)
        self.pool: SharedPool = self.service.pool
        self.pool_text = pool_text(self.service)  # its size, or how it grows and up to what cap
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the mover thread and the training thread both call in
        hello = self.request("HELLO", version=PROTOCOL_VERSION, pid=os.getpid(), host=socket.gethostname()).result()
        self._auth = {"session": hello["session"], "token": hello["token"]}
        self.session = hello["session"]
        self.codec = hello["codec"]
        self.cuda_devices = frozenset()  # CUDA IPC cannot open memory in the process that made it
        self.name = "embedded store"
        self.store = f"embedded store ({self.pool_text})"

    def request(self, op: str, **fields: Any) -> Resolved:
        if op != "HELLO":
            fields.update(self._auth)
        with self._lock:
            reply = self.service.handle_message(Request(op, next(self._ids), fields))
        return Resolved.reply(reply)

    def close(self) -> None:
        self.request("BYE")
        close_service(self.service)
