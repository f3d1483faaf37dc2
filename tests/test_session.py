"""storm/session.py: a session closed under its saves, and one whose store is lost moving on to the one in its place."""

from __future__ import annotations

import time

import pytest
import torch

import storm
import storm.session as session_mod
from helpers import puts_held_back
from storm.copies.base import Landed
from storm.embedded import EmbeddedStore
from storm.policy import Policy
from storm.saved import Step


def test_close_all_before_backward_is_storm_unavailable_saying_what_happened():
    """The store's bytes go with close_all(): backward got 'cannot schedule new futures after
    shutdown' from the mover's executor, and saves after it inside the context the same."""
    x = torch.randn(64, 64, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0):
        loss = x.exp().sum()
    storm.close_all()
    with pytest.raises(storm.StormUnavailable, match="close_all.*once backward has run"):
        loss.backward()
    with pytest.raises(storm.StormUnavailable, match="close_all.*inside this step's context"):
        with storm.offload(mode="embedded", min_bytes=0):
            h = x.exp()
            storm.close_all()
            h.exp()
    with storm.offload(mode="embedded", min_bytes=0) as ctx:  # a new session after that
        loss = x.exp().sum()
    loss.backward()
    assert ctx.stats.offloaded == 1


def lose(store) -> None:
    """``store`` stands in for a daemon's connection that has just found its daemon killed."""
    from storm.errors import KILLED, DaemonLoss  # here: what the tests before need not

    store.loss = DaemonLoss("ipc:///run/stormd.sock", KILLED, time.time(), "5 s")


def test_saves_after_the_store_is_lost_go_to_the_store_in_its_place_the_held_ones_too():
    """In the step that finds its store lost: the save still held for it is stored again in the store
    in its place, as is every save after; each key is fetched from the store that holds it."""
    first, second = EmbeddedStore(4 << 20), EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(first, reopen=lambda: second)
    x = torch.randn(64, 64, requires_grad=True)
    x.exp().tanh().sum().backward()
    want, x.grad = x.grad, None
    try:
        step = session.new_step()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: session.save(t, step, Policy(0)), session.load):
            h = x.exp()  # its put is held until a poll sees it landed: none comes before the loss
            lose(first)
            y = h.tanh().sum()
        session.end_step(step)
        session.synchronize()  # every put landed: backward takes none from its tensor
        y.backward()
        assert torch.equal(x.grad, want)
        assert step.stats.offloaded == 2 and not step.stats.kept, step.stats
        assert session.backend is second and first.service.store.session_stats(first.session)["keys"] == 0
        assert second.service.store.session_stats(second.session)["puts"] == 2
    finally:
        session.close()
        first.close()
        second.close()


def test_a_tensor_the_lost_daemon_held_fails_with_its_loss_once_its_store_is_let_go():
    first, second = EmbeddedStore(4 << 20), EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(first, reopen=lambda: second)
    x = torch.randn(64, 64, requires_grad=True)
    try:
        step = session.new_step()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: session.save(t, step, Policy(0)), session.load):
            y = x.exp().sum()
        session.end_step(step)
        session.synchronize()  # released: its bytes are first's alone now
        lose(first)
        first.alive = False  # its connection closed: the next step lets it go, pool and all
        session.use(second)  # as session_for does, open_backend having given it in first's place
        session.new_step()
        with pytest.raises(storm.StormUnavailable, match="stormd at ipc:///run/stormd.sock stopped: it last answered"):
            y.backward()
    finally:
        session.close()
        second.close()


