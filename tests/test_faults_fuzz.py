"""Issue 7, item 3: hostile input. Over 100k malformed, oversized and out-of-range messages.

Every message is a valid request with one defect drawn by hypothesis (or not
a request at all), so each must get an error reply, and the defect says which
codes are right. The messages are pipelined in batches over one raw DEALER,
so 100k cost seconds, not one round trip each. Throughout, another session's
tensors must stay intact, the pool must hold exactly them, the daemon's RSS
must stay bounded, and it must still serve.
"""

from __future__ import annotations

import os
import string

import pytest
import xxhash
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemon import read_extent, store

from conftest import start_daemon, stop_daemon
from helpers import RawClient, put_fields
from stormd.wire.protocol import (
    ALL_ERROR_CODES,
    MAX_INT,
    MAX_MESSAGE_BYTES,
    OPS,
    PROTOCOL_VERSION,
    ErrorCode,
    pack,
    unpack,
)

POOL = 16 << 20
BATCH = 200
MESSAGES = 100_000
RSS_GROWTH_BOUND = 16 << 20  # after warm-up: 100k messages leaking even 160 bytes each would pass it

E = ErrorCode
# What each field is, from the protocol's docstring (not from its checks, which are under test).
INT_FIELDS = {"session": (1, MAX_INT), "key": (0, MAX_INT), "step": (0, MAX_INT), "nbytes": (1, MAX_INT),
              "storage_offset": (0, MAX_INT), "checksum": (0, (1 << 64) - 1), "version": (0, MAX_INT),
              "pid": (0, MAX_INT)}
LIST_FIELDS = {"shape", "strides", "keys"}
STR_FIELDS = {"token", "host", "dtype", "codec"}
REQUIRED = {"HELLO": ("version", "pid", "host"), "SEAL": ("session", "token", "key"),
            "GET": ("session", "token", "key"), "FREE": ("session", "token"), "STATS": ("session", "token"),
            "BYE": ("session", "token"),
            "PUT": ("session", "token", "key", "step", "nbytes", "dtype", "shape", "strides", "storage_offset",
                    "codec")}
AUTH_OPS = ("PUT", "SEAL", "GET", "FREE", "STATS", "BYE", "PING")

wire_int = st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack can carry
NOT = {  # values of every wire type but one (built without filters, which would make generation slow)
    "int": [st.none(), st.floats(), st.text(max_size=20), st.binary(max_size=20), st.lists(wire_int, max_size=3),
            st.dictionaries(st.text(max_size=5), wire_int, max_size=2), st.booleans()],
    "str": [st.none(), st.floats(), wire_int, st.binary(max_size=20), st.lists(wire_int, max_size=3),
            st.dictionaries(st.text(max_size=5), wire_int, max_size=2), st.booleans()],
    "list": [st.none(), st.floats(), wire_int, st.binary(max_size=20), st.text(max_size=20),
             st.dictionaries(st.text(max_size=5), wire_int, max_size=2), st.booleans(),
             st.lists(st.one_of(st.text(max_size=3), st.floats(), st.none()), min_size=1, max_size=3)],
    "bool": [st.none(), st.floats(), wire_int, st.binary(max_size=20), st.text(max_size=20),
             st.lists(wire_int, max_size=3)],
}
any_value = st.one_of(*NOT["bool"], st.booleans())
not_a_map = st.one_of(*NOT["bool"], st.booleans())  # every type but a map


def wrong_type_for(name: str) -> st.SearchStrategy:
    kind = "int" if name in INT_FIELDS else "list" if name in LIST_FIELDS else "str" if name in STR_FIELDS else "bool"
    return st.one_of(*NOT[kind])


def out_of_range_for(name: str) -> st.SearchStrategy:
    if name in LIST_FIELDS:
        return st.lists(st.integers(-(1 << 63), -1), min_size=1, max_size=3)
    lo, hi = INT_FIELDS[name]
    below = st.integers(-(1 << 63), lo - 1)
    return below if hi >= (1 << 64) - 1 else st.one_of(below, st.integers(hi + 1, (1 << 64) - 1))


KINDS = ["garbage", "not_a_map", "frames", "bad_op", "bad_id", "drop", "wrong_type", "out_of_range", "extra",
         "forged_token", "stale", "other_keys", "huge", "bad_view", "version", "cuda"]
CUDA_FIELDS = {"handle": 64, "offset": None, "device": "", "ready": 64, "done": 64}  # bytes: their length


