"""``stormd``: the per-node activation store daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .config import SOCKET_ENV, DaemonConfig, normalize_endpoint, parse_size
from .pool import PoolError, SharedPool
from .server import Server
from .service import Service

log = logging.getLogger("stormd")


def parse_args(argv: list[str] | None = None) -> DaemonConfig:
    p = argparse.ArgumentParser(prog="stormd", description="STORM activation store daemon (one per node).")
    p.add_argument("--socket", default=None,
                   help=f"path, ipc://PATH or tcp://127.0.0.1:PORT (env {SOCKET_ENV}; "
                        f"default $XDG_RUNTIME_DIR/stormd/stormd.sock or /tmp/stormd-UID/stormd.sock)")
    p.add_argument("--pool-size", default="1GiB", help="host pool size: bytes or e.g. 512MiB, 8GiB (default 1GiB)")
    p.add_argument("--pool-dir", default="/dev/shm", help="tmpfs directory for the pool segment (default /dev/shm)")
    p.add_argument("--client-timeout", type=float, default=10.0,
                   help="seconds without a message (clients ping every second) before a client is dropped")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    try:
        return DaemonConfig(socket=normalize_endpoint(a.socket or os.environ.get(SOCKET_ENV)),
                            pool_size=parse_size(a.pool_size), pool_dir=a.pool_dir,
                            client_timeout=a.client_timeout, log_level=a.log_level)
    except ValueError as e:
        p.error(str(e))


async def run(config: DaemonConfig) -> None:
    pool = SharedPool.create(config.pool_size, config.pool_dir)
    try:
        server = Server(Service(pool), config)
        server.bind()
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        log.info("stormd ready: socket %s, pool %d bytes at %s", config.socket, pool.size, pool.path)
        try:
            await server.serve()
        except asyncio.CancelledError:
            log.info("stormd stopping")
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop has no Windows build; asyncio's loop serves the same protocol
        runner = asyncio.run
    try:
        runner(run(config))
    except (PoolError, PermissionError, RuntimeError, OSError) as e:
        log.error("stormd cannot start: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
