"""Prometheus metrics of the daemon, served over HTTP from its own event loop.

Counters are read from the Service when Prometheus scrapes, on the loop that
also mutates them, so a scrape never sees a half-updated store (prometheus_client's
own ``start_http_server`` would read them from another thread while the loop
changes them). The store's node counters (spill, read-back, spill errors, step
placement) are exported beside the traffic, as ``stormctl status`` (STATS,
``node``) reports them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from .service import Service
from .wire.protocol import ALL_ERROR_CODES, OPS

log = logging.getLogger("stormd")

# Requests are answered in microseconds to milliseconds; the top buckets catch a stalled loop.
LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1.0)
REQUEST_HEAD_TIMEOUT = 5.0
# Connections answered at once; one more is closed at once, unanswered. Any local user can connect,
# and each connection holds a descriptor of the daemon's (which its clients' sockets need too) and a
# read buffer until its request head comes: uncapped, connections opened faster than that took them all.
MAX_CONNECTIONS = 64


class Metrics:
    def __init__(self, service: Service):
        self.registry = CollectorRegistry()
        self.latency = Histogram("stormd_request_duration_seconds",
                                 "Time from receiving a request to sending its reply, by op "
                                 "(op=invalid: not a known op)", ["op"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        # every series exists from the start, so rate() has a baseline; kept by op, as labels() looks
        # its child up again on each call and observe() runs once per request on the daemon's loop
        self._latency_of = {op: self.latency.labels(op) for op in (*OPS, "invalid")}
        self.registry.register(_ServiceCollector(service))
        ProcessCollector(registry=self.registry)
        self._open = 0  # connections being answered

    def observe(self, op: str, seconds: float) -> None:
        self._latency_of[op].observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, host: str, port: int) -> asyncio.Server:
        """Start the HTTP endpoint (GET /metrics) on the running loop."""
        return await asyncio.start_server(self._handle, host, port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()  # unanswered: a reply would wait for its request head, as a connection in the cap does
            return
        self._open += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_HEAD_TIMEOUT)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
            if method not in ("GET", "HEAD"):
                status, body = "405 Method Not Allowed", b"only GET /metrics\n"
            elif target.split("?", 1)[0] not in ("/metrics", "/"):
                status, body = "404 Not Found", b"metrics are at /metrics\n"
            else:
                status, body = "200 OK", self.exposition()
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that sends no complete request head gets nothing
        finally:
            self._open -= 1
            writer.close()


class _ServiceCollector:
    def __init__(self, service: Service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service
        t = s.traffic
        node = s.store.node_stats()
        yield _counter("stormd_puts", "Tensors stored (successful PUTs)", t.puts)
        yield _counter("stormd_gets", "Tensors handed back (successful GETs)", t.gets)
        yield _counter("stormd_bytes_in", "Bytes of the tensors clients stored", t.bytes_in)
        yield _counter("stormd_bytes_out", "Bytes handed back to clients", t.bytes_out)
        yield _counter("stormd_busy_seconds", "Seconds the event loop spent answering requests", t.busy_s)
        yield _counter("stormd_stored_bytes", "Bytes the pool took for the tensors stored (after the codec)",
                       t.stored_bytes)
        yield _gauge("stormd_compression_ratio", "bytes_in / stored_bytes since start (NaN before the first PUT)",
                     t.bytes_in / t.stored_bytes if t.stored_bytes else math.nan)
        yield _gauge("stormd_pool_capacity_bytes", "Size of the host pool", node["capacity"])
        yield _gauge("stormd_pool_used_bytes", "Bytes of the pool in extents now", node["used"])
        yield _gauge("stormd_pool_peak_used_bytes", "Most bytes of the pool in extents at once", node["peak"])
        yield _gauge("stormd_pool_fragmentation", "1 - largest free extent / free bytes", node["fragmentation"])
        yield _gauge("stormd_pool_page_locked_bytes", "Bytes of the pool stormd page-locked for CUDA copies (0: none)",
                     s.pool.page_locked_bytes)
        yield _gauge("stormd_pool_page_lock_seconds", "Seconds page-locking the pool took at start (0: none locked)",
                     s.page_lock_s or 0.0)
        yield _gauge("stormd_startup_seconds", "Seconds from the process's start to serving (NaN before it serves)",
                     math.nan if s.startup_s is None else s.startup_s)
        yield _gauge("stormd_pool_free_extents", "Free extents of the pool", node["free_extents"])
        yield _gauge("stormd_pool_largest_free_bytes", "The largest free extent of the pool", node["largest_free"])
        yield _gauge("stormd_spill_capacity_bytes", "Size of the spill file (0: spill off)", node["spill_capacity"])
        yield _gauge("stormd_spilled_bytes", "Bytes of the tensors held now that are in the spill file",
                     node["spilled_bytes"])
        yield _counter("stormd_spill_written_bytes", "Bytes written to the spill file", node["spilled_total"])
        yield _counter("stormd_spill_read_back_bytes", "Bytes read back from the spill file", node["read_back_total"])
        yield _counter("stormd_spill_read_backs_on_get", "Read-backs a GET had to wait for (prefetch came too late)",
                       node["read_back_on_get"])
        yield _counter("stormd_spill_prefetches", "Read-backs started before their GET", node["prefetched"])
        yield _counter("stormd_spill_write_errors", "Writes to the spill file that failed (their tensors stayed "
                       "in the pool)", node["spill_write_errors"])
        yield _counter("stormd_spill_read_errors", "Read-backs from the spill file that failed (those tensors' "
                       "bytes are lost)", node["spill_read_errors"])
        yield _counter("stormd_plan_hits", "Tensors placed at their step's planned offset", node["plan_hits"])
        yield _counter("stormd_plan_misses", "Tensors of planned steps that went to the general allocator",
                       node["plan_misses"])
        yield _gauge("stormd_keys", "Tensors held now, all clients", node["keys"])
        yield _gauge("stormd_clients", "Connected client sessions", len(s.sessions))
        yield _gauge("stormd_draining", "1 while draining for shutdown", int(s.draining))
        yield _gauge("stormd_cuda_segments", "Clients' GPU memory segments open through CUDA IPC",
                     s.cuda.open_segments() if s.cuda is not None else 0)
        errors = CounterMetricFamily("stormd_errors", "Error replies by code", labels=["code"])
        for code in sorted(ALL_ERROR_CODES):
            errors.add_metric([code], s.errors.get(code, 0))
        yield errors


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