@st.composite
def cuda_field(draw) -> tuple[dict, bool]:
    """A PUT's ``cuda`` map with forged handles and events (well formed: the daemon must refuse to
    copy, NO_CUDA here without a GPU, BAD_HANDLE with one) or with one defect (BAD_FIELD); and which."""
    forged = {"handle": draw(st.binary(min_size=64, max_size=64)), "offset": draw(st.integers(0, MAX_INT)),
              "device": draw(st.text(max_size=40)), "ready": draw(st.binary(min_size=64, max_size=64)),
              "done": draw(st.binary(min_size=64, max_size=64))}
    defect = draw(st.sampled_from(["none", "drop", "extra", "short", "type"]))
    name = draw(st.sampled_from(sorted(CUDA_FIELDS)))
    if defect == "drop":
        del forged[name]
    elif defect == "extra":
        forged["pid"] = 1
    elif defect == "short" and CUDA_FIELDS[name] == 64:
        forged[name] = forged[name][:draw(st.integers(0, 63))]
    elif defect != "none":
        forged[name] = draw(st.one_of(*NOT["int" if name == "offset" else "str"]))
    return forged, defect == "none" or (defect == "short" and CUDA_FIELDS[name] != 64)
VIEW_DEFECTS = ["offset", "shape", "dims", "itemsize", "too_many_dims"]


