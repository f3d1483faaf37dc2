"""The Prometheus metrics export the store's node counters: spill (bytes both ways, errors both ways),
read-backs, and the step placement's hits and misses, read from the registry after spill I/O on a disk
of the test's own (SpillIO) failed."""

from __future__ import annotations

import asyncio
import math

import pytest
from test_faults_spill import FailingDisk

import stormd.metrics as metrics_module
from helpers import put_fields
from stormd.entries import Where
from stormd.metrics import Metrics
from stormd.service import Service
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import ErrorCode, ProtocolError

KIB = 1024

# metric (as exposed, with the counters' _total) -> the STATS ``node`` field it exports
NODE_METRICS = {
    "stormd_spill_written_bytes_total": "spilled_total",
    "stormd_spill_read_back_bytes_total": "read_back_total",
    "stormd_spill_read_backs_on_get_total": "read_back_on_get",
    "stormd_spill_prefetches_total": "prefetched",
    "stormd_spill_write_errors_total": "spill_write_errors",
    "stormd_spill_read_errors_total": "spill_read_errors",
    "stormd_plan_hits_total": "plan_hits",
    "stormd_plan_misses_total": "plan_misses",
    "stormd_spilled_bytes": "spilled_bytes",
    "stormd_spill_capacity_bytes": "spill_capacity",
    "stormd_pool_free_extents": "free_extents",
    "stormd_pool_largest_free_bytes": "largest_free",
}


def test_failed_spill_writes_and_reads_are_exported_with_every_node_counter(spill_dir):
    disk = FailingDisk()
    pool = SharedPool.anonymous(64 * KIB)
    service = Service(pool, store_options=StoreOptions(spill_dir=spill_dir, spill_limit=1 << 20, spill_io=disk))
    store = service.store
    metrics = Metrics(service)
    try:
        disk.full = True
        for key in range(1, 5):  # the pool fills up; background spill's write fails
            store.put(1, put_fields(key, 16 * KIB))
            store.seal(1, key, None)
        store.spiller.reap(block=True)
        assert metrics.registry.get_sample_value("stormd_spill_write_errors_total") == 1
        disk.full = False
        for key in range(5, 8):  # each PUT spills one to make room, now successfully
            store.put(1, put_fields(key, 16 * KIB))
            store.seal(1, key, None)
        store.spiller.reap(block=True)
        spilled = [e for e in (store.find(1, k) for k in range(1, 8)) if e.where == Where.SPILLED]
        disk.bad.update(e.file_offset for e in spilled)  # reading any of them back fails now
        store.free(1, keys=[7, 6])  # room in the pool: prefetch reads back (and loses) the latest spilled
        with pytest.raises(ProtocolError) as lost:
            store.get(1, spilled[0].key)
        assert lost.value.code == ErrorCode.SPILL_FAILED
        store.spiller.reap(block=True)
        node = store.node_stats()
        assert node["spill_write_errors"] == 1 and node["spill_read_errors"] >= 1 and node["spilled_total"] > 0
        for metric, field in NODE_METRICS.items():
            assert metrics.registry.get_sample_value(metric) == node[field], metric
    finally:
        store.close()
        pool.close()


def test_the_page_locked_pool_and_the_start_up_are_gauges():
    """Issue 54: what the daemon page-locked (what register_pool recorded of the pool), how long that
    took (0: stormd makes no CUDA copies, nothing locked) and how long its start took (NaN until it serves)."""
    pool = SharedPool.anonymous(64 * KIB)
    service = Service(pool)
    metrics = Metrics(service)
    try:
        def gauge(name: str) -> float | None:
            return metrics.registry.get_sample_value(name)

        assert gauge("stormd_pool_page_locked_bytes") == 0 and gauge("stormd_pool_page_lock_seconds") == 0
        assert math.isnan(gauge("stormd_startup_seconds"))
        service.startup_s = 2.5
        pool.cuda_ranges.append((0, 64 * KIB))  # as a cudaHostRegister of the whole pool records it
        assert gauge("stormd_startup_seconds") == 2.5
        assert gauge("stormd_pool_page_locked_bytes") == 64 * KIB == service.node_stats()["page_locked_bytes"]
    finally:
        pool.cuda_ranges.clear()
        service.store.close()
        pool.close()


async def _scrape(port: int) -> bytes:
    """One GET /metrics: the whole response, the server closing the connection after it (b"": closed
    unanswered, which a request the server did not read makes a reset)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_the_endpoint_answers_at_most_max_connections_at_once_and_closes_the_rest_at_once(monkeypatch):
    """Any local user reaches the endpoint (docs/security.md), and each connection held the daemon's
    descriptor and a read buffer until its request head came (REQUEST_HEAD_TIMEOUT): without a cap,
    connections opened faster than that took descriptors stormd needs for its clients."""
    monkeypatch.setattr(metrics_module, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(metrics_module, "REQUEST_HEAD_TIMEOUT", 600.0)  # no idle connection is let go meanwhile
    pool = SharedPool.anonymous(64 * KIB)
    service = Service(pool)
    http = await Metrics(service).serve("127.0.0.1", 0)
    port = http.sockets[0].getsockname()[1]
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]  # send nothing
    try:
        assert await _scrape(port) == b""  # closed at once: the read's 30 s are not waited for
        idle[0][1].close()  # its place is given back once the endpoint sees it closed
        deadline = asyncio.get_running_loop().time() + 30
        while not (answer := await _scrape(port)).startswith(b"HTTP/1.1 200 "):
            assert asyncio.get_running_loop().time() < deadline, answer[:200]
            await asyncio.sleep(0.01)
        assert b"stormd_keys" in answer
    finally:
        for _, writer in idle:
            writer.close()
        http.close()
        await http.wait_closed()
        service.store.close()
        pool.close()