def test_a_storage_every_layer_saves_again_does_not_stop_prefetch_where_its_last_layer_unpacks_it():
    """A model's rotary tables are made once, before the first layer, and saved again by every layer:
    the last layer's backward unpacks them first. Prefetch goes on from that save's place in forward,
    not from where the storage was first saved: it used to jump there, fetch the first layer's saves
    and nothing more for the rest of backward."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    one = 64 * 64 * 4
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes=2 * one) as ctx:  # two saves ahead
        table = x.sin()  # made once; every layer's product saves it
        h = x
        for _ in range(6):
            h = (h * table).tanh()
        loss = h.sum()
    session = ctx._session
    session.synchronize()  # every copy in: backward fetches each save back, ahead or on demand
    session.poll()
    loss.backward()
    stats = ctx.stats
    assert stats.offloaded == 7 and stats.fetched == 7  # the table and each layer's tanh, each fetched once
    # all come ahead of their unpack but backward's first, the table too: it is fetched at its last
    # layer's save (Step.saved_again), where its first save's place came last of all (5 of 7), and
    # before that prefetch stopped where the last layer unpacked the table (2 of 7)
    assert stats.prefetch_hits == 6, stats


def test_a_save_is_routed_with_the_name_of_the_op_that_made_it(monkeypatch):
    """The mover chooses an upcast frame for a conversion's output alone (storm/frames.py): the
    session hands it each save's producer, its grad_fn's name, or a view's base's: the bytes a
    view's save stores are its base's."""
    session = storm.registry.session_for("embedded", None, None)
    seen: list[str] = []
    real = session.mover.route

    def route(source, dtype, codec, producer="", refused=()):
        seen.append((producer, refused))
        return real(source, dtype, codec, producer, refused)

    monkeypatch.setattr(session.mover, "route", route)
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0):
        loss = x.float().pow(2).sum()  # pow saves the conversion's output
        loss = loss + x.float().reshape(-1).pow(3).sum()  # and a view of it
    loss.backward()
    assert seen == [("ToCopyBackward0", frozenset())] * 2  # no frame of its kind overflowed


def test_a_put_that_raises_leaves_nothing_of_its_save_and_the_next_step_offloads(monkeypatch):
    """A PUT refused on the training thread (the request raised): the save's error reaches the
    forward, and neither the step nor a later poll holds a save that never went (a handle made
    before the put, let go of, had no copy to cancel)."""
    import gc

    session = storm.registry.session_for("embedded", None, None)
    real, refused = session.mover.put, []

    def put(req):
        if not refused:
            refused.append(req.key)
            raise RuntimeError("PUT refused")
        return real(req)

    monkeypatch.setattr(session.mover, "put", put)
    x = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match="PUT refused"):
        with storm.offload(mode="embedded", min_bytes=0) as ctx:
            x.tanh()
    assert ctx.saves == () and ctx.stats.offloaded == 0
    gc.collect()
    session.poll()  # raised AttributeError on the dead handle's missing copy
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        loss = x.tanh().sum()
    loss.backward()
    plain = x.detach().clone().requires_grad_()
    plain.tanh().sum().backward()
    assert ctx.stats.offloaded == 1 and torch.equal(x.grad, plain.grad)


def test_a_fraction_budget_goes_by_steps_that_ran_their_forward_and_saved():
    """budget=0.5 is half of the last step that offloaded all it would have: a forward that raised
    part-way, or an evaluation under no_grad (nothing saved), is not such a step; they made later
    steps offload a fraction of part of a forward, or of nothing, for good."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)])
    x = torch.randn(32, 64)

    def step(body) -> int:
        try:
            with storm.offload(mode="embedded", min_bytes=0, budget=0.5) as ctx:
                loss = body()
            if loss is not None:
                loss.backward()
        except ValueError:
            pass
        return ctx.stats.offloaded_bytes

    def raises():
        model[0](x)
        raise ValueError("a bad batch")

    def evaluation():
        with torch.no_grad():
            model(x)

    full = step(lambda: model(x).sum())  # the first step offloads all
    half = step(lambda: model(x).sum())
    assert 0 < half <= full // 2
    step(raises)
    step(evaluation)
    assert step(lambda: model(x).sum()) == half


def test_a_save_found_modified_while_its_put_runs_frees_its_key_once_the_put_lands():
    """An in-place change found at unpack while the save's put still runs: the error is raised, and
    once the handles are gone and the put lands, its key is freed (it was forgotten as if its put
    had been cancelled, and the store kept the key for good)."""
    session = storm.registry.session_for("embedded", None, None)
    with puts_held_back(session):
        a = torch.randn(4096, requires_grad=True)
        with storm.offload(mode="embedded", min_bytes=0, max_held_bytes=1 << 30):
            b = a * 2
            c = b.sin()  # saves b: its put waits at the gate
            b.add_(1)
            loss = c.sum()
        with pytest.raises(storm.StormInPlaceError):
            loss.backward()
        del loss, c, b
        session.poll()  # the handles are gone while the put still runs
    session.synchronize()
    assert session.mover.request("STATS").result(timeout=30)["session"]["keys"] == 0