class Fuzz:
    """Hypothesis draws a plan (a kind of defect, the op and field it hits), then a batch of values
    for it; each value makes one message. Drawing flat lists of values keeps generation at tens of
    thousands of messages a second."""

    def __init__(self, auth: dict, stale: dict, victim_keys: list[int]):
        self.auth, self.stale, self.victim_keys = auth, stale, victim_keys
        self.ids = iter(range(1, MAX_INT))

    def base(self, op: str) -> dict:
        """A request that would succeed as it is (for PUT: a fresh key; for SEAL, GET, FREE: one of
        the victim's keys, which this session does not have)."""
        a, rid = self.auth, next(self.ids)
        return {"op": op, "id": rid, **{
            "HELLO": {"version": PROTOCOL_VERSION, "pid": 1, "host": "fuzz"},
            "PUT": {**a, **put_fields((1 << 40) + rid, 4096)},
            "SEAL": {**a, "key": self.victim_keys[0], "checksum": 1},
            "GET": {**a, "key": self.victim_keys[0]},
            "FREE": {**a, "keys": [self.victim_keys[0]]},
            "STATS": a, "BYE": a, "PING": a,
        }[op]}

    @st.composite
    def plan(draw, self) -> tuple:
        kind = draw(st.sampled_from(KINDS))
        op = field = None
        if kind in ("forged_token", "stale"):
            op = draw(st.sampled_from(AUTH_OPS))
        elif kind == "other_keys":
            op = draw(st.sampled_from(["SEAL", "GET", "FREE"]))
        elif kind in ("drop", "wrong_type", "out_of_range", "extra", "bad_id"):
            op = draw(st.sampled_from(sorted(REQUIRED)))
            fields = [f for f in self.base(op) if f not in ("op", "id")]
            if kind == "drop":
                field = draw(st.sampled_from(REQUIRED[op]))
            elif kind == "wrong_type":
                field = draw(st.sampled_from(fields))
            elif kind == "out_of_range":
                field = draw(st.sampled_from([f for f in fields if f in INT_FIELDS or f in LIST_FIELDS]))
        elif kind == "bad_view":
            field = draw(st.sampled_from(VIEW_DEFECTS))
        return kind, op, field

    def values(self, plan: tuple) -> st.SearchStrategy:
        kind, op, field = plan
        real = self.auth["token"]
        return {
            "garbage": st.binary(max_size=64), "not_a_map": not_a_map,
            "frames": st.lists(st.binary(max_size=16), min_size=2, max_size=4),
            "bad_op": st.one_of(st.text(max_size=8).map(lambda o: o.lower() if o in OPS else o), *NOT["str"]),
            "version": st.integers(0, MAX_INT).map(lambda v: v + 1 if v == PROTOCOL_VERSION else v),
            "bad_id": st.one_of(wrong_type_for("key"), out_of_range_for("key")),
            "drop": st.none(), "stale": st.none(),
            "wrong_type": wrong_type_for(field) if kind == "wrong_type" else None,
            "out_of_range": out_of_range_for(field) if kind == "out_of_range" else None,
            "extra": st.tuples(st.one_of(st.sampled_from(["offset", "handle", "pool", "ipc_handle"]),
                                         st.text(string.ascii_letters, min_size=1, max_size=8),
                                         wire_int, st.binary(max_size=4)), any_value),
            "forged_token": st.text(max_size=64).map(lambda t: t[::-1] if t == real else t),
            "other_keys": st.lists(st.sampled_from(self.victim_keys), min_size=1, max_size=4),
            "huge": st.integers(POOL + 1, MAX_INT),
            "bad_view": st.integers(4097, MAX_INT // 2),
            "cuda": cuda_field(),
        }[kind]

    def build(self, plan: tuple, v: object) -> tuple[list[bytes], frozenset[str], object]:
        """(frames, the error codes that are right for them, the message or None)."""
        kind, op, field = plan
        if kind == "garbage":
            return [v], frozenset({E.BAD_MESSAGE, E.BAD_FIELD, E.UNKNOWN_OP}), None
        if kind == "not_a_map":
            return [pack(v)], frozenset({E.BAD_MESSAGE}), None
        if kind == "frames":
            return v, frozenset({E.BAD_MESSAGE}), None
        if kind == "bad_op":
            msg = {"op": v, "id": next(self.ids)}
            return [pack(msg)], frozenset({E.UNKNOWN_OP}), msg
        msg = self.base(op or ("HELLO" if kind == "version" else "PUT"))
        codes = {E.BAD_FIELD}
        if kind == "version":
            msg["version"] = v
            codes = {E.VERSION_MISMATCH}
        elif kind == "bad_id":
            msg["id"] = v
        elif kind == "drop":
            del msg[field]
        elif kind in ("wrong_type", "out_of_range"):
            msg[field] = v
        elif kind == "extra":
            name, value = v
            msg["handle" if name in msg else name] = value
            codes.add(E.BAD_MESSAGE)  # a map key that is not a string is refused by the decoder
        elif kind == "forged_token":
            msg["token"] = v
            codes = {E.UNAUTHORIZED}
        elif kind == "stale":
            msg.update(self.stale)
            codes = {E.UNAUTHORIZED}
        elif kind == "other_keys":
            msg["keys" if op == "FREE" else "key"] = v if op == "FREE" else v[0]
            codes = {E.NOT_FOUND}
        elif kind == "cuda":
            msg["cuda"], well_formed = v
            codes = {E.NO_CUDA, E.BAD_HANDLE} if well_formed else {E.BAD_FIELD}
        elif kind == "huge":
            msg.update(nbytes=v, shape=[v], strides=[1])
            codes = {E.TOO_LARGE}
        elif field == "offset":  # bad_view: the view does not fit its storage, or its geometry does not add up
            msg["storage_offset"] = v
        elif field == "shape":
            msg["shape"] = [v]
        elif field == "dims":
            msg["strides"] = [1, v]
        elif field == "itemsize":
            msg.update(dtype="float32", nbytes=4095, shape=[1], strides=[1])
        else:
            msg.update(shape=[1] * 65, strides=[1] * 65)
        return [pack(msg)], frozenset(codes), msg


def expected_id(msg: object) -> int:
    """The id the reply must echo: 0 where the message has no usable one, or does not decode (msgpack
    is read with strict_map_key, so a map key other than a string refuses the whole message)."""
    if isinstance(msg, dict) and all(isinstance(k, (str, bytes)) for k in msg):
        rid = msg.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_INT:
            return rid
    return 0


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_100k_hostile_messages_each_get_an_error_and_nothing_leaks(tmp_path):
    d = start_daemon(tmp_path, "--pool-size", str(POOL), "--metrics", "--metrics-port", "0", "--client-timeout", "120")
    try:
        victim = RawClient(d.endpoint)
        pool = victim.hello()["pool"]["path"]
        payloads = {k: xxhash.xxh3_128_digest(str(k).encode()) * (100 * k) for k in range(1, 9)}
        for k, data in payloads.items():
            store(victim, pool, k, data)
        used = victim.call("STATS")["node"]["used"]
        gone = RawClient(d.endpoint)
        gone.hello()
        stale = dict(gone.auth)
        assert gone.call("BYE")["ok"]
        fz = RawClient(d.endpoint, timeout_ms=30_000)
        fz.hello()
        fz.sock.setsockopt(zmq.SNDHWM, 0)  # a batch is queued whole, however far the daemon is behind
        fuzz = Fuzz(fz.auth, stale, list(payloads))
        sent = {"n": 0}
        seen_codes: set[str] = set()
        rss_warm = []

        @settings(max_examples=MESSAGES // BATCH + 100, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def run(data):
            plan = data.draw(fuzz.plan())
            batch = [fuzz.build(plan, v) for v in data.draw(st.lists(fuzz.values(plan), min_size=BATCH,
                                                                     max_size=BATCH))]
            if sent["n"] >= MESSAGES:
                return  # the spare examples (there for draws that overran) are not needed
            for frames, _, _ in batch:
                fz.sock.send_multipart(frames)
            replies = [fz.recv() for _ in batch]  # all of them, so a failure leaves none behind
            for (frames, codes, msg), reply in zip(batch, replies):
                assert reply["ok"] is False and reply["error"] in codes, (plan, frames, reply)
                assert reply["id"] == (expected_id(msg) if len(frames) == 1 else 0), (plan, frames, reply)
                assert isinstance(reply["message"], str) and reply["message"]
                seen_codes.add(reply["error"])
            sent["n"] += len(batch)
            if not rss_warm and sent["n"] >= 10_000:
                rss_warm.append(rss(d.proc.pid))

        run()
        assert sent["n"] >= MESSAGES
        # Oversized frames: a few, since each is a megabyte on the wire.
        for _ in range(20):
            r = fz.send_frames(b"\x91" + b"\x00" * MAX_MESSAGE_BYTES)
            assert r["error"] == E.BAD_MESSAGE and "exceeds" in r["message"]
        assert d.proc.poll() is None, d.output()
        cuda_codes = {E.NO_CUDA, E.BAD_HANDLE}  # which: whether the daemon sees a GPU
        assert seen_codes - cuda_codes == {E.BAD_MESSAGE, E.BAD_FIELD, E.UNKNOWN_OP, E.VERSION_MISMATCH,
                                           E.UNAUTHORIZED, E.NOT_FOUND, E.TOO_LARGE}, seen_codes
        for i in range(1000):  # forged CUDA copies, whatever share of the draws went to them: none stores a byte
            r = fz.call("PUT", **put_fields((1 << 50) + i, 4096), cuda={
                "handle": os.urandom(64), "offset": i, "device": f"GPU-{i}", "ready": os.urandom(64),
                "done": os.urandom(64)})
            assert r["error"] in cuda_codes, r
        rss_end = rss(d.proc.pid)
        print(f"\n{sent['n']} messages; daemon RSS after 10k {rss_warm[0] >> 20} MiB, at the end {rss_end >> 20} MiB")
        assert rss_end - rss_warm[0] < RSS_GROWTH_BOUND, (rss_warm[0], rss_end)
        node = RawClient(d.endpoint).call("STATUS")["node"]  # an admin verb: no session
        assert (node["used"], node["keys"], node["clients"]) == (used, len(payloads), 2), node
        assert sum(node["errors"].values()) >= MESSAGES and E.INTERNAL not in node["errors"], node["errors"]
        assert set(node["errors"]) <= ALL_ERROR_CODES
        for k, data in payloads.items():  # the victim's tensors: every byte as it stored them
            g = victim.call("GET", key=k)
            assert read_extent(pool, g["offset"], g["nbytes"]) == data
            assert g["checksum"] == xxhash.xxh3_64_intdigest(data)
        assert fz.call("PING")["ok"] and fz.call("STATS")["session"]["keys"] == 0
    finally:
        stop_daemon(d)
    assert d.proc.returncode == 0, d.output()


def test_a_daemon_answers_the_largest_hostile_requests_with_small_replies_and_serves_on(tmp_path):
    """The attacks a1, a2, a6 (.scratch/attack) against a real daemon: requests that echo into the
    reply, that make a PUT's metadata large, that are costly to decode. Each gets one small error
    reply (sizes, not times, are asserted) and the daemon keeps serving another client."""
    import msgpack
    d = start_daemon(tmp_path, "--pool-size", str(POOL))
    try:
        victim = RawClient(d.endpoint)
        victim.hello()
        attacker = RawClient(d.endpoint, timeout_ms=60_000)
        attacker.hello()
        fat = {**put_fields(1, 1), "shape": [0] + [(1 << 62) + i for i in range(31)], "strides": [1 << 62] * 32,
               "storage_offset": 1 << 62}
        frames = {
            "op of a million Nones": msgpack.packb({"op": [None] * 1_040_000, "id": 1}),
            "a million empty arrays": msgpack.packb({"op": "PING", "id": 2, "x": [[]] * 1_040_000}),
            "16 x 60000 empty arrays": msgpack.packb({"op": "PING", "id": 3, "x": [[[]] * 60_000] * 16}),
            "100000 unknown fields": msgpack.packb({"op": "PING", "id": 4, **{str(i): i for i in range(100_000)}}),
            "an op of 16000 characters": pack({"op": "x" * 16_000, "id": 5}),
            "a PUT of one byte with fat metadata": pack({"op": "PUT", "id": 6, **attacker.auth, **fat}),
        }
        for name, frame in frames.items():
            assert len(frame) <= MAX_MESSAGE_BYTES
            attacker.sock.send(frame)
            raw = attacker.recv_frame()
            reply = unpack(raw)
            assert reply["ok"] is False and reply["error"] in (E.BAD_MESSAGE, E.BAD_FIELD, E.UNKNOWN_OP), (name, reply)
            assert len(raw) <= 2048, (name, len(raw))
        assert attacker.call("STATS")["session"]["keys"] == 0  # the fat PUT stored nothing
        assert victim.call("PING")["ok"] and d.proc.poll() is None
    finally:
        stop_daemon(d)
