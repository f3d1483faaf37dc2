"""The stormd wire protocol: every message, its fields and its errors, in one place.

Transport: one ZeroMQ ROUTER socket in the daemon, one DEALER per client
process. Each message is a single frame holding one msgpack map. Every
request carries ``op`` and a client-chosen integer ``id``; the reply echoes
``id`` and has ``ok``. A failed request gets ``ok: false`` with ``error`` (one
of the codes below) and a human ``message``; the daemon keeps serving.

Requests other than HELLO and PING also carry ``session`` and ``token`` from
the HELLO reply, so a client can only see and free its own keys.

Verbs (field: type; ``?`` marks optional):

HELLO  version:int pid:int host:str name?:str   (name picks the client's quota and priority
                                                in stormd's `clients` setting)
       -> session:int token:str pool:{path:str size:int} server:str
          codec:str             (how the daemon's configuration asks clients to encode tensors: raw,
                                 auto or a codec of CODECS; clients encode, the store keeps bytes.
                                 CUDA tensors: auto and ancf_exp mean frames, the others raw)
          cuda_devices:[str]    (UUIDs of the GPUs whose memory the daemon copies itself through
                                 CUDA IPC, the ``cuda`` field below; empty: clients copy CUDA
                                 tensors into the pool themselves)
       TOO_MANY_SESSIONS: this socket holds max_sessions_per_peer sessions already, or the
       daemon serves max_sessions
PUT    key:int step:int nbytes:int dtype:str shape:[int] strides:[int]
       storage_offset:int codec:str raw_nbytes?:int cuda?:CUDA   (codec: one of STORED_CODECS)
       -> offset:int            (an extent of ``nbytes`` in the pool, reserved. With a codec other
                                 than raw, nbytes is the encoded size and raw_nbytes the storage's
                                 size, which the view must fit; for raw they are equal. With
                                 ``cuda`` the daemon has queued the copy of the ``nbytes`` at
                                 the handle's segment + offset into the extent; ``done`` fires
                                 when it has finished, and the daemon seals the key itself then:
                                 the client sends no SEAL)
SEAL   key:int checksum?:int    -> {}   (the copy into the extent has finished; GET may return
                                         it. Without checksum (CUDA copies) the bytes are not
                                         verified on GET. For the daemon's own copies it is not
                                         needed, and COPY_IN_FLIGHT while such a copy still runs)
GET    key:int cuda?:CUDA
       -> offset nbytes raw_nbytes dtype shape strides storage_offset codec checksum (int or nil)
                                (offset is where the bytes are now: between SEAL and GET the
                                 daemon may have spilled them to disk and read them back
                                 elsewhere; after GET they stay put until FREE. With ``cuda``
                                 the daemon has queued the copy of the ``nbytes`` stored into
                                 the handle's segment + offset; ``done`` fires when it has
                                 finished. COPY_IN_FLIGHT: the daemon's copy into the key,
                                 from its PUT, has not finished: wait for that PUT's ``done``.
                                 SPILL_FAILED: reading the key back from the spill file
                                 failed; its bytes are lost (that key's only): FREE it)
FREE   keys?:[int] step?:int all?:bool   (exactly one of them)
       -> freed:int
STATS  -> session:{...} node:{...}
       session: keys puts gets bytes_in raw_bytes_in bytes_out pool_full quota_refused held_bytes
                peak_held_bytes spilled_bytes name quota priority plan_hits plan_misses
                planned_footprint plan_peak_live plan_first_fit plan ("using X of Y bytes ...")
       node:    capacity used peak fragmentation free_extents largest_free keys spill
                spill_capacity spilled_bytes spilled_total read_back_total read_back_on_get
                prefetched spill_write_errors spill_read_errors plan_hits plan_misses clients errors
                cuda_segments (clients' GPU memory segments the daemon has open through CUDA IPC)
PING   -> time:float        (session and token optional; refreshes the heartbeat)
BYE    -> freed:int         (frees everything of the session and ends it)

CUDA (the ``cuda`` field of PUT and GET; stormd/copier.py copies):
       handle:bin[64]   cudaIpcMemHandle_t of the cudaMalloc segment holding the client's bytes
       offset:int       where the bytes start in that segment
       device:str       the GPU's UUID (as torch spells it; indices differ between processes)
       ready:bin[64]    cudaIpcEventHandle_t of an interprocess event the client recorded where the
                        bytes are complete (PUT) or the destination may be written (GET)
       done:bin[64]     cudaIpcEventHandle_t of an interprocess event the daemon records after the copy
       Errors: NO_CUDA (the daemon copies no CUDA memory, or not of that GPU), BAD_HANDLE (a handle
       that does not open, a range past its segment's end, an event of another GPU). A PUT that
       fails so stores nothing. FREE of a key whose copy still runs answers at once and frees its
       extent once the copy has finished; so does the end of a session.

Admin verbs (``stormctl``), without session or token: whoever can open the
socket (mode 0600, the daemon's user) may run them.

STATUS -> server:str version:int uptime_s:float draining:bool traffic:{...} node:{...}
CLIENTS -> clients:[{session pid host connected_s idle_s keys puts gets bytes_in bytes_out ...}] total:int
                            (those holding the most bytes first, as many as fit in a message of
                             MAX_MESSAGE_BYTES; total counts every session)
DRAIN  -> as STATUS         (refuse PUT and HELLO from now on; the daemon exits when
                             clients hold nothing more or its drain deadline passes)

``nbytes`` counts the bytes of the whole storage the tensor views; ``shape``,
``strides`` (in elements) and ``storage_offset`` place the saved view in it.

Hostile or broken input: every frame gets exactly one reply, in the order the
client sent them; a frame that is not a request (bad msgpack, not a map, an
op that is not a known name, several frames) gets ``id`` 0. Replies a client
does not read wait for it (none is dropped) up to ``client_max_backlog``
replies or ``client_max_backlog_bytes``; past that its session ends. A client
that sends faster than the daemon answers is slowed by the socket's high-water
mark (``hwm``), not refused. Exception to "exactly one reply": a frame larger
than ``max_message_size`` (at least MAX_MESSAGE_BYTES) is dropped by ZeroMQ as
it arrives, unanswered, and its connection closed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

# 2: stormd seals what its own CUDA copies fill; clients send no SEAL for it, which a stormd of 1 needs
PROTOCOL_VERSION = 2

# Bounds on what one message may say; larger requests are refused, not tried.
MAX_MESSAGE_BYTES = 1 << 20
MAX_DIMS = 64
MAX_KEYS_PER_FREE = 1 << 16
MAX_INT = (1 << 63) - 1

# dtype name -> item size in bytes. Names are torch's ("float32", "bfloat16").
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
# storm.kernels' codecs by name (a test keeps the two lists equal; stormd never decodes).
CODECS = ("raw", "ancf", "ancf_exp", "huff_exp", "zero", "pack", "zstd")
# What a PUT may say its bytes are: a codec's serialized form, or a frame (storm.kernels.frame:
# ancf_exp at a size fixed before encoding, which CUDA tensors are stored in).
FRAME_CODEC = "ancf_exp_frame"
STORED_CODECS = (*CODECS, FRAME_CODEC)


class ErrorCode:
    """Error codes a reply may carry (``error`` field)."""

    BAD_MESSAGE = "BAD_MESSAGE"            # not msgpack, not a map, too large
    BAD_FIELD = "BAD_FIELD"                # missing, wrong type or out of range
    UNKNOWN_OP = "UNKNOWN_OP"
    VERSION_MISMATCH = "VERSION_MISMATCH"  # HELLO from another protocol version
    UNAUTHORIZED = "UNAUTHORIZED"          # unknown session or wrong token
    NOT_FOUND = "NOT_FOUND"                # no such key in this session
    DUPLICATE_KEY = "DUPLICATE_KEY"        # PUT of a key the session already has
    NOT_SEALED = "NOT_SEALED"              # GET before SEAL
    POOL_FULL = "POOL_FULL"                # no extent that large is free now (and spill is off or full)
    QUOTA = "QUOTA"                        # the client's quota (stormd config) would be exceeded
    TOO_LARGE = "TOO_LARGE"                # larger than the whole pool
    NO_CUDA = "NO_CUDA"                    # a ``cuda`` field, but the daemon copies no memory of that GPU
    BAD_HANDLE = "BAD_HANDLE"              # a CUDA IPC handle or event that does not open or fit
    COPY_IN_FLIGHT = "COPY_IN_FLIGHT"      # the daemon's copy into the key (or segment) has not finished
    DRAINING = "DRAINING"                  # daemon is shutting down
    SPILL_FAILED = "SPILL_FAILED"          # GET of a key whose read-back from the spill file failed: its bytes are lost
    TOO_MANY_SESSIONS = "TOO_MANY_SESSIONS"  # HELLO beyond max_sessions_per_peer or max_sessions
    INTERNAL = "INTERNAL"


ALL_ERROR_CODES = frozenset(v for k, v in vars(ErrorCode).items() if k.isupper())


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an error reply, never a crash."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- field checks -----------------------------------------------------------

def _int(lo: int = 0, hi: int = MAX_INT) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' = {v} is out of range [{lo}, {hi}]")
        return v
    return check


def _str(max_len: int = 256) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be a string of at most {max_len} characters")
        return v
    return check


def _choice(options: Any) -> Callable[[str, Any], str]:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str) or v not in options:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' = {v!r} is not one of {sorted(options)}")
        return v
    return check


def _int_list(max_len: int, lo: int = 0) -> Callable[[str, Any], list[int]]:
    item = _int(lo)

    def check(name: str, v: Any) -> list[int]:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be a list of at most {max_len} integers")
        return [item(name, x) for x in v]
    return check


def _bytes(length: int) -> Callable[[str, Any], bytes]:
    def check(name: str, v: Any) -> bytes:
        if not isinstance(v, bytes) or len(v) != length:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be {length} bytes (msgpack bin)")
        return v
    return check


def _map(fields: dict[str, Callable[[str, Any], Any]]) -> Callable[[str, Any], dict[str, Any]]:
    """A nested map with exactly these fields."""
    def check(name: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict) or set(v) != set(fields):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be a map of exactly {sorted(fields)}")
        return {k: c(f"{name}.{k}", v[k]) for k, c in fields.items()}
    return check


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be true or false")
    return v


_AUTH = {"session": _int(1), "token": _str(64)}
IPC_HANDLE_BYTES = 64
_CUDA = _map({"handle": _bytes(IPC_HANDLE_BYTES), "offset": _int(), "device": _str(64),
              "ready": _bytes(IPC_HANDLE_BYTES), "done": _bytes(IPC_HANDLE_BYTES)})

# op -> (required fields, optional fields)
SCHEMAS: dict[str, tuple[dict[str, Callable], dict[str, Callable]]] = {
    "HELLO": ({"version": _int(), "pid": _int(), "host": _str()}, {"name": _str(64)}),
    "PUT": ({**_AUTH, "key": _int(), "step": _int(), "nbytes": _int(1),
             "dtype": _choice(DTYPE_SIZES), "shape": _int_list(MAX_DIMS),
             "strides": _int_list(MAX_DIMS), "storage_offset": _int(),
             "codec": _choice(STORED_CODECS)}, {"raw_nbytes": _int(1), "cuda": _CUDA}),
    "SEAL": ({**_AUTH, "key": _int()}, {"checksum": _int(0, (1 << 64) - 1)}),
    "GET": ({**_AUTH, "key": _int()}, {"cuda": _CUDA}),
    "FREE": (dict(_AUTH), {"keys": _int_list(MAX_KEYS_PER_FREE), "step": _int(), "all": _bool}),
    "STATS": (dict(_AUTH), {}),
    "PING": ({}, dict(_AUTH)),
    "BYE": (dict(_AUTH), {}),
    "STATUS": ({}, {}),
    "CLIENTS": ({}, {}),
    "DRAIN": ({}, {}),
}
OPS = tuple(SCHEMAS)
ADMIN_OPS = frozenset({"STATUS", "CLIENTS", "DRAIN"})


@dataclass(frozen=True)
class Request:
    op: str
    id: int
    fields: dict[str, Any]


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    """Decode one frame; anything that is not a bounded msgpack value is BAD_MESSAGE."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message: {type(e).__name__}") from None


