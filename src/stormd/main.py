"""``stormd``: the per-node activation store daemon.

Lifecycle: read the configuration (config.py), allocate the pool, start the
metrics endpoint (if turned on), bind the socket, tell systemd READY=1, serve. SIGTERM,
SIGINT, SIGHUP or ``stormctl drain`` start a drain: new PUTs and HELLOs are
refused while GETs, FREEs and BYEs are answered, until no client holds a
tensor or ``drain_timeout`` passes; then the daemon exits 0, its socket and
pool segment removed. A second signal stops it at once. SIGHUP drains rather
than reloads: most settings (the pool, the socket, the spill file) cannot
change under running clients, and a terminal that closes under a foreground
stormd sends SIGHUP, where a clean stop is what is wanted. New settings take
a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import time
from pathlib import Path

import zmq

from . import logs
from .config import ConfigError, DaemonConfig, add_arguments, load, setting_warnings, to_toml, unknown_environment
from .copier import open_copier
from .limits import check_host
from .metrics import Metrics
from .notify import Notifier
from .server import Server
from .service import Service
from .sessions import SessionLimits
from .store_options import StoreOptions
from .wire.pool import PoolError, SharedPool
from .wire.sizes import format_size

log = logging.getLogger("stormd")

DRAIN_POLL = 0.05     # seconds between checks while draining: short next to any deadline
STATUS_INTERVAL = 2.0  # seconds between systemd STATUS= updates and error-log flushes
METRICS_REVEAL = "clients connected, their traffic and errors, bytes stored, pool size and use, process statistics"


def parse_args(argv: list[str] | None = None) -> tuple[DaemonConfig, bool]:
    """The effective configuration, and whether --print-config was asked for. Exits 2 on a bad setting."""
    p = argparse.ArgumentParser(prog="stormd", description="STORM activation store daemon (one per node). "
                                "Settings: flags > STORMD_* environment > TOML file > defaults.")
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        return load(a), a.print_config
    except ConfigError as e:
        p.error(str(e))


def seconds_since_start() -> float | None:
    """Seconds since this process started, the interpreter's start and imports included (torch's, for
    the CUDA copier, is much of a daemon's start): /proc/self/stat's start time, in clock ticks since
    boot, against CLOCK_BOOTTIME, to the tick. None where there is no such file to read."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22; the split starts at field 3, after the name
    return round(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 3)


def status_line(service: Service) -> str:
    node = service.store.node_stats()
    used = f"pool {format_size(node['used'])} of {format_size(node['capacity'])} used, {node['keys']} tensors"
    if service.draining:
        return f"draining: {len(service.sessions)} clients, {used}"
    return f"serving {len(service.sessions)} clients, {used}"


async def run(config: DaemonConfig, notifier: Notifier | None = None) -> None:
    notifier = notifier or Notifier()
    for warning in check_host(config):  # raises LimitError for what cannot work
        log.warning(warning)
    pool = SharedPool.create(config.pool_size, config.pool_dir)
    service = None
    try:
        error_log = logs.ErrorReplyLog(log, config.error_log_interval)
        cuda = open_copier(pool) if config.cuda_ipc else None
        service = Service(pool, error_log, StoreOptions.from_config(config), codec=config.codec, cuda=cuda,
                          session_limits=SessionLimits(config.max_sessions_per_peer, config.max_sessions))
        metrics = Metrics(service) if config.metrics else None
        server = Server(service, config, observe=metrics.observe if metrics else None)
        server.bind()
        http, metrics_url = await _start_metrics(metrics, config) if metrics else (None, "off")
        try:
            service.startup_s = seconds_since_start()
            log.info("stormd ready", extra={"socket": config.socket, "pool_bytes": pool.size, "pool": pool.path,
                                            "metrics": metrics_url, "startup_s": service.startup_s})
            await _serve(server, service, config, notifier, error_log)
        finally:
            if http is not None:
                http.close()
    finally:
        try:
            if service is not None:
                service.store.close()  # finishes spill I/O, which reads and writes the pool
                if service.cuda is not None:
                    service.cuda.close()  # closes clients' segments, unpins the pool before it is unmapped
        finally:
            pool.close()  # whatever failed above: the segment must not outlive the daemon in /dev/shm


