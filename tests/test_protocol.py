"""The protocol module refuses every malformed request with a code and a message naming the problem."""

from __future__ import annotations

import msgpack
import pytest

from stormd.wire.protocol import (
    ALL_ERROR_CODES,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    pack,
    parse_request,
    unpack,
)

AUTH = {"session": 1, "token": "t"}
PUT = {"op": "PUT", "id": 7, **AUTH, "key": 1, "step": 1, "nbytes": 64, "dtype": "float32",
       "shape": [4, 4], "strides": [4, 1], "storage_offset": 0, "codec": "raw"}


def refused(msg, code, match=""):
    with pytest.raises(ProtocolError) as e:
        parse_request(msg)
    assert e.value.code == code
    assert match in e.value.message
    return e.value


def test_a_valid_put_parses():
    req = parse_request(PUT)
    assert req.op == "PUT" and req.id == 7 and req.fields["shape"] == [4, 4]
    assert req.fields["raw_nbytes"] == 64  # raw: the stored bytes are the storage


def test_an_encoded_put_places_the_view_in_the_raw_storage():
    for codec in ("ancf_exp", "ancf_exp_frame"):  # a codec's serialized form, or a frame
        req = parse_request({**PUT, "codec": codec, "nbytes": 20, "raw_nbytes": 64})
        assert (req.fields["codec"], req.fields["nbytes"], req.fields["raw_nbytes"]) == (codec, 20, 64)


def test_the_wire_codec_names_are_storm_kernels_codecs():
    from storm.kernels import CODECS as KERNEL_CODECS
    from stormd.wire.protocol import CODECS
    assert CODECS == tuple(KERNEL_CODECS)


def test_roundtrip_and_garbage():
    assert unpack(pack({"op": "PING", "id": 1})) == {"op": "PING", "id": 1}
    for frame in (b"\xc1", b"\x92\x01", b"", b"\xdb\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError) as e:
            unpack(frame)
        assert e.value.code == ErrorCode.BAD_MESSAGE
    with pytest.raises(ProtocolError, match="exceeds"):
        unpack(b"\x00" * (2 << 20))


@pytest.mark.parametrize("msg,code,match", [
    ([1, 2], ErrorCode.BAD_MESSAGE, "map"),
    ({"id": 1}, ErrorCode.UNKNOWN_OP, "unknown op"),
    ({"op": "EXPLODE", "id": 1}, ErrorCode.UNKNOWN_OP, "EXPLODE"),
    ({"op": "PING"}, ErrorCode.BAD_FIELD, "'id'"),
    ({"op": "PING", "id": -1}, ErrorCode.BAD_FIELD, "'id'"),
    ({"op": "HELLO", "id": 1, "pid": 1, "host": "h"}, ErrorCode.BAD_FIELD, "'version'"),
    ({**PUT, "key": "one"}, ErrorCode.BAD_FIELD, "'key' must be an integer"),
    ({**PUT, "key": True}, ErrorCode.BAD_FIELD, "'key'"),
    ({**PUT, "nbytes": 0}, ErrorCode.BAD_FIELD, "'nbytes'"),
    ({**PUT, "nbytes": 1 << 70}, ErrorCode.BAD_FIELD, "'nbytes'"),
    ({**PUT, "dtype": "float128"}, ErrorCode.BAD_FIELD, "'dtype'"),
    ({**PUT, "shape": [4] * 100, "strides": [1] * 100}, ErrorCode.BAD_FIELD, "'shape'"),
    ({**PUT, "shape": [4, 4], "strides": [4]}, ErrorCode.BAD_FIELD, "strides"),
    ({**PUT, "storage_offset": 1}, ErrorCode.BAD_FIELD, "view reaches"),
    ({**PUT, "strides": [40, 1]}, ErrorCode.BAD_FIELD, "view reaches"),
    ({**PUT, "nbytes": 66}, ErrorCode.BAD_FIELD, "multiple"),
    ({**PUT, "codec": "magic"}, ErrorCode.BAD_FIELD, "'codec'"),
    ({**PUT, "raw_nbytes": 128}, ErrorCode.BAD_FIELD, "raw_nbytes 128 must equal nbytes"),
    ({**PUT, "codec": "zero", "nbytes": 16, "raw_nbytes": 32}, ErrorCode.BAD_FIELD, "view reaches"),
    ({**PUT, "codec": "zero", "nbytes": 16, "raw_nbytes": 66}, ErrorCode.BAD_FIELD, "multiple"),
    ({**PUT, "extra": 1}, ErrorCode.BAD_FIELD, "unknown field"),
    ({"op": "GET", "id": 1, **AUTH}, ErrorCode.BAD_FIELD, "'key'"),
    ({"op": "GET", "id": 1, "session": 1, "token": 5, "key": 1}, ErrorCode.BAD_FIELD, "'token'"),
    ({"op": "FREE", "id": 1, **AUTH}, ErrorCode.BAD_FIELD, "exactly one"),
    ({"op": "FREE", "id": 1, **AUTH, "step": 1, "all": True}, ErrorCode.BAD_FIELD, "exactly one"),
    # the handler frees every key where 'all' is given: 'all: false' freed the whole session
    ({"op": "FREE", "id": 1, **AUTH, "all": False}, ErrorCode.BAD_FIELD, "'all' must be true"),
    ({"op": "FREE", "id": 1, **AUTH, "keys": [1, -2]}, ErrorCode.BAD_FIELD, "'keys'"),
    ({"op": "SEAL", "id": 1, **AUTH, "key": 1, "checksum": 1 << 64}, ErrorCode.BAD_FIELD, "'checksum'"),
])
def test_malformed_requests(msg, code, match):
    refused(msg, code, match)


def test_every_error_code_is_listed():
    assert ErrorCode.POOL_FULL in ALL_ERROR_CODES and len(ALL_ERROR_CODES) >= 10
    assert PROTOCOL_VERSION >= 1
    assert msgpack.unpackb(pack({"a": 1})) == {"a": 1}
