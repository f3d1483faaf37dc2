"""What one request may cost the daemon is bounded by the protocol, whatever the request says: the
size of its error reply, the metadata a PUT makes the daemon keep, and the work of decoding it.

Nothing here is timed: the bounds are on sizes and counts, which decide the cost."""

from __future__ import annotations

import msgpack
import pytest
import torch

from stormd.wire.protocol import (
    DTYPE_SIZES,
    IPC_HANDLE_BYTES,
    MAX_DIMS,
    MAX_INT,
    MAX_KEYS_PER_FREE,
    MAX_MESSAGE_BYTES,
    MESSAGE_LIMITS,
    PROTOCOL_VERSION,
    REQUEST_LIMITS,
    ErrorCode,
    ProtocolError,
    error,
    pack,
    parse_request,
    request_id,
    unpack,
    unpack_request,
)

AUTH = {"session": 1, "token": "t"}
PUT = {"op": "PUT", "id": 7, **AUTH, "key": 1, "step": 1, "nbytes": 64, "dtype": "float32",
       "shape": [4, 4], "strides": [4, 1], "storage_offset": 0, "codec": "raw"}
CUDA = {"handle": b"h" * IPC_HANDLE_BYTES, "offset": MAX_INT, "device": "GPU-" + "f" * 60,
        "ready": b"r" * IPC_HANDLE_BYTES, "done": b"d" * IPC_HANDLE_BYTES}
REPLY_BOUND = 2048  # bytes of a packed error reply, whatever the request


def answer(frame: bytes, decode=unpack) -> dict:
    """The reply the daemon builds for ``frame`` up to the service (stormd/server.py, service.py)."""
    msg = None
    try:
        msg = decode(frame)
        req = parse_request(msg)
    except ProtocolError as e:
        return error(request_id(msg), e.code, e.message)
    return {"id": req.id, "ok": True}


def refused(msg: dict, match: str = "") -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        parse_request(msg)
    assert e.value.code == ErrorCode.BAD_FIELD and match in e.value.message, e.value.message
    return e.value


# --- 1. an error reply never grows with the request ---------------------------------------------

BIG_STR = "x" * (MESSAGE_LIMITS.str_bytes - 16)
BIG_LIST = [None] * MESSAGE_LIMITS.array_len


def hostile_requests() -> list[tuple[str, bytes]]:
    """Requests that fit in a frame and are as large as the decoder takes, each with one field (or
    op, or field name) blown up; and the attack script's op of a million Nones."""
    frames = [("op: 1M Nones", msgpack.packb({"op": [None] * 1_040_000, "id": 1})),
              ("op: long string", pack({"op": BIG_STR, "id": 1})),
              ("op: long list", pack({"op": BIG_LIST, "id": 1})),
              ("op: map of long keys", pack({"op": {f"{i}{BIG_STR}": i for i in range(40)}, "id": 1})),
              ("id: long string", pack({"op": "PING", "id": BIG_STR})),
              ("unknown field: long name", pack({"op": "PING", "id": 1, BIG_STR: 1})),
              ("unknown fields: many long names", pack({"op": "PING", "id": 1,
                                                        **{f"{i}{BIG_STR[:3000]}": i for i in range(250)}})),
              ("unknown fields: past the map limit", pack({"op": "PING", "id": 1,
                                                           **{str(i): i for i in range(100_000)}}))]
    for name in [*PUT, "raw_nbytes", "cuda"]:
        if name in ("op", "id"):
            continue
        for what, big in (("long string", BIG_STR), ("long list", BIG_LIST), ("list of long strings",
                                                                                [BIG_STR] * 60)):
            frames.append((f"PUT {name}: {what}", pack({**PUT, name: big})))
    for field in ("keys", "step", "all"):
        frames.append((f"FREE {field}: list of long strings", pack({"op": "FREE", "id": 1, **AUTH,
                                                                   field: [BIG_STR] * 60})))
    frames.append(("HELLO host: long string", pack({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION,
                                                    "pid": 1, "host": BIG_STR})))
    return frames


