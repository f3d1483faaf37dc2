"""No two live pool extents overlap, whatever the step placement did: the sequence that made a planned
slot land past its region onto another session's tensor, the ledger that refuses such a placement,
random PUT / SEAL / GET / FREE / new-step / BYE traffic from several sessions checked after every
operation, and the symptom with real clients (a trainer keeping an old graph, growing its batch)."""

from __future__ import annotations

import argparse
import copy
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import storm
from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from storm.examples.models import GPT, same_bits
from stormd.allocator import ExtentAllocator
from stormd.config import add_arguments, load
from stormd.ledger import ExtentConflict, ExtentLedger
from stormd.placement import StepPlacement
from stormd.store import Store
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import ErrorCode, ProtocolError

A, B = 1, 2


def checked_store(pool_size: int) -> Store:
    pool = SharedPool.anonymous(pool_size)
    return Store(ExtentAllocator(pool.size), pool, StoreOptions(check_extents=True))


def live_extents(store: Store) -> list[tuple[int, int, str]]:
    """(offset, end, owner) of every entry that holds pool bytes now, all sessions, by offset."""
    align = store.allocator.aligned
    return sorted((e.offset, e.offset + align(e.nbytes), f"session {sid} key {k}")
                  for sid, s in store._sessions.items() for k, e in s.entries.items() if e.offset is not None)


def assert_no_overlap(store: Store) -> None:
    """An oracle independent of the ledger (the entries themselves), then the ledger and the
    allocator: every live extent inside the pool, none overlapping the next, the ledger holding
    exactly those, and the allocator's own invariants."""
    live = live_extents(store)
    for (lo, hi, who), (nlo, nhi, nwho) in zip(live, live[1:]):
        assert hi <= nlo, f"{who} at [{lo}, {hi}) overlaps {nwho} at [{nlo}, {nhi})"
    assert all(0 <= lo and hi <= store.allocator.capacity for lo, hi, _ in live)
    assert store.extents.ledger.extents() == [(lo, hi) for lo, hi, _ in live]
    store.allocator.check()


def write(store: Store, session: int, key: int, value: int) -> None:
    e = store.find(session, key)
    store.pool.view(e.offset, e.nbytes).fill_(value)


def test_planned_slot_never_lands_past_its_region_onto_another_sessions_extent():
    """The issue's sequence: A's small plan keeps its region because one planned tensor stays alive,
    B takes the extent right after that region, A learns a larger step and is planned again. On main
    A's second slot was placed past the old region's end, over B's sealed tensor, and A's write
    changed B's bytes."""
    store = Store(ExtentAllocator(1 << 20), SharedPool.anonymous(1 << 20))  # as stormd runs: no ledger
    small, large = 4096, 8192
    store.put(A, put_fields(10, small, step=1))  # step 1: one small tensor, the recorded step
    store.free(A, step=1)
    store.put(A, put_fields(20, small, step=2))  # planned: the region of step 1's footprint is taken
    store.put(A, put_fields(21, small, step=2))  # two slots the plan does not have: misses
    store.put(A, put_fields(22, small, step=2))
    assert store.session_stats(A)["plan_hits"] == 1 and store.session_stats(A)["plan_misses"] == 2
    region = store.find(A, 20).offset
    store.free(A, keys=[21, 22])  # key 20 stays alive (its graph was kept), so does the region
    store.put(B, put_fields(1, 4 * large))  # right after A's region
    assert store.find(B, 1).offset == region + small
    write(store, B, 1, 0xBB)
    store.seal(B, 1, None)
    for k in (30, 31):  # step 3 (the plan was dropped: more misses than hits): two large tensors
        store.put(A, put_fields(k, large, step=3))
    store.free(A, step=3)
    store.put(A, put_fields(40, large, step=4))  # planned again; slot 0 is still held by key 20
    store.put(A, put_fields(41, large, step=4))  # slot 1's planned offset lies past the old region
    write(store, A, 41, 0xAA)
    b = store.find(B, 1)
    assert bool((store.pool.view(b.offset, b.nbytes) == 0xBB).all()), "A's write changed B's stored bytes"
    a = store.find(A, 41)
    assert a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
    store.drop_session(A)
    store.drop_session(B)
    store.allocator.check()
    assert store.allocator.stats().used == 0


