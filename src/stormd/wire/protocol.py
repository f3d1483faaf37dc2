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
FREE   keys?:[int] step?:int all?:true   (exactly one of them)
       -> freed:int
STATS  -> session:{...} node:{...}
       session: keys puts gets bytes_in raw_bytes_in bytes_out pool_full quota_refused held_bytes
                peak_held_bytes spilled_bytes name quota priority plan_hits plan_misses
                planned_footprint plan_peak_live plan_first_fit plan ("using X of Y bytes ...")
       node:    capacity used peak fragmentation free_extents largest_free keys spill
                spill_capacity spilled_bytes spilled_total read_back_total read_back_on_get
                prefetched spill_write_errors spill_read_errors plan_hits plan_misses clients errors
                cuda_segments (clients' GPU memory segments the daemon has open through CUDA IPC)
                page_locked_bytes (bytes of the pool the store's process page-locked for CUDA
                copies: stormd's at start where it copies CUDA memory itself, else 0; the
                embedded store's, what its training process locked for its own copies)
PING   -> time:float draining?:{reason:str since:float}
                            (session and token optional; refreshes the heartbeat. ``draining``
                             while the daemon drains: ``reason`` the signal or "DRAIN request",
                             ``since`` its time.time() when the drain began)
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

Unasked messages: id 0, ok true and probe true, so a client drops them as it drops any reply it
waits for none of (``notice``). PROBE has nothing else: the daemon sends it to learn whether a
client's socket is still there, to every client socket holding a session whenever one disconnects
(and before a HELLO that finds it full). STOPPING, sent to every client socket holding a session as the
daemon stops after a drain, has stopping:true and the PING reply's ``draining``: the client
knows at once that it is gone, and why, rather than after a silence.

Admin verbs (``stormctl``), without session or token: whoever can open the
socket (mode 0600, the daemon's user) may run them.

STATUS -> server:str version:int uptime_s:float draining:bool traffic:{...} node:{...}
          startup_s:float|nil   (seconds from the daemon's process start to serving; nil where unknown)
          page_lock_s:float|nil (seconds page-locking the pool took at start; nil: the daemon
                                 page-locked none, node.page_locked_bytes 0)
CLIENTS -> clients:[{session pid host connected_s idle_s keys puts gets bytes_in bytes_out ...}] total:int
                            (those holding the most bytes first, as many as fit in a message of
                             MAX_MESSAGE_BYTES; total counts every session)
DRAIN  -> as STATUS         (refuse PUT and HELLO from now on; the daemon exits when
                             clients hold nothing more or its drain deadline passes)

A reply may carry keys a client does not know, and a client reads the ones it knows by name, so
a key added to a reply needs no new PROTOCOL_VERSION (STATUS' startup_s and page_lock_s and STATS'
page_locked_bytes came so); readers of a newer key take its absence as an older daemon's. A
request's fields are checked exactly, so a field added there does.

``nbytes`` counts the bytes of the whole storage the tensor views; ``shape``,
``strides`` (in elements) and ``storage_offset`` place the saved view in it: at most
MAX_DIMS dims, the view inside the storage, no stride larger than twice the storage's
elements or the view's extent (empty views and size-1 dims included), the shape's
elements within an int64 (check_view). Otherwise BAD_FIELD, and the client keeps the tensor.

Hostile or broken input: every frame gets exactly one reply, in the order the
client sent them; a frame that is not a request (bad msgpack, not a map, an
op that is not a known name, several frames) gets ``id`` 0. Replies a client
does not read wait for it (none is dropped) up to ``client_max_backlog``
replies or ``client_max_backlog_bytes``; past that its session ends. A client
that sends faster than the daemon answers is slowed by the socket's high-water
mark (``hwm``), not refused. Exception to "exactly one reply": a frame larger
than ``max_message_size`` (at least MAX_MESSAGE_BYTES) is dropped by ZeroMQ as
it arrives, unanswered, and its connection closed.

A frame is decoded within DecodeLimits (arrays, maps, strings, bins, and arrays and maps
over the whole message; MESSAGE_LIMITS in ``unpack``, the tighter REQUEST_LIMITS in
``unpack_request``): past one it is BAD_MESSAGE, naming the limit. An error's ``message``
is at most MAX_ERROR_CHARS characters and quotes a client's value cut to about SHOWN_CHARS.
"""

from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

# 2: stormd seals what its own CUDA copies fill; clients send no SEAL for it, which a stormd of 1 needs
# 3: a PUT's codec may be BITS_FRAME_CODEC, UPCAST_FRAME_CODEC or FLOAT32_FRAME_CODEC, which a stormd of 2 refuses
PROTOCOL_VERSION = 3
# Seconds between a client's PINGs while it has nothing else to send: what keeps an idle client's
# session alive, so stormd's client_timeout must leave room for a few of them.
CLIENT_HEARTBEAT = 1.0

# Bounds on what one message may say; larger requests are refused, not tried.
MAX_MESSAGE_BYTES = 1 << 20
# Dims of a saved view. torch sets no limit for CPU tensors, but its CUDA kernels stop at 25
# (ATen's MAX_TENSORINFO_DIMS: "CUDA Tensors cannot have more than 25 dimensions"), and a view of
# more than 32 dims of size >= 2 holds at least 2**33 elements. Models use a handful. Each dim
# costs the daemon a shape and a stride it keeps for the key's lifetime, so the cap bounds what
# one key's metadata costs; a tensor past it is refused (BAD_FIELD) and the client keeps it.
MAX_DIMS = 32
MAX_KEYS_PER_FREE = 1 << 16
MAX_INT = (1 << 63) - 1
IPC_HANDLE_BYTES = 64

# What the decoder builds from one frame, at most. These bound the decode's cost on the daemon's
# one event loop: a 1 MiB frame of a million empty arrays cost ~0.3 s to build (and to collect).
# msgpack checks a length as it reads its header, before it builds the value, and a count of the
# arrays and maps built stops the decode at the first one past the limit.


@dataclass(frozen=True)
class DecodeLimits:
    """At most this much in one decoded message (msgpack's max_*_len, per array, map, string, bin;
    ``containers`` and ``elements`` (array items and map entries) over the whole message)."""

    array_len: int
    map_len: int
    str_bytes: int
    bin_bytes: int
    containers: int
    elements: int


# Any message either side sends: ``unpack`` decodes the daemon's replies in clients and stormctl
# too, and the largest reply, CLIENTS (a row per session, as many as fit in CLIENTS_REPLY_BYTES),
# holds fewer than 3600 rows of 25 fields (a row packs to ~300 bytes: its field names alone take 250).
MESSAGE_LIMITS = DecodeLimits(
    array_len=MAX_KEYS_PER_FREE,  # FREE's keys; CLIENTS' rows
    map_len=256,                  # a request has at most 14 fields; STATS', STATUS' and a row's maps ~30
    str_bytes=16 << 10,           # HELLO's host: 256 characters (1 KiB of UTF-8); the pool's path (4 KiB)
    bin_bytes=4 << 10,            # the 64-byte CUDA IPC handles; replies carry none
    containers=1 << 13,           # a request has at most 4; a CLIENTS reply one a row
    elements=1 << 18)             # CLIENTS: ~90k fields; the 1 MiB frame holds no more than ~250k anyway
# A request, at most: what the daemon's decode of a frame from a client should allow (see
# unpack_request). A decode under these costs a few milliseconds whatever the frame says.
REQUEST_LIMITS = DecodeLimits(
    array_len=MAX_KEYS_PER_FREE, map_len=32, str_bytes=1 << 10, bin_bytes=IPC_HANDLE_BYTES,
    containers=8, elements=MAX_KEYS_PER_FREE + 256)
# An error message's length, whatever it quotes: a reply that echoed the request (a repr of a
# 1 MiB op was 6 MB) would pin that much in the daemon's send pipe for every reply left unread.
MAX_ERROR_CHARS = 1024
SHOWN_CHARS = 120         # of one client-supplied value quoted in a message

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
# What a PUT may say its bytes are: a codec's serialized form, or a frame, which CUDA tensors are
# stored in at a size fixed before encoding: ancf_exp's (storm.kernels.frame) for bf16, one bit an
# element (storm.kernels.bits_frame) for bool, the high halves (storm.kernels.upcast_frame) for
# float32 widened from bf16, ancf_exp's on the high halves (storm.kernels.float32_frame) for other
# float32.
FRAME_CODEC = "ancf_exp_frame"
BITS_FRAME_CODEC = "bits_frame"
UPCAST_FRAME_CODEC = "upcast_frame"
FLOAT32_FRAME_CODEC = "float32_frame"
STORED_CODECS = (*CODECS, FRAME_CODEC, BITS_FRAME_CODEC, UPCAST_FRAME_CODEC, FLOAT32_FRAME_CODEC)


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
        if len(message) > MAX_ERROR_CHARS:  # a bound for every message, wherever it was built
            message = f"{message[:MAX_ERROR_CHARS - 40]}... ({len(message)} characters in all)"
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- field checks -----------------------------------------------------------

_reprs = reprlib.Repr()
_reprs.maxlevel, _reprs.maxstring, _reprs.maxother = 2, SHOWN_CHARS, SHOWN_CHARS
_reprs.maxlist = _reprs.maxtuple = _reprs.maxdict = _reprs.maxset = 6


def show(v: Any) -> str:
    """A client-supplied value as an error message may quote it: at most about SHOWN_CHARS
    characters, with its length when cut, at a cost that does not grow with the value (reprlib
    looks at a container's first few items and at a string's ends only)."""
    text = _reprs.repr(v)
    if len(text) > SHOWN_CHARS:  # reprlib bounds each item, not how many nested ones add up to
        text = text[:SHOWN_CHARS] + "..."
    if "..." in text and isinstance(v, (str, bytes, list, tuple, dict)):
        unit = "characters" if isinstance(v, str) else "bytes" if isinstance(v, bytes) else "items"
        text += f" ({len(v)} {unit})"
    return text


def _int(lo: int = 0, hi: int = MAX_INT) -> Callable[[str, Any], int]:
    def check(name: str, v: Any) -> int:
        if type(v) is int and lo <= v <= hi:  # most fields of every request: no isinstance calls
            return v
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' = {show(v)} is out of range [{lo}, {hi}]")
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
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' = {show(v)} is not one of {sorted(options)}")
        return v
    return check


def _int_list(max_len: int, lo: int = 0, hi: int = MAX_INT) -> Callable[[str, Any], list[int]]:
    item = _int(lo, hi)

    def check(name: str, v: Any) -> list[int]:
        if not isinstance(v, (list, tuple)) or len(v) > max_len:
            got = f"{len(v)} items" if isinstance(v, (list, tuple)) else type(v).__name__
            raise ProtocolError(ErrorCode.BAD_FIELD, f"field '{name}' must be a list of at most {max_len} integers, "
                                                     f"got {got}")
        # At C speed for the usual case (FREE's 65536 keys: ~3 ms, not ~10 ms of one check per
        # key); the item checks then name the first bad one. bool, an int's subclass, is no int here.
        if set(map(type, v)) <= {int} and (not v or (lo <= min(v) and max(v) <= hi)):
            return list(v)
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
# what parse_request walks: op -> its fields, the required first, each (name, check, required)
_FIELDS = {op: tuple((n, c, f is req) for f in (req, opt) for n, c in f.items()) for op, (req, opt) in SCHEMAS.items()}
_ID, _ABSENT = _int(), object()


@dataclass(frozen=True)
class Request:
    op: str
    id: int
    fields: dict[str, Any]


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def packer() -> Callable[[dict[str, Any]], bytes]:
    """pack for one thread's many messages: one encoder and its buffer, where packb makes both per call."""
    return msgpack.Packer(use_bin_type=True).pack


_LIMIT_NAMES = {"max_array_len": ("an array", "items", "array_len"), "max_map_len": ("a map", "entries", "map_len"),
                "max_str_len": ("a string", "bytes", "str_bytes"), "max_bin_len": ("a bin", "bytes", "bin_bytes"),
                "max_ext_len": ("an ext value", "bytes", "the protocol has no ext types")}
_EXCEEDS = re.compile(r"(\d+) exceeds (max_\w+_len)\((\d+)\)")  # msgpack's wording for a length past its limit


class _Overflow(Exception):
    pass


def unpack(frame: bytes, limits: DecodeLimits = MESSAGE_LIMITS) -> Any:
    """Decode one frame; anything that is not a msgpack value within ``limits`` (and
    MAX_MESSAGE_BYTES) is BAD_MESSAGE, whose message names the limit it passed."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"message of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    containers = elements = 0

    def count(built: Any) -> Any:  # msgpack calls it with each array and map once it has built it
        nonlocal containers, elements
        containers += 1
        elements += len(built)
        if containers > limits.containers or elements > limits.elements:
            raise _Overflow
        return built

    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
                               max_array_len=limits.array_len, max_map_len=limits.map_len,
                               max_str_len=limits.str_bytes, max_bin_len=limits.bin_bytes, max_ext_len=0)
    except _Overflow:
        raise ProtocolError(ErrorCode.BAD_MESSAGE,
                            f"message holds more than {limits.containers} arrays and maps (containers) or "
                            f"{limits.elements} items and entries in them (elements)") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        limit = _EXCEEDS.search(str(e)) if isinstance(e, ValueError) else None
        if limit is None:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"not a msgpack message: {type(e).__name__}") from None
        n, name, most = limit.groups()
        what, unit, field = _LIMIT_NAMES.get(name, (name, "", name))
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"message holds {what} of {n} {unit}; at most {most} are "
                                                   f"accepted ({field})") from None


def unpack_request(frame: bytes) -> Any:
    """Decode a frame from a client, within REQUEST_LIMITS: what the largest valid request needs
    (FREE's 65536 keys, PUT's MAX_DIMS dims and ``cuda`` map), so that no frame costs the daemon's
    loop more than a few milliseconds to decode. ``unpack``'s MESSAGE_LIMITS fit replies too,
    whose largest (CLIENTS) decode for ~10 ms, and then a hostile request may cost ~10x that."""
    return unpack(frame, REQUEST_LIMITS)


def request_id(msg: Any) -> int:
    """The id to echo in an error reply, or 0 when the message has none usable."""
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_INT else 0


def parse_request(msg: Any) -> Request:
    """Validate a decoded message against its schema; unknown fields are refused."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a request is a map, got {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMAS:  # an unhashable op (a list, a map) must not raise TypeError
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {show(op)}; known: {', '.join(OPS)}")
    rid = _ID("id", msg.get("id"))
    fields: dict[str, Any] = {}
    for name, check, required in _FIELDS[op]:
        v = msg.get(name, _ABSENT)
        if v is not _ABSENT:
            fields[name] = check(name, v)
        elif required:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} needs field '{name}'")
    if len(msg) != len(fields) + 2:  # more than op, id and the fields taken: the names only for a refusal
        unknown = [name for name in msg if name not in fields and name not in ("op", "id")]
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{op} has unknown field(s) {', '.join(map(show, unknown[:4]))}"
                                                 f"{more}; it takes {', '.join(SCHEMAS[op][0] | SCHEMAS[op][1])}")
    if op == "PUT":
        check_view(fields)
    if op == "FREE" and sum(k in fields for k in ("keys", "step", "all")) != 1:
        raise ProtocolError(ErrorCode.BAD_FIELD, "FREE takes exactly one of 'keys', 'step', 'all'")
    if op == "FREE" and fields.get("all") is False:  # the handler frees every key where 'all' is given
        raise ProtocolError(ErrorCode.BAD_FIELD, "FREE's 'all' must be true (every key of the session); "
                                                 "to free some keys, give 'keys' or 'step'")
    return Request(op, rid, fields)


def check_view(f: dict[str, Any]) -> None:
    """The view (shape, strides, storage_offset) must lie inside the storage (``raw_nbytes``), and
    none of its numbers may be larger than a view of that storage can need: the daemon keeps them
    for the key's lifetime, and a PUT of one byte could otherwise make it keep 2 x MAX_DIMS
    integers of any size (an empty view's, or a size-1 dim's, were not checked at all)."""
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
    elements = raw // itemsize
    # torch counts a tensor's elements in an int64, size-0 dims aside (an empty view may have any
    # other dims). Only a dim of stride 0 (expand) can be longer than the storage: the reach check
    # below holds the others to it.
    extent = math.prod(max(n, 1) for n in shape)
    if extent > MAX_INT:
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"shape {show(shape)} has more elements than torch can count ({MAX_INT})")
    if 0 not in shape:
        last = f["storage_offset"] + sum((n - 1) * s for n, s in zip(shape, strides))
        if (last + 1) * itemsize > raw:
            raise ProtocolError(ErrorCode.BAD_FIELD,
                                f"view reaches element {last} but the storage holds {elements}")
    # A stride that reaches no element (a size-1 dim's, or any of an empty view's) is whatever the
    # op that made the view computed: unsqueeze gives size x stride of the next dim and diagonal the
    # sum of two strides (either at most twice the storage), a slice with a step past the dim's end
    # the step, a reshape of an empty view its own contiguous strides (at most its extent). Larger
    # ones, which take as_strided or such a slice, are refused: the client keeps that tensor.
    most = max(2 * elements, extent)
    if strides and max(strides) > most:  # at C speed; the first past it named
        i, s = next((i, s) for i, s in enumerate(strides) if s > most)
        raise ProtocolError(ErrorCode.BAD_FIELD, f"stride {s} of dim {i} is larger than a view of a storage of "
                                                 f"{elements} elements and shape {show(shape)} has (at most {most})")
    if f["storage_offset"] > elements:  # an empty view may start just past the end (t[len(t):])
        raise ProtocolError(ErrorCode.BAD_FIELD,
                            f"storage_offset {f['storage_offset']} lies past the storage's {elements} elements")


def notice(**fields: Any) -> dict[str, Any]:
    """An unasked message to a client (see the module's "Unasked messages")."""
    return {"id": 0, "ok": True, "probe": True, **fields}


def ok(rid: int, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **fields}


def error(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": code, "message": message}