@pytest.mark.parametrize("name,frame", hostile_requests(), ids=[n for n, _ in hostile_requests()])
def test_an_error_reply_stays_small_however_large_the_request(name, frame):
    assert len(frame) <= MAX_MESSAGE_BYTES  # the daemon reads it (a larger one is dropped by ZeroMQ)
    for decode in (unpack, unpack_request):
        reply = answer(frame, decode)
        assert reply["ok"] is False, (name, reply)
        assert len(pack(reply)) <= REPLY_BOUND, (name, decode.__name__, len(pack(reply)), reply["message"][:300])


def test_a_quoted_value_says_how_long_it_was():
    e = refused({**PUT, "dtype": "f" * 10_000}, "'dtype'")
    assert "10000 characters" in e.message and len(e.message) < 400
    with pytest.raises(ProtocolError) as op:
        parse_request({"op": [None] * 5000, "id": 1})
    assert op.value.code == ErrorCode.UNKNOWN_OP and "5000 items" in op.value.message
    many = refused({**PUT, **{f"extra{i}": i for i in range(200)}}, "unknown field")
    assert "extra0" in many.message and "and 196 more" in many.message


def test_any_error_message_is_bounded_wherever_it_was_built():
    e = ProtocolError(ErrorCode.INTERNAL, "ValueError: " + "y" * 1_000_000)  # as the service wraps an exception
    assert len(e.message) <= 1024 and "1000012 characters" in e.message
    assert len(pack(error(1, e.code, e.message))) <= REPLY_BOUND


# --- 2. what a PUT makes the daemon keep --------------------------------------------------------

def put_meta(t: torch.Tensor, codec: str = "raw") -> dict:
    """A PUT for ``t`` as the client builds it (storm/session.py _offload, storm/copies/*: the view's
    meta, and the whole storage's size)."""
    storage = t.untyped_storage()
    meta = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "strides": list(t.stride()),
            "storage_offset": t.storage_offset()}
    return {"op": "PUT", "id": 1, **AUTH, "key": 1, "step": 1, "nbytes": storage.nbytes(), "codec": codec, **meta}


def real_views() -> dict[str, torch.Tensor]:
    """Views that torch ops make and autograd saves, strides of size-1 dims and empty views included."""
    x, b = torch.arange(10.0), torch.randn(4, 3, 5, 6)
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    return {
        "contiguous": b, "transposed": b.transpose(0, 3), "permuted": b.permute(2, 0, 3, 1), "mT": b.mT,
        "sliced": b[1:3, :, 2:, ::2], "stepped": x[1::3], "select": b[2], "narrowed": x.narrow(0, 9, 1),
        "expanded scalar": torch.tensor(1.0).expand(1000, 1000),
        "expanded row": torch.randn(3, 1).expand(3, 1000),
        "expanded and viewed": torch.randn(3, 1).expand(3, 1000).reshape(3, 1, 1000),
        "expanded and unsqueezed": torch.randn(3).expand(4, 3).unsqueeze(0),
        "unsqueezed": b.unsqueeze(0), "unsqueezed stepped slice": torch.arange(5.0)[::2].unsqueeze(0),
        "size-1 dims": b[:, :1, :, :1], "size-1 dims unsqueezed": b[:, :1].unsqueeze(1).unsqueeze(-1),
        "step past the end": x[::20], "diagonal of 1x1": torch.randn(1, 1).diagonal().unsqueeze(0),
        "diagonal": torch.randn(5, 5).diagonal(), "unfold": x.unfold(0, 4, 3),
        "channels_last": cl, "channels_last N=1": cl[:1], "channels_last 1x3x1x1":
            torch.randn(1, 3, 1, 1).to(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d),
        "as_strided": x.as_strided((2, 1, 3), (4, 2, 1), 1), "as_strided overlapping": x.as_strided((4, 4), (1, 1)),
        "empty slice": b[:, :0], "empty at the end": x[10:], "empty unsqueezed": b[:0].unsqueeze(0),
        "empty reshaped": x[:0].view(0, 100), "scalar": torch.tensor(3.0), "scalar view": x[4],
        "bool": torch.rand(7, 3) > 0.5, "bfloat16": torch.randn(6, 4).to(torch.bfloat16).t(),
        "int8 sliced": torch.arange(100, dtype=torch.int8)[10:90:7], "complex": torch.randn(4, 4, dtype=torch.cfloat).T,
        "float64 big": torch.randn(257, 33, dtype=torch.float64)[::3, 1:],
        f"{MAX_DIMS} dims": torch.randn([2] * 8 + [1] * (MAX_DIMS - 8)),
        f"{MAX_DIMS} dims transposed": torch.randn([1] * (MAX_DIMS - 3) + [3, 2, 2]).transpose(0, -1),
    }