def test_ledger_refuses_an_overlapping_or_outside_placement_and_a_release_of_what_was_not_placed():
    ledger = ExtentLedger(1 << 16)
    ledger.place(4096, 4096, "key 1 of session 1")
    ledger.place(0, 4096, "key 2 of session 1")  # touching is not overlapping
    with pytest.raises(ExtentConflict, match=r"key 3 of session 2 placed at \[6144, 10240\) overlaps "
                                             r"key 1 of session 1 at \[4096, 8192\)"):
        ledger.place(6144, 4096, "key 3 of session 2")
    ledger.place(16384, 4096, "key 5 of session 1")
    with pytest.raises(ExtentConflict, match=r"overlaps key 5 of session 1 at \[16384, 20480\)"):
        ledger.place(12288, 12288, "key 3 of session 2")  # covers all of key 5
    with pytest.raises(ExtentConflict, match=r"outside the pool of 65536 bytes"):
        ledger.place(61440, 8192, "key 4 of session 2")
    with pytest.raises(ExtentConflict, match=r"release of \[4096, 6144\) but the ledger holds key 1 of session 1"):
        ledger.release(4096, 2048)
    with pytest.raises(ExtentConflict, match=r"release of \[8192, 12288\) but the ledger holds nothing"):
        ledger.release(8192, 4096)
    assert ledger.extents() == [(0, 4096), (4096, 8192), (16384, 20480)]  # refused calls recorded nothing
    ledger.release(4096, 4096)
    assert ledger.extents() == [(0, 4096), (16384, 20480)]


@pytest.mark.parametrize("env,checked", [({}, False), ({"STORMD_CHECK_EXTENTS": "1"}, True)])
def test_stormd_keeps_a_ledger_only_when_check_extents_is_set(env, checked):
    """Off by default (it costs time on every PUT and FREE); tests' daemons turn it on through the
    environment (conftest.start_daemon)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    config = load(p.parse_args(["--socket", "/tmp/unused.sock"]), {"XDG_CONFIG_HOME": "/nonexistent", **env})
    store = Store(ExtentAllocator(1 << 16), None, StoreOptions.from_config(config))
    assert (store.extents.ledger is not None) is checked


class MisplacingPlacement(StepPlacement):
    """A step placement with a placement bug: while ``wrong`` is set it answers that offset for every
    tensor (and records what is given back to it instead of releasing it)."""

    def __init__(self, allocator: ExtentAllocator):
        super().__init__(allocator)
        self.wrong: int | None = None
        self.given_back: list[int] = []

    def place(self, step: int, slot: int, size: int, room: int | None = None) -> int | None:
        return self.wrong if self.wrong is not None else super().place(step, slot, size, room)

    def release(self, offset: int) -> None:
        if self.wrong is not None:
            self.given_back.append(offset)
        else:
            super().release(offset)


def test_a_checked_store_refuses_a_placement_over_a_live_tensor_and_keeps_its_bytes():
    """Whatever places a tensor wrongly (here a placement made to answer an occupied offset), the
    store with check_extents refuses that PUT, gives the extent back and the tensor there keeps
    its bytes; the session's later PUTs still work."""
    placements: list[MisplacingPlacement] = []

    def placement(allocator: ExtentAllocator) -> MisplacingPlacement:
        placements.append(MisplacingPlacement(allocator))
        return placements[-1]

    pool = SharedPool.anonymous(1 << 16)
    store = Store(ExtentAllocator(pool.size), pool, StoreOptions(check_extents=True), placement=placement)
    store.put(B, put_fields(1, 4096))
    write(store, B, 1, 0xBB)
    taken = store.find(B, 1).offset
    store.open_session(A)
    bad = placements[-1]
    bad.wrong = taken
    with pytest.raises(ExtentConflict, match=rf"key 7 of session {A} placed at \[{taken}, {taken + 4096}\) "
                                             rf"overlaps key 1 of session {B}"):
        store.put(A, put_fields(7, 4096))
    assert store.find(A, 7) is None and bad.given_back == [taken]
    assert bool((store.pool.view(taken, 4096) == 0xBB).all())
    bad.wrong = None
    store.put(A, put_fields(7, 4096))
    assert_no_overlap(store)