def request_id(msg: Any) -> int:
    """The id to echo in an error reply, or 0 when the message has none usable."""
    if isinstance(msg, dict):
        rid = msg.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_INT:
            return rid
    return 0


def parse_request(msg: Any) -> Request:
    """Validate a decoded message against its schema; unknown fields are refused."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a request is a map, got {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMAS:  # an unhashable op (a list, a map) must not raise TypeError
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(OPS)}")
    rid = _int()("id", msg.get("id"))
    required, optional = SCHEMAS[op]
    fields: dict[str, Any] = {}
    for name, check in required.items():
        if name not in msg:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} needs field '{name}'")
        fields[name] = check(name, msg[name])
    for name, check in optional.items():
        if name in msg:
            fields[name] = check(name, msg[name])
    unknown = set(msg) - set(required) - set(optional) - {"op", "id"}
    if unknown:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} has unknown field(s) {sorted(map(str, unknown))}")
    if op == "PUT":
        check_view(fields)
    if op == "FREE" and sum(k in fields for k in ("keys", "step", "all")) != 1:
        raise ProtocolError(ErrorCode.BAD_FIELD, "FREE takes exactly one of 'keys', 'step', 'all'")
    return Request(op, rid, fields)


def check_view(f: dict[str, Any]) -> None:
    """The view (shape, strides, storage_offset) must lie inside the storage (``raw_nbytes``)."""
    shape, strides = f["shape"], f["strides"]
    if len(shape) != len(strides):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"shape has {len(shape)} dims but strides has {len(strides)}")
    raw = f.setdefault("raw_nbytes", f["nbytes"])
    if f["codec"] == "raw" and raw != f["nbytes"]:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"codec raw stores the storage as it is: raw_nbytes {raw} "
                                                 f"must equal nbytes {f['nbytes']}")
    itemsize = DTYPE_SIZES[f["dtype"]]
    if raw % itemsize:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"storage of {raw} bytes is not a multiple of the {f['dtype']} "
                                                 f"item size")
    if math.prod(shape) == 0:
        return
    last = f["storage_offset"] + sum((n - 1) * s for n, s in zip(shape, strides))
    if (last + 1) * itemsize > raw:
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"view reaches element {last} but the storage holds {raw // itemsize}")


def ok(rid: int, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **fields}


def error(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": code, "message": message}