@pytest.mark.parametrize("name", list(real_views()))
def test_every_view_torch_makes_is_accepted_as_the_client_puts_it(name):
    t = real_views()[name]
    assert t.dtype is not None and str(t.dtype).removeprefix("torch.") in DTYPE_SIZES
    req = parse_request(put_meta(t))
    assert (req.fields["shape"], req.fields["strides"]) == (list(t.shape), list(t.stride()))
    # encoded: the storage's size is raw_nbytes, the stored bytes fewer
    parse_request({**put_meta(t, "zstd"), "nbytes": 1, "raw_nbytes": t.untyped_storage().nbytes()})


def test_the_client_builds_put_meta_as_the_test_does():
    """put_meta above mirrors storm/session.py; should the client change how it says a view, this
    test says where to look."""
    import inspect

    from storm import session
    src = inspect.getsource(session.ClientSession._offload)
    for part in ('"shape": list(t.shape)', '"strides": list(t.stride())', '"storage_offset": t.storage_offset()'):
        assert part in src


ONE_BYTE = {**PUT, "nbytes": 1, "dtype": "uint8"}  # the smallest storage: one element


@pytest.mark.parametrize("fields,match", [
    # the attack (a2): an empty view let any strides and dims through, and a size-1 dim any stride
    ({"shape": [0] + [(1 << 62) + i for i in range(MAX_DIMS - 1)], "strides": [(1 << 62)] * MAX_DIMS,
      "storage_offset": 0}, "more elements than torch can count"),
    ({"shape": [0, 1], "strides": [1 << 62, 1], "storage_offset": 0}, "stride 4611686018427387904 of dim 0"),
    ({"shape": [1, 1], "strides": [1, 1 << 40], "storage_offset": 0}, "stride 1099511627776 of dim 1"),
    ({"shape": [1] * MAX_DIMS, "strides": [3] * MAX_DIMS, "storage_offset": 0}, "stride 3 of dim 0"),
    ({"shape": [0], "strides": [1], "storage_offset": 1 << 62}, "storage_offset"),
    ({"shape": [0], "strides": [1], "storage_offset": 2}, "past the storage's 1 elements"),
    ({"shape": [1] * (MAX_DIMS + 1), "strides": [1] * (MAX_DIMS + 1), "storage_offset": 0},
     f"at most {MAX_DIMS} integers"),
    ({"shape": [1 << 32, 1 << 32], "strides": [0, 0], "storage_offset": 0}, "more elements than torch"),
])
def test_a_put_of_one_byte_cannot_make_the_daemon_keep_large_metadata(fields, match):
    refused({**ONE_BYTE, **fields}, match)


def test_the_metadata_a_put_leaves_is_bounded():
    """Accepted shapes and strides: at most MAX_DIMS each, each at most max(2 x the storage's
    elements, the view's extent) (a stride) or its extent (a dim), which fits an int64."""
    widest = {**ONE_BYTE, "shape": [1] * MAX_DIMS, "strides": [2] * MAX_DIMS, "storage_offset": 0}
    f = parse_request(widest).fields
    assert len(f["shape"]) == len(f["strides"]) == MAX_DIMS
    big = parse_request({**ONE_BYTE, "shape": [MAX_INT, 1], "strides": [0, 2], "storage_offset": 0}).fields
    assert max(big["shape"]) <= MAX_INT and big["strides"] == [0, 2]


# --- 3. what decoding a frame may cost ----------------------------------------------------------

def ping(x) -> bytes:
    return msgpack.packb({"op": "PING", "id": 1, "x": x})


@pytest.mark.parametrize("limits,decode", [(MESSAGE_LIMITS, unpack), (REQUEST_LIMITS, unpack_request)],
                         ids=["unpack", "unpack_request"])
