"""The embedded store's pool without a pool_size: it grows on demand, in place, up to a cap from the
host's free memory and memory cgroup, which the host's embedded stores share; past the cap, or when
a growth fails, POOL_FULL with the reason.

The host (room=, ledger=), the growth itself (extend=) and the pool's start (initial=, min_step=)
are parameters of EmbeddedStore, so these tests run on a host and a pool of their own.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

import storm
from storm.embedded import EmbeddedStore
from storm.examples.models import same_bits
from storm.policy import Keep, Policy
from storm.session import ClientSession
from stormd.growth import GROWTH_ALIGNMENT, GROWTH_SHARE
from stormd.limits import host_room
from stormd.wire.cuda import locking_s, record_locking

MiB = 1 << 20
PUT = dict(step=1, dtype="uint8", shape=[1], strides=[1], storage_offset=0, codec="raw")


def small_host(cap: int = 16 * MiB, source: str = "a test's cgroup"):
    return lambda: (cap, source)


def store(cap: int = 16 * MiB, **host) -> EmbeddedStore:
    return EmbeddedStore(None, room=small_host(cap), initial=2 * MiB, min_step=2 * MiB, **host)


def put(e: EmbeddedStore, key: int, nbytes: int) -> int:
    return e.request("PUT", key=key, nbytes=nbytes, **PUT).result()["offset"]


def test_tensors_stored_before_a_growth_keep_their_offsets_and_bytes():
    e = store()
    try:
        assert e.pool.size == 2 * MiB
        first = [put(e, k, MiB // 2) for k in (1, 2, 3)]
        for k, off in zip((1, 2, 3), first):
            e.pool.view(off, MiB // 2).fill_(k)
            e.request("SEAL", key=k, checksum=None).result()
        e.pool.view(put(e, 4, 3 * MiB), 3 * MiB).fill_(255)  # does not fit in 2 MiB: the pool grows
        assert e.pool.size > 2 * MiB
        assert e.request("STATS").result()["node"]["capacity"] == e.pool.size  # stats report the capacity now
        for k, off in zip((1, 2, 3), first):
            got = e.request("GET", key=k).result()
            assert got["offset"] == off
            assert torch.equal(e.pool.view(off, MiB // 2), torch.full((MiB // 2,), k, dtype=torch.uint8))
    finally:
        e.close()


def test_each_growth_adds_a_quarter_so_the_pool_stays_within_a_quarter_of_what_it_holds():
    """What a growth adds past the step's need stays page-locked: the pool grows by a quarter of its
    size (GROWTH_SHARE), at least min_step and what the PUT needs, so a pool grown to hold N bytes
    holds at most a quarter more (and a growth's alignment), where doubling left up to N unused."""
    e = store(cap=1 << 30)
    try:
        sizes = [e.pool.size]
        for k in range(1, 81):  # 40 MiB in halves of a MiB
            put(e, k, MiB // 2)
            sizes.append(e.pool.size)
        grown = sorted(set(sizes))
        for a, b in zip(grown, grown[1:]):  # each growth: a quarter, at least min_step, rounded up to whole pages
            assert 0 <= b - a - max(a // GROWTH_SHARE, 2 * MiB) < GROWTH_ALIGNMENT
        assert 40 * MiB <= e.pool.size <= 40 * MiB * (GROWTH_SHARE + 1) // GROWTH_SHARE + GROWTH_ALIGNMENT
        put(e, 81, 20 * MiB)  # more than a quarter: the growth is what the PUT needs
        assert e.pool.size >= 60 * MiB
    finally:
        e.close()


def test_the_cap_bounds_the_pool_and_is_named_in_the_log_line_and_in_pool_full():
    e = store(cap=8 * MiB)
    try:
        assert "8MiB" in e.pool_text and "a test's cgroup" in e.pool_text
        for k in range(1, 8):
            put(e, k, MiB)
        with pytest.raises(storm.StormRequestError, match="POOL_FULL.*cap of 8MiB.*a test's cgroup"):
            put(e, 9, 2 * MiB)
        assert e.pool.size == 8 * MiB
    finally:
        e.close()


def test_a_growth_that_fails_is_pool_full_naming_why_and_leaves_the_pool_as_it_was():
    def no_memory(pool, size):
        raise OSError(12, "Cannot allocate memory")

    e = store(extend=no_memory)
    try:
        put(e, 1, MiB)
        with pytest.raises(storm.StormRequestError, match="POOL_FULL.*Cannot allocate memory"):
            put(e, 2, 2 * MiB)
        assert e.pool.size == 2 * MiB
        put(e, 3, MiB // 2)  # what still fits is stored
    finally:
        e.close()


def test_a_given_pool_size_stays_fixed():
    e = EmbeddedStore(2 * MiB, room=small_host())
    try:
        put(e, 1, MiB)
        with pytest.raises(storm.StormRequestError, match="POOL_FULL"):
            put(e, 2, 2 * MiB)
        assert e.pool.size == 2 * MiB
    finally:
        e.close()


def test_a_given_pool_size_past_what_the_host_can_give_is_refused_naming_it_and_the_bound():
    """The pool is a lazy mapping: 10 TiB mapped at once on a 24 GB host, and the OOM killer came
    when training filled it. stormd refuses such a pool at start; so does the embedded store."""
    with pytest.raises(ValueError, match=r"pool_size 32MiB is more than this host can give a pool now "
                                         r"\(16MiB: a test's cgroup\).*STORM_POOL_SIZE"):
        EmbeddedStore(32 * MiB, room=small_host())


def test_the_cap_is_free_ram_less_headroom_or_the_cgroup_room_when_lower():
    info = {"MemTotal": 64 << 30, "MemAvailable": 40 << 30}
    cap, source = host_room(lambda: info, lambda: None)
    assert cap < 40 << 30 and "MemAvailable" in source
    cap, source = host_room(lambda: info, lambda: 4 << 30)
    assert cap < 4 << 30 and "cgroup" in source


def elementwise_chain(width: int) -> tuple[nn.Module, torch.Tensor]:
    """Saves one float tensor of ``width`` elements per layer (cheap on CPU)."""
    torch.manual_seed(0)

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(width) * 0.1 + 1)

        def forward(self, x):
            return torch.tanh(x * self.w)

    return nn.Sequential(*[Scale() for _ in range(8)]), torch.randn(width)


def run_step(session: ClientSession, model: nn.Module, x: torch.Tensor):
    step, policy = session.new_step(), Policy(min_bytes=0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: session.save(t, step, policy), session.load):
        loss = model(x).square().sum()
    session.end_step(step)
    # every copy done before backward: a CPU copy the mover has not begun when backward takes its
    # tensor is dropped (copies_dropped), and on a loaded machine the puts that grow the pool or
    # meet its cap would not be made at all
    session.synchronize()
    loss.backward()
    session.synchronize()
    return step.stats


def test_a_step_larger_than_the_first_pool_stores_every_tensor_with_the_same_gradients():
    model, x = elementwise_chain(MiB // 4)  # 1 MiB per saved tensor, 16 saved: far above the first 2 MiB
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    session = ClientSession(store(cap=64 * MiB))
    try:
        stats = run_step(session, model, x)
        assert set(stats.kept) == {Keep.PARAMETER} and stats.offloaded > 0, stats  # parameters stay by policy
        assert session.backend.pool.size > 2 * MiB
    finally:
        session.close()
        session.backend.close()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert same_bits(a.grad, b.grad), name


def test_past_the_cap_tensors_stay_on_their_device_with_the_same_gradients():
    model, x = elementwise_chain(MiB // 4)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    session = ClientSession(store(cap=4 * MiB))
    try:
        stats = run_step(session, model, x)
        assert stats.kept.get(Keep.POOL_FULL, 0) > 0, stats
        assert session.backend.pool.size == 4 * MiB
    finally:
        session.close()
        session.backend.close()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert same_bits(a.grad, b.grad), name


def test_storm_offload_without_a_pool_size_grows_past_the_first_pool(caplog):
    """The default: no pool_size, no $STORM_POOL_SIZE. A step saving more than the pool's start
    is stored whole, and the log line that announces the embedded store names the cap."""
    from stormd.embedded import INITIAL_POOL
    model, x = elementwise_chain(INITIAL_POOL // 4 // 4)  # 8 saves of a quarter of the start each
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    with caplog.at_level(logging.INFO, logger="storm"):
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            model(x).square().sum().backward()
    assert set(ctx.stats.kept) == {Keep.PARAMETER}, ctx.stats
    said = [r.getMessage() for r in caplog.records if "embedded store" in r.getMessage()]
    assert any("grows on demand up to" in line for line in said), said
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert same_bits(a.grad, b.grad), name


@pytest.mark.gpu
@pytest.mark.parametrize("floats", [MiB // 4, 3 * MiB // 16], ids=["saves-fill-the-pool", "saves-leave-a-free-tail"])
def test_on_cuda_each_growth_of_the_page_locked_pool_is_page_locked_and_unlocked_at_close(floats):
    """The first CUDA copy page-locks the pool; each growth after it page-locks what it adds
    (stormd.wire.cuda.grow_pool), so every extent is DMA-able; close unlocks every range, so a new
    pool mapped at the same address can be locked again. Saves of 3/4 MiB leave a free tail at each
    growth, which no extent may join to the new range (CUDA refuses a copy spanning two locked
    ranges: the save stayed on the device)."""
    model, x = elementwise_chain(floats)
    model, x = model.cuda(), x.cuda()
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    for _ in range(2):  # the second store's page-lock fails if the first left a range locked
        session = ClientSession(store(cap=64 * MiB))
        pool = session.backend.pool
        try:
            model.zero_grad(set_to_none=True)
            stats = run_step(session, model, x)
            assert set(stats.kept) == {Keep.PARAMETER} and stats.offloaded > 0, stats
            assert stats.lock_s > 0  # the packs' page-locking, on the training thread: counted apart
            assert pool.cuda_registered and len(pool.cuda_ranges) > 1, pool.cuda_ranges
            assert sum(n for _, n in pool.cuda_ranges) == pool.size
        finally:
            session.close()
            session.backend.close()
        assert pool.cuda_ranges == []
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            assert same_bits(a.grad, b.grad), name


# The embedded stores of one host share one cap (stormd/host_share.py): each test here has a ledger
# of its own (conftest: _own_ledger), so its stores share with one another alone.

def test_embedded_stores_of_one_host_together_stay_within_one_cap_and_say_with_what():
    """Eight ranks without a daemon each took the whole of free memory as their cap, and together
    grew past it to meet the OOM killer instead of POOL_FULL."""
    a, b = store(), store()
    try:
        put(a, 1, 7 * MiB)  # grows a to 10 MiB of the 16
        put(b, 1, 4 * MiB)  # grows b to 6 MiB, the rest of the 16
        with pytest.raises(storm.StormRequestError, match=r"POOL_FULL.*cap of 6MiB \(16MiB: a test's cgroup.*"
                                                          r"shared with 1 other embedded store .*holds 10MiB"):
            put(b, 2, 3 * MiB)
        assert a.pool.size + b.pool.size <= 16 * MiB
        assert "shared with the other embedded stores of this user on this host" in a.pool_text
        assert "(1 other embedded store now)" in b.pool_text
    finally:
        a.close()
        b.close()


def test_a_closed_stores_share_goes_to_the_others():
    a, b = store(), store()
    try:
        put(a, 1, 7 * MiB)
        a.close()
        put(b, 1, 12 * MiB)
        assert b.pool.size > 6 * MiB
    finally:
        b.close()


DIES_HOLDING_10_MIB = """
import sys
from storm.embedded import EmbeddedStore
e = EmbeddedStore(None, room=lambda: (16 << 20, "a test's cgroup"), initial=2 << 20, min_step=2 << 20,
                  ledger=sys.argv[1])
e.request("PUT", key=1, nbytes=7 << 20, step=1, dtype="uint8", shape=[1], strides=[1], storage_offset=0,
          codec="raw").result()
print(e.pool.size, flush=True)
sys.stdin.read()
"""


def test_a_dead_stores_share_returns_to_the_others():
    """A store killed with its entry still in the ledger: the kernel let go of its lock, and the
    next growth of another store removes the entry and counts its bytes as free."""
    from stormd import host_share
    root = host_share.LEDGER_ROOT
    proc = subprocess.Popen([sys.executable, "-c", DIES_HOLDING_10_MIB, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == str(10 * MiB)
        b = store()
        try:
            with pytest.raises(storm.StormRequestError, match="POOL_FULL.*holds 10MiB"):
                put(b, 1, 12 * MiB)
            proc.kill()
            proc.wait(60)

            def entries() -> list[str]:
                return sorted(p.name for p in (Path(root) / f"storm-embedded-{os.getuid()}").iterdir()
                              if p.name.startswith("store-"))

            assert len(entries()) == 2  # the dead store's entry stays until a live one looks
            put(b, 2, 8 * MiB)
            assert b.pool.size > 6 * MiB and len(entries()) == 1
        finally:
            b.close()
    finally:
        proc.kill()
        proc.wait(60)


def test_each_growth_reads_free_memory_again():
    free = [16 * MiB]
    e = EmbeddedStore(None, room=lambda: (free[0], "MemAvailable now"), initial=2 * MiB, min_step=2 * MiB)
    try:
        put(e, 1, MiB)
        free[0] = MiB  # the host's memory went elsewhere since the store started: less than a growth's step
        with pytest.raises(storm.StormRequestError, match=r"POOL_FULL.*cap of 2MiB \(its 2MiB and what the host "
                                                          r"can give now: MemAvailable now"):
            put(e, 2, 2 * MiB)
        assert e.pool.size == 2 * MiB
    finally:
        e.close()


@pytest.mark.parametrize("ledger", ["missing", "symlink", "writable by others"])
def test_without_a_ledger_of_its_own_a_store_keeps_its_own_cap_and_says_why(tmp_path, ledger):
    root = tmp_path / "shm"
    own = root / f"storm-embedded-{os.getuid()}"
    if ledger != "missing":
        root.mkdir()
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        if ledger == "symlink":
            own.symlink_to(elsewhere, target_is_directory=True)  # whoever owns it could repoint it
        else:
            own.mkdir()
            own.chmod(0o777)
    e = store(ledger=str(root))
    try:
        said = {"missing": f"{root} does not exist", "symlink": f"refusing the ledger {own}",
                "writable by others": f"refusing the ledger {own}: it belongs to uid {os.getuid()} with mode 0o777"}
        assert f"not shared with other embedded stores: {said[ledger]}" in e.pool_text, e.pool_text
        put(e, 1, 12 * MiB)  # the cap is its own
        if ledger == "symlink":
            assert list(elsewhere.iterdir()) == []
    finally:
        e.close()



def locking_extend(pool, size):
    """A growth whose page-locking says it took 3 s, on the thread that grows the pool."""
    pool.grow(size)
    record_locking(3.0)


def test_page_locking_is_counted_per_thread_as_it_grows_the_pool():
    """A client leaves a growth's page-locking out of the host time it reads per save (a cold
    process's first step grows the pool at nearly every block, about a second per GiB, and
    storm.plan's trace read the host's time per save many times too high): the counter is the
    thread's own, so the mover's growths are not taken off the training thread's time."""
    e = store(cap=64 * MiB, extend=locking_extend)
    try:
        before = locking_s()
        put(e, 1, 4 * MiB)  # grows the 2 MiB pool, on this thread
        assert locking_s() - before == 3.0
        elsewhere = ThreadPoolExecutor(1)
        assert elsewhere.submit(lambda: (put(e, 2, 16 * MiB), locking_s())[1]).result() == 3.0
        elsewhere.shutdown()
        assert locking_s() - before == 3.0
    finally:
        e.close()


def test_a_cpu_save_s_pack_takes_nothing_off_for_the_mover_s_growths():
    """CPU saves are PUT on the mover's thread: the growths there are not the packs' (lock_s stays
    0) and take nothing off their time."""
    e = store(cap=64 * MiB, extend=locking_extend)
    session = ClientSession(e)
    try:
        step = session.new_step()
        x = torch.randn(1 << 20, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: session.save(t, step, Policy(0)), session.load):
            y = (x.exp() * 2).exp().sum()
        session.end_step(step)
        session.synchronize()
        assert e.pool.size > 2 * MiB  # grown, on the mover's thread
        assert step.stats.packs == step.stats.offloaded > 0 and step.stats.lock_s == 0 and step.stats.pack_s > 0
        y.backward()
    finally:
        session.close()
        e.close()
