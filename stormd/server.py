"""The daemon's transport: one ZeroMQ ROUTER socket on an asyncio (uvloop) loop.

Every frame is decoded and handed to ``Service``; each gets exactly one reply.
Clients that stop sending (no heartbeat within ``client_timeout``) or that the
socket can no longer reach are dropped and everything they held is freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from .config import DaemonConfig, ensure_private_dir, ipc_path, socket_is_live
from .protocol import OPS, ErrorCode, ProtocolError, pack, unpack
from .service import Service

log = logging.getLogger("stormd")


class Server:
    def __init__(self, service: Service, config: DaemonConfig,
                 observe: Callable[[str, float], None] | None = None):
        self.service = service
        self.config = config
        self.observe = observe  # (op, seconds to answer) per request, for the latency histogram
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None

    def bind(self) -> None:
        path = ipc_path(self.config.socket)
        if path is not None:
            ensure_private_dir(path.parent)
            if path.exists():
                if socket_is_live(path):
                    raise RuntimeError(f"{path}: another stormd is serving this socket; stop it first")
                log.warning("removing stale socket %s (its daemon is gone)", path)
                path.unlink()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.config.socket)
        if path is not None:
            path.chmod(0o600)
        self._sock = sock

    async def serve(self) -> None:
        """Answer requests until cancelled; then release the socket."""
        assert self._sock is not None, "bind() first"
        reaper = asyncio.create_task(self._reap_silent_clients())
        try:
            while True:
                frames = await self._sock.recv_multipart()
                self._answer(frames)
        finally:
            reaper.cancel()
            self.close()

    def _answer(self, frames: list[bytes]) -> None:
        started = time.perf_counter()
        peer = frames[0]
        op = "invalid"  # a bounded label set: the known ops and this
        if len(frames) != 2:
            reply = self.service.refuse(0, ProtocolError(ErrorCode.BAD_MESSAGE,
                                                         f"expected one frame per message, got {len(frames) - 1}"))
        else:
            try:
                msg = unpack(frames[1])
                if isinstance(msg, dict) and msg.get("op") in OPS:
                    op = msg["op"]
                reply = self.service.handle_message(msg, peer)
            except ProtocolError as e:
                reply = self.service.refuse(0, e)
        self._send(peer, reply)
        if self.observe is not None:
            self.observe(op, time.perf_counter() - started)

    def _send(self, peer: bytes, reply: dict) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([peer, pack(reply)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                for s in self.service.sessions.by_peer(peer):
                    self.service.end_session(s, "its socket is gone")
            else:  # EAGAIN: the client does not read its replies; it will time out and retry
                log.warning("reply to a client dropped: %s", e)

    async def _reap_silent_clients(self) -> None:
        timeout = self.config.client_timeout
        while True:
            await asyncio.sleep(max(timeout / 4, 0.05))
            for s in self.service.sessions.silent_since(time.monotonic() - timeout):
                self.service.end_session(s, f"no message for {timeout:g} s")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            path = ipc_path(self.config.socket)
            if path is not None:
                path.unlink(missing_ok=True)
        self._ctx.term()

