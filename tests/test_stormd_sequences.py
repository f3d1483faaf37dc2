"""Any order of requests two clients may send, as stormd's Service answers them: never an
INTERNAL error (a bug in the daemon, which one client could then trigger at will), never
overlapping extents (the ledger checks every one), and once both sessions have ended, no pool
byte still taken. Steps that go back and forth, keys reused across steps, double frees, GETs of
unsealed keys and a pool too small for all of it are what training never sends and a careless
or hostile client may."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import put_fields
from stormd.service import Service
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, ErrorCode

KEYS, STEPS = st.integers(1, 12), st.integers(1, 5)
REQUEST = st.one_of(
    st.tuples(st.just("PUT"), KEYS, STEPS, st.sampled_from([256, 4096, 8192, 65536, 300000])),
    st.tuples(st.just("SEAL"), KEYS),
    st.tuples(st.just("GET"), KEYS),
    st.tuples(st.just("FREE keys"), st.lists(KEYS, min_size=1, max_size=4)),
    st.tuples(st.just("FREE step"), STEPS),
    st.tuples(st.just("FREE all")),
    st.tuples(st.just("BYE")),
)


def hello(service: Service) -> dict:
    r = service.handle_message({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": os.getpid(),
                                "host": "test"})
    assert r["ok"], r
    return {"session": r["session"], "token": r["token"]}


def message(request: tuple) -> dict:
    op = request[0]
    if op == "PUT":
        return {"op": "PUT", **put_fields(request[1], request[3], request[2])}
    if op in ("SEAL", "GET"):
        return {"op": op, "key": request[1]}
    if op == "FREE keys":
        return {"op": "FREE", "keys": request[1]}
    if op == "FREE step":
        return {"op": "FREE", "step": request[1]}
    return {"op": "FREE", "all": True} if op == "FREE all" else {"op": "BYE"}


# Found by random sequences, then shrunk: steps 2 and 3 visited twice. The step placement recorded
# step 2's slots on both visits, counted a lifetime as open twice and ended one twice, and made a
# plan from a lifetime that had not ended: KeyError in first_fit_footprint.
@example([(0, ("PUT", 1, 1, 4096)), (0, ("FREE step", 1)), (0, ("PUT", 3, 2, 256)), (0, ("PUT", 2, 3, 8192)),
          (0, ("PUT", 1, 2, 4096)), (0, ("FREE all",)), (0, ("PUT", 3, 2, 256)), (0, ("PUT", 2, 3, 65536))])
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 1), REQUEST), max_size=120))
def test_no_sequence_of_requests_is_an_internal_error_or_leaves_pool_bytes_taken(requests):
    pool = SharedPool.anonymous(256 << 10)  # too small for all of it: POOL_FULL is among the answers
    try:
        service = Service(pool, store_options=StoreOptions(check_extents=True))
        sessions = [hello(service), hello(service)]
        for rid, (who, request) in enumerate(requests, start=2):
            r = service.handle_message({**message(request), **sessions[who], "id": rid})
            assert r["ok"] or r["error"] != ErrorCode.INTERNAL, (request, r)
            if request[0] == "BYE":
                sessions[who] = hello(service)
        for auth in sessions:
            assert service.handle_message({"op": "BYE", "id": 0, **auth})["ok"]
        assert service.node_stats()["used"] == 0
    finally:
        pool.close()