class _Trainer:
    """One session's state in the random traffic: the step it is in, forward (saving) or backward
    (fetching and freeing the latest saved first), the keys of this step in PUT order, and keys of
    old steps it keeps alive (a graph kept past its step)."""

    def __init__(self, sid: int):
        self.sid, self.step, self.scale, self.count = sid, 0, 1, 6
        self.forward = True
        self.saved: list[int] = []
        self.kept: list[int] = []

    def size(self, slot: int, rng: random.Random) -> int:
        """Sizes repeat per slot from step to step (so plans hit), now and then a little off."""
        return self.scale * (512 + (slot * 1531) % 4096) + (rng.choice([1, 700]) if rng.random() < 0.05 else 0)

    def next_step(self, rng: random.Random) -> None:
        self.step, self.forward, self.saved = self.step + 1, True, []
        if rng.random() < 0.1:  # the batch grows or shrinks, or the model saves more or fewer tensors
            self.scale, self.count = rng.choice([1, 2, 3, 5]), rng.randrange(1, 13)


def random_traffic(store: Store, rng: random.Random, operations: int, sessions: int) -> dict[str, int]:
    """Random operations from ``sessions`` clients, each training in steps: forward PUTs (and SEALs),
    backward GETs and FREEs, sometimes keeping a tensor of an old step alive for many steps, changing
    its sizes now and then, freeing whole steps, or leaving (BYE) and coming back. After every
    operation no two live extents may overlap. Returns how often each kind ran."""
    ran: dict[str, int] = {}
    trainers = [_Trainer(sid) for sid in range(1, sessions + 1)]
    next_key = 0

    def count(kind: str) -> None:
        ran[kind] = ran.get(kind, 0) + 1

    for _ in range(operations):
        t = rng.choice(trainers)
        sid, r = t.sid, rng.random()
        if r < 0.002:
            store.drop_session(sid)  # BYE: the session comes back later under the same id, empty
            t.__init__(sid)
            count("bye")
        elif r < 0.02 and t.kept:
            store.free(sid, keys=[t.kept.pop(rng.randrange(len(t.kept)))])
            count("free kept")
        elif t.forward:
            next_key += 1
            try:
                store.put(sid, put_fields(next_key, t.size(len(t.saved), rng), step=t.step))
            except ProtocolError as e:  # a full pool; any other refusal is a bug
                assert e.code == ErrorCode.POOL_FULL, e
                count("put refused")
                t.forward = False  # the client keeps the rest of this step's tensors itself
            else:
                t.saved.append(next_key)
                if rng.random() < 0.95:
                    store.seal(sid, next_key, None)
                count("put")
            t.forward = t.forward and len(t.saved) < t.count
        elif t.saved and rng.random() < 0.05:  # the whole step freed at once (an aborted step)
            store.free(sid, step=t.step)
            t.kept = [k for k in t.kept if store.find(sid, k) is not None]
            t.next_step(rng)
            count("free step")
        elif t.saved:  # backward: the latest saved, fetched when sealed, then freed or kept alive
            k = t.saved.pop()
            if store.find(sid, k).sealed:
                try:
                    store.get(sid, k)
                    count("get")
                except ProtocolError as e:
                    # with spill on, a spilled key is read back into the pool: when every tensor there
                    # is still being written out or was fetched, there is no room yet (how far the
                    # spill thread has got decides which); any other refusal is a bug
                    assert e.code == ErrorCode.POOL_FULL, e
                    count("get refused")
            if rng.random() < 0.02:
                t.kept.append(k)
                count("kept alive")
            else:
                store.free(sid, keys=[k])
                count("free key")
        else:
            t.next_step(rng)
            count("new step")
        assert_no_overlap(store)
    return ran


def test_random_traffic_from_several_sessions_never_overlaps_live_extents():
    """14,000 operations across 4 sessions over a pool small enough to fill, with the step placement
    at work (plans made, hit, missed, dropped and remade); after every one the live extents are
    checked against each other, the ledger and the allocator. On main the step placement put a slot past
    its region within a few thousand operations (over another session's tensor, or past the pool)."""
    store = checked_store(256 << 10)
    ran = random_traffic(store, random.Random(1), operations=14_000, sessions=4)
    assert sum(ran.values()) - ran.get("new step", 0) >= 10_000, ran
    node = store.node_stats()
    assert node["plan_hits"] > 1000 and node["plan_misses"] > 100, (node, ran)
    assert ran.get("put refused", 0) > 0 and ran["bye"] > 10 and ran["kept alive"] > 10, ran
    for sid in range(1, 5):
        store.drop_session(sid)
    assert store.extents.ledger.extents() == [] and store.allocator.stats().used == 0
    store.allocator.check()


