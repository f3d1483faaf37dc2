"""Which store storm.offload uses (mode daemon, auto, embedded) and what it does when the store
has no room: the tensors stay on their device, gradients stay bit-identical, and it says so once."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

import storm
from helpers import assert_same_grads


def test_embedded_pool_full_keeps_tensors_on_their_device_and_says_so_once(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    x = torch.randn(256, 128)
    with caplog.at_level(logging.WARNING, logger="storm"):
        assert_same_grads(model, lambda m: m(x).square().sum(), {"mode": "embedded", "min_bytes": 0,
                                                                  "pool_size": "300KiB"})
        with storm.offload(mode="embedded", min_bytes=0, pool_size="300KiB") as ctx:
            loss = model(x).square().sum()
        # the mover's replies decide what was kept: read before backward, which would take each save
        # from its tensor, so a copy the mover had not begun would be dropped, never refused
        ctx.synchronize()
        loss.backward()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1 and ctx.stats.offloaded >= 1
    said = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(said) == 1 and "no room" in said[0] and "pool_size" in said[0], said  # two steps, one line


def test_a_full_embedded_pool_names_no_daemon_setting(caplog):
    """The embedded store runs stormd's store code, whose POOL_FULL names stormd's spill
    settings; a storm.offload user cannot set those."""
    x = torch.randn(64 * 1024, requires_grad=True)  # 256 KiB saves: four fill the pool
    with caplog.at_level(logging.WARNING, logger="storm"):
        with storm.offload(mode="embedded", min_bytes=0, pool_size="1MiB") as ctx:
            y = x
            for _ in range(6):
                y = y.exp()
        ctx.synchronize()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1
    said = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(said) == 1 and "does not spill" in said[0] and "spill_dir" not in said[0], said


def test_saves_the_store_refused_go_without_the_garbage_collector():
    """A refusal's traceback runs through the frames that saved the tensor (the embedded store
    answers on the training thread) and through the put's, which hold its storage: kept where
    the traceback's frames could reach them, each step's refused saves stayed on the device
    until the garbage collector ran."""
    from torch.multiprocessing.reductions import StorageWeakRef

    lin = nn.Linear(256, 256)
    saved = []
    gc.disable()
    try:
        for _ in range(3):
            x = torch.randn(64, 256, requires_grad=True)
            with storm.offload(mode="embedded", min_bytes=0, pool_size="16KiB") as ctx:
                h = torch.relu(lin(x))  # relu and tanh save their outputs: what the store refuses
                saved.append(StorageWeakRef(h.untyped_storage()))
                y = torch.tanh(lin(h))
            del h
            ctx.synchronize()  # every refusal read (a copy not begun before backward would be dropped)
            assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1
            y.sum().backward()
            del y
        ctx.synchronize()  # the tensors are the session's to let go of now
        assert [r.expired() for r in saved] == [True, True, True]
    finally:
        gc.enable()


def test_daemon_pool_full_keeps_tensors(small_daemon):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(64, 64)
    opts = {"mode": "daemon", "socket": small_daemon.endpoint, "min_bytes": 0}
    assert_same_grads(model, lambda m: m(x).square().sum(), opts)
    with storm.offload(**opts) as ctx:
        loss = model(x).square().sum()
    ctx.synchronize()
    loss.backward()
    assert ctx.stats.kept.get(storm.Keep.POOL_FULL, 0) >= 1


def test_mode_daemon_without_daemon_fails_clearly(env_without_socket):
    with pytest.raises(storm.StormUnavailable, match="no stormd socket"):
        with storm.offload(mode="daemon"):
            pass


def test_auto_falls_back_to_embedded_and_says_so_once(env_without_socket, caplog):
    lin = nn.Linear(64, 64)
    with caplog.at_level(logging.INFO, logger="storm"):
        for _ in range(3):
            with storm.offload(min_bytes=0) as ctx:
                lin(torch.randn(32, 64)).sum().backward()
    assert ctx.backend_name == "embedded store"
    lines = [r.getMessage() for r in caplog.records if r.name == "storm"]
    assert len(lines) == 1 and "embedded store" in lines[0], lines


def test_auto_uses_a_running_daemon(daemon, monkeypatch):
    monkeypatch.setenv("STORMD_SOCKET", daemon.endpoint)
    with storm.offload(min_bytes=0) as ctx:
        nn.Linear(8, 8)(torch.randn(4, 8)).sum().backward()
    assert ctx.backend_name.startswith("stormd at " + daemon.endpoint)


def test_stats_names_the_store_it_reports(daemon, env_without_socket):
    """Issue 53, item 4: which store storm.stats() counts for, a daemon or the embedded store."""
    assert storm.stats(socket=daemon.endpoint)["store"].startswith(f"stormd at {daemon.endpoint} (session ")
    store = storm.stats()["store"]  # no daemon at $STORMD_SOCKET
    assert store.startswith("embedded store (") and "pool" in store and "in place of" not in store, store


def test_mode_auto_looks_for_a_daemon_again_only_once_the_probe_interval_has_passed(tmp_path):
    """Without a daemon, each step of mode='auto' would check the socket's directory and file
    again (a daemon started later is used): after a look that found none, the next is
    PROBE_INTERVAL_S later, on the clock given."""
    from conftest import start_daemon, stop_daemon
    from storm import backend

    socket, now = str(tmp_path / "run" / "stormd.sock"), [100.0]
    clock = lambda: now[0]  # noqa: E731
    d = None
    try:
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("embedded store")
        d = start_daemon(tmp_path, "--pool-size", "1MiB")
        now[0] += backend.PROBE_INTERVAL_S - 0.5
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("embedded store")
        # mode='daemon' looks whenever asked: it would raise rather than fall back
        assert backend.open_backend("daemon", socket, clock=clock).store.startswith("stormd at ")
        storm.close_all()
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("stormd at ")  # none absent now
        storm.close_all()
        d.proc.kill()
        d.proc.wait()
        d = None
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("embedded store")  # a stale socket
        d = start_daemon(tmp_path, "--pool-size", "1MiB")
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("embedded store")
        now[0] += backend.PROBE_INTERVAL_S
        assert backend.open_backend("auto", socket, clock=clock).store.startswith("stormd at ")
    finally:
        storm.close_all()
        if d is not None:
            stop_daemon(d)


def test_mode_auto_looks_again_after_the_interval_where_a_daemon_could_not_be_used_either(caplog):
    """A tcp:// endpoint where nothing answers fails a look only at the connect timeout (2 s), and a
    daemon that refuses the session counts as none: neither is looked for at each step; the
    warning is said once."""
    from storm import backend
    from storm.errors import StormUnavailable

    looks, now = [], [0.0]

    def connect(endpoint: str):
        looks.append(endpoint)
        raise StormUnavailable(f"no stormd answered at {endpoint} within 2 s")

    endpoint = "tcp://127.0.0.1:9"
    try:
        with caplog.at_level(logging.INFO, logger="storm"):
            for t in (0.0, 1.0, backend.PROBE_INTERVAL_S - 0.01, backend.PROBE_INTERVAL_S, 7.0):
                now[0] = t
                assert backend.open_backend("auto", endpoint, clock=lambda: now[0], connect=connect).store \
                    .startswith("embedded store")
        assert looks == [endpoint, endpoint]  # at 0 and at the interval's end, none between
        said = [r for r in caplog.records if r.name == "storm"]
        assert len(said) == 1 and said[0].levelno == logging.WARNING and "no stormd answered" in said[0].getMessage()
        with pytest.raises(StormUnavailable, match="no stormd answered"):  # mode='daemon' looks whenever asked
            backend.open_backend("daemon", endpoint, clock=lambda: now[0], connect=connect)
        assert len(looks) == 3
    finally:
        storm.close_all()