def test_an_older_save_forgotten_leaves_the_dedup_slot_of_its_storage_s_later_save():
    """A storage saved, changed in place, saved again: the first save's handles die (its branch of
    the graph went) and it is forgotten, and a third save of the storage still finds the second
    (the forget took the storage's slot, whoever's it was, and the storage was stored twice)."""
    w = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        h = torch.randn(256, 256) * 1.0
        y = h * w  # saves h
        h.add_(1)
        a = h * w  # saves h again: a new save of the changed storage
        del y      # the first save's handle dies
        (w * 2).exp()  # a save: its poll forgets the first
        b = h * w  # the second save's storage, unchanged since: the same save
        loss = (a + b).sum()
    loss.backward()
    assert ctx.stats.deduplicated == 1 and ctx.stats.offloaded == 3
    plain = w.detach().clone().requires_grad_()
    h2 = h.detach()
    (h2 * plain + h2 * plain).sum().backward()
    assert torch.equal(w.grad, plain.grad)


class Overflowed(Landed):
    def incomplete(self) -> bool:
        return True


class Begun:
    """A put as one on a CUDA stream or copied by stormd is: begun, so no longer cancellable, and (with
    ``unfinished``) read as running until something waits for it, however long ago it finished."""

    def __init__(self, copy, unfinished: bool = False, overflowed: bool = False):
        self.copy, self.waited, self.overflowed = copy, not unfinished, overflowed

    def result(self):
        """With ``overflowed``: a frame whose escapes did not all fit (frames are CUDA's)."""
        landed = self.copy.result()
        return Overflowed(landed.nbytes) if self.overflowed else landed

    def done(self) -> bool:
        return self.waited and self.copy.done()

    def wait(self) -> None:
        self.waited = True
        self.copy.wait()

    def cancel(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self.copy, name)


def test_a_let_go_save_comes_back_though_an_older_saves_copy_finishes_after_its_own():
    """A compiled graph's save let go of (its tensor dropped) is unpacked while an older save's copy, on
    another stream or route, still runs: the session lets saves go in the order they came, so the
    unpack waits for the older copy too. It read the dropped tensor (AttributeError on None)."""
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    try:
        step = session.new_step()
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        older = session.save(a, step, Policy(0))
        older.stored.copy_in = Begun(older.stored.copy_in, unfinished=True)
        expected = b.clone()
        handle = session.let_go(session.save(b, step, Policy(0), compiled=True))
        b.fill_(float("nan"))  # the graph reuses the memory it let go of
        assert torch.equal(session.load(handle), expected)
        assert torch.equal(session.load(older), a)
    finally:
        session.close()
        store.close()


def test_a_save_no_handle_holds_is_not_stored_again_when_its_store_is_lost():
    """Autograd let go of a save whose put had begun, and its store's daemon stopped before the put was
    seen landed: nothing needs it, so it is not stored again in the store in its place."""
    first, second = EmbeddedStore(4 << 20), EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(first, reopen=lambda: second)
    try:
        step = session.new_step()
        handle = session.save(torch.randn(64, 64), step, Policy(0))
        stored = handle.stored
        stored.copy_in = Begun(stored.copy_in, unfinished=True)
        del handle  # autograd frees the graph
        session.poll()  # the handle's drop is counted: the put has begun, so its save waits for it
        lose(first)
        session.synchronize()
        assert second.service.store.session_stats(second.session)["puts"] == 0
        assert first.service.store.session_stats(first.session)["keys"] == 0
    finally:
        session.close()
        first.close()
        second.close()


def test_a_step_starts_its_room_under_the_session_s_lock():
    """Another thread's save follows and changes the rooms under the session's lock (threads running
    forwards at once share the session): a step's start changes them too, so under the same lock."""
    import threading
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    start_step, taken = session.rooms.start_step, []

    def starting(step) -> None:  # another thread tries the lock while the room is chosen
        t = threading.Thread(target=lambda: taken.append(session._lock.acquire(blocking=False)))
        t.start()
        t.join()
        start_step(step)

    session.rooms.start_step = starting
    try:
        session.new_step()
        assert taken == [False]
    finally:
        session.close()
        store.close()