def test_random_traffic_with_spill_never_overlaps_live_extents(tmp_path):
    """The same traffic with spill on: extents also leave the pool for the spill file and come back
    elsewhere (on GET or prefetch), and the ledger follows them there."""
    pool = SharedPool.anonymous(256 << 10)
    store = Store(ExtentAllocator(pool.size), pool,
                  StoreOptions(spill_dir=str(tmp_path), spill_limit=4 << 20, check_extents=True))
    ran = random_traffic(store, random.Random(2), operations=5000, sessions=4)
    node = store.node_stats()
    assert node["spilled_total"] > 0 and node["read_back_total"] > 0 and node["plan_hits"] > 0, (node, ran)
    for sid in range(1, 5):
        store.drop_session(sid)
    store.close()
    assert store.extents.ledger.extents() == [] and store.allocator.stats().used == 0


SECOND_TRAINER = textwrap.dedent("""
    import sys, torch, storm
    from storm.examples.models import GPT
    torch.manual_seed(1)
    m = GPT(seq_len=16, d_model=32, n_heads=2, n_layers=2)
    idx = torch.randint(0, 256, (2, 17))
    for _ in sys.stdin:  # one training step per line, so the two trainers take turns
        try:
            with storm.offload(mode="daemon", socket=sys.argv[1], min_bytes=0):
                loss = m.loss(idx[:, :-1], idx[:, 1:])
            loss.backward()
            print("ok", flush=True)
        except Exception as e:
            print(type(e).__name__, str(e).replace(chr(10), " "), flush=True)
""")


def test_a_trainer_keeping_an_old_graph_and_growing_its_batch_beside_another(tmp_path):
    """The issue's real-client symptom: one process keeps one step's graph alive and later grows its
    batch while a second process trains, taking turns step by step through one daemon. On main the
    first trainer's later steps failed with StormIntegrityError (its planned slots were placed past
    its old region, over extents handed out since); with check_extents on (as in every test daemon)
    the ledger would refuse such a placement, so the daemon must also have answered no INTERNAL."""
    d = start_daemon(tmp_path, "--pool-size", "16MiB", "--metrics", "--metrics-port", "0")
    other = subprocess.Popen([sys.executable, "-c", SECOND_TRAINER, d.endpoint], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        torch.manual_seed(0)
        model = GPT(seq_len=16, d_model=32, n_heads=2, n_layers=2)
        reference = copy.deepcopy(model)
        kept = []
        for step in range(10):
            idx = torch.randint(0, 256, (2 if step < 6 else 8, 17))
            torch.manual_seed(step)  # the same dropout masks in the reference
            with storm.offload(mode="daemon", socket=d.endpoint, min_bytes=0):
                loss = model.loss(idx[:, :-1], idx[:, 1:])
            if step == 2:
                kept.append(loss)  # this step's graph (and its stored tensors) stays alive
            else:
                loss.backward()
                torch.manual_seed(step)
                reference.loss(idx[:, :-1], idx[:, 1:]).backward()
                for a, b in zip(reference.parameters(), model.parameters()):
                    assert same_bits(a.grad, b.grad), f"step {step}: gradient differs"
            other.stdin.write("step\n")
            other.stdin.flush()
            said = other.stdout.readline().strip()
            assert said == "ok", f"step {step}: the second trainer failed: {said or 'it exited'}"
        watcher = RawClient(d.endpoint)
        watcher.hello()
        node = watcher.call("STATS")["node"]
        watcher.close()
        assert node["plan_hits"] > 0 and "INTERNAL" not in node["errors"], (node["errors"], d.output())
    finally:
        other.stdin.close()  # the second trainer says BYE and exits at the end of its input
        try:
            other.wait(60)
        except subprocess.TimeoutExpired:
            other.kill()
            raise
        finally:
            storm.close_all()
            stop_daemon(d)