async def _start_metrics(metrics: Metrics, config: DaemonConfig) -> tuple[asyncio.Server | None, str]:
    """The endpoint and its URL, logged with who can read it. A port already taken costs the metrics,
    not the node's offload service."""
    try:
        http = await metrics.serve(config.metrics_address, config.metrics_port)
    except OSError as e:
        log.error("metrics endpoint not started; serving without it", extra={
            "address": config.metrics_address, "port": config.metrics_port, "error": e.strerror or str(e)})
        return None, "off"
    host, port = http.sockets[0].getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
    level, readers = metrics_readers(config.metrics_address)
    log.log(level, "metrics endpoint answers without authentication",
            extra={"url": url, "readable_by": readers, "reveals": METRICS_REVEAL})
    return http, url


def metrics_readers(address: str) -> tuple[int, str]:
    """Who can read the metrics served on ``address``, and the level stormd says so at: a loopback
    address is open to every local user (HTTP carries no uid); any other to whatever reaches it."""
    if ipaddress.ip_address(address).is_loopback:
        return logging.INFO, "any local user"
    return logging.WARNING, f"any local user and any host that reaches {address}"


async def _serve(server: Server, service: Service, config: DaemonConfig, notifier: Notifier,
                 error_log: logs.ErrorReplyLog) -> None:
    serving = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        if service.draining:
            log.warning("second signal while draining: stopping now", extra={"signal": name})
            serving.cancel()
        else:
            service.start_draining(name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig.name)
    notifier.send(READY=1, STATUS=status_line(service))
    helpers = [asyncio.create_task(_stop_after_drain(service, serving, config.drain_timeout, notifier)),
               asyncio.create_task(_report(service, notifier, error_log))]
    if notifier.watchdog_interval:
        helpers.append(asyncio.create_task(_watchdog(notifier, notifier.watchdog_interval)))
    try:
        await serving
    except asyncio.CancelledError:
        pass
    finally:
        for t in helpers:
            t.cancel()
        error_log.flush(everything=True)
    log.info("stormd stopped")


async def _stop_after_drain(service: Service, serving: asyncio.Task, timeout: float, notifier: Notifier) -> None:
    """Once draining, stop the server when no client holds a tensor any more, or at the deadline."""
    while not service.draining:
        await asyncio.sleep(DRAIN_POLL)
    notifier.send(STOPPING=1, STATUS=status_line(service))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while service.store.node_stats()["keys"] and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL)
    keys = service.store.node_stats()["keys"]
    if keys:
        log.warning("drain deadline passed with tensors still stored; stopping",
                    extra={"drain_timeout_s": timeout, "keys": keys, "clients": len(service.sessions)})
    else:
        log.info("drained: no client holds a tensor; stopping", extra={"clients": len(service.sessions)})
    serving.cancel()


async def _report(service: Service, notifier: Notifier, error_log: logs.ErrorReplyLog) -> None:
    while True:
        await asyncio.sleep(STATUS_INTERVAL)
        notifier.send(STATUS=status_line(service))
        error_log.flush()


async def _watchdog(notifier: Notifier, interval: float) -> None:
    """Pinged from the event loop itself, so a loop that hangs stops pinging and systemd restarts it."""
    while True:
        notifier.send(WATCHDOG=1)
        await asyncio.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    config, print_only = parse_args(argv)
    if print_only:
        sys.stdout.write(to_toml(config))
        return 0
    logs.configure(config.log_level, config.log_format)
    for warning in unknown_environment() + setting_warnings(config):
        log.warning(warning)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop has no Windows build; asyncio's loop serves the same protocol
        runner = asyncio.run
    try:
        runner(run(config))
    except (PoolError, PermissionError, RuntimeError, OSError, zmq.ZMQError) as e:
        log.error("stormd cannot start: %s", e, extra={"error": type(e).__name__})
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