def test_copies_past_a_budget_run_behind_by_the_last_completed_forward_s_saves_past_it():
    """The copy queue past a budget may hold what the step before saved past its own (CopyQueue.limit):
    that is the last forward of its kind (its first save: here a tensor's shape) that completed, as
    for fraction budgets, not one that raised part-way."""
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    first = torch.randn(16, 16)

    def begun(*args, **kwargs) -> Step:
        """A step, its kind told by its first save."""
        step = session.new_step(*args, **kwargs)
        session.save(first, step, Policy(0))
        return step

    try:
        for completed, past in ((True, 50), (False, 7)):
            step = begun(1 << 20)
            step.budget_reached, step.past_budget_bytes = True, past
            session.end_step(step, completed=completed)
        assert begun(1 << 20).past_budget_before == 50
        assert begun().past_budget_before == 50  # a budget may come mid-step: offload_at_most
        assert begun(full_offload=False).past_budget_before == 0  # storm.plan's: the plan's queue
        other = session.new_step(1 << 20)
        session.save(torch.randn(8, 8), other, Policy(0))
        assert other.past_budget_before == 0  # another kind's step saved nothing past a budget
        within = begun(1 << 20)  # a smaller batch: its forward stays within the budget
        session.end_step(within)
        assert begun(1 << 20).past_budget_before == 0  # it saved nothing past it: no leeway from before
        session.synchronize()
    finally:
        session.close()
        store.close()


def test_a_fraction_budget_s_first_step_offloads_all_but_is_no_full_offload_step():
    """budget=0.5 with no step before it offloads every save (nothing to take half of), but it is not a
    full-offload step: rooms.py profiles none of its steps (a profile costs one of a process's
    MAX_PROFILES reads of the allocator), and its copy queue keeps a budget's limit."""
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    try:
        first = session.new_step(0.5)
        assert first.budget_bytes == float("inf") and not first.full_offload and first.profile is None
        full = session.new_step()
        assert full.full_offload and full.profile is not None  # no room yet: it profiles one
    finally:
        session.close()
        store.close()


def test_a_frame_that_overflowed_is_learned_though_no_handle_holds_its_save_any_more():
    """A save's frame overflowed, and backward let go of it before its put was seen landed (forward's
    last saves, unpacked from the held tensor while the queue was behind): it is not stored again,
    but its kind takes another frame or none from then on, and the step counts the overflow."""
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    try:
        step = session.new_step()
        handle = session.save(torch.randn(64, 64), step, Policy(0))
        stored = handle.stored
        stored.copy_in = Begun(stored.copy_in, unfinished=True, overflowed=True)
        del handle  # backward unpacked it from the held tensor and let go
        session.poll()  # the put has begun: the save waits for it
        session.synchronize()
        assert step.stats.frame_overflows == 1 and stored.kind in session._overflowed
        assert store.service.store.session_stats(store.session)["keys"] == 0  # stored once, freed
    finally:
        session.close()
        store.close()


def test_the_kinds_whose_frames_overflowed_are_the_most_recent_few(monkeypatch):
    """A kind is an op's output shape: with shapes that change every step (a new sequence length each)
    each overflow added one, kept for the process's life. The least recently overflowed goes first
    (at worst it overflows once more, and is learned again)."""
    monkeypatch.setattr(session_mod, "MAX_OVERFLOWED_KINDS", 3)
    store = EmbeddedStore(4 << 20)
    session = session_mod.ClientSession(store)
    kinds = []
    try:
        for n in (8, 9, 10, 8, 11, 12):  # 8 again: the most recent once more
            step = session.new_step()
            handle = session.save(torch.randn(8, n), step, Policy(0))
            stored = handle.stored
            stored.copy_in = Begun(stored.copy_in, unfinished=True, overflowed=True)
            kinds.append(stored.kind)
            del handle
            session.poll()
            session.synchronize()
            session.end_step(step)
        assert list(session._overflowed) == [kinds[3], kinds[4], kinds[5]]  # n = 8, 11, 12
    finally:
        session.close()
        store.close()


def test_backward_fetches_a_storage_several_ops_saved_once(monkeypatch):
    """mul saves tanh's output twice and tanh once more: backward's first unpack fetches it on
    demand, and the look ahead that follows starts no second fetch of it."""
    session = storm.registry.session_for("embedded", None, None)
    keys: list[int] = []
    real = session.restorer._fetch

    def fetch(stored):
        keys.append(stored.key)
        return real(stored)

    monkeypatch.setattr(session.restorer, "_fetch", fetch)
    monkeypatch.setattr(session.restorer.prefetch, "fetch", fetch)
    x = torch.randn(256, 256, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0, prefetch_bytes="64MiB") as ctx:
        b = (x.tanh() * x.tanh().detach()).sum()
        a = x.tanh()
        c = (a * a).sum()
    session.synchronize()
    session.poll()  # every copy in: backward fetches from the store
    (b + c).backward()
    assert ctx.stats.offloaded == len(set(keys)) and len(keys) == len(set(keys)), keys