def test_a_frame_past_a_decode_limit_is_bad_message_naming_it(limits, decode):
    cases = [  # (frame, what the message names); every frame fits in MAX_MESSAGE_BYTES
        (ping([[]] * 1_040_000), "array_len"),  # the attack (a6): a million empty arrays
        (ping([None] * (limits.array_len + 1)), "array_len"),
        (msgpack.packb({"op": "PING", "id": 1, **{str(i): 0 for i in range(limits.map_len)}}), "map_len"),
        (ping("s" * (limits.str_bytes + 1)), "str_bytes"),
        (ping(b"b" * (limits.bin_bytes + 1)), "bin_bytes"),
        (ping(msgpack.ExtType(1, b"e")), "ext"),
        (ping([[] for _ in range(limits.containers)]), "containers"),
        (ping([[[]] * 60_000] * 16), "containers"),
        (ping([[0] * limits.array_len] * (limits.elements // limits.array_len + 1)), "elements"),
    ]
    for frame, limit in cases:
        assert len(frame) <= MAX_MESSAGE_BYTES
        with pytest.raises(ProtocolError) as e:
            decode(frame)
        assert e.value.code == ErrorCode.BAD_MESSAGE and limit in e.value.message, (limit, e.value.message)
    with pytest.raises(ProtocolError, match="StackError"):  # nesting: msgpack's own depth limit
        decode(b"\x91" * 100_000 + b"\xc0")


def largest_valid_requests() -> dict[str, dict]:
    return {
        "FREE of 65536 keys": {"op": "FREE", "id": MAX_INT, **AUTH, "token": "t" * 64,
                               "keys": [MAX_INT - i for i in range(MAX_KEYS_PER_FREE)]},
        "PUT of MAX_DIMS dims with cuda": {**PUT, "id": MAX_INT, "session": MAX_INT, "token": "t" * 64,
                                           "key": MAX_INT, "step": MAX_INT, "dtype": "float8_e4m3fn",
                                           "nbytes": MAX_INT, "raw_nbytes": MAX_INT,
                                           "codec": "ancf_exp_frame", "shape": [2] * MAX_DIMS,
                                           "strides": [1 << i for i in reversed(range(MAX_DIMS))],
                                           "storage_offset": MAX_INT - (1 << MAX_DIMS), "cuda": CUDA},
        "HELLO of the longest host and name": {"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION,
                                               "pid": MAX_INT, "host": "\U0001f600" * 256, "name": "n" * 64},
        "SEAL of the largest checksum": {"op": "SEAL", "id": 1, **AUTH, "key": 1, "checksum": (1 << 64) - 1},
    }


@pytest.mark.parametrize("name", list(largest_valid_requests()))
def test_the_largest_valid_requests_are_decoded_and_accepted(name):
    msg = largest_valid_requests()[name]
    frame = pack(msg)
    assert len(frame) <= MAX_MESSAGE_BYTES
    for decode in (unpack, unpack_request):
        assert decode(frame) == msg
        assert parse_request(decode(frame)).op == msg["op"]


def test_the_largest_replies_decode_within_the_message_limits():
    """Clients and stormctl decode replies with ``unpack``: the daemon's largest (a CLIENTS reply
    of as many rows as fit, STATS) must pass its limits (test_faults_bounds checks CLIENTS too)."""
    import os

    from stormd.service import Service
    from stormd.wire.pool import SharedPool
    pool = SharedPool.anonymous(16 << 20)
    try:
        service = Service(pool)
        for pid in range(1, 5001):
            r = service.handle_message({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": pid,
                                        "host": "h"})
            assert r["ok"], r
        auth = {"session": r["session"], "token": r["token"]}
        clients = service.handle_message({"op": "CLIENTS", "id": 2})
        assert 1000 < len(clients["clients"]) < 5000
        stats = service.handle_message({"op": "STATS", "id": 3, **auth})
        status = service.handle_message({"op": "STATUS", "id": 4})
        hello = service.handle_message({"op": "HELLO", "id": 5, "version": PROTOCOL_VERSION, "pid": os.getpid(),
                                        "host": "h" * 256})
        for reply in (clients, stats, status, hello):
            assert reply["ok"], reply
            assert unpack(pack(reply)) == reply
    finally:
        pool.close()
