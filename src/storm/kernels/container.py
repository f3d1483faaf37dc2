"""The self-describing container every codec produces, and its byte format.

An ``Encoded`` holds named uint8 buffers (on the device that encoded them) plus a
small msgpack-able ``meta`` dict (scalars and small tables). ``to_bytes`` lays it
out as::

    magic "STMK" | version u8 | header_len u32 | payload_len u64 | xxh3_64 u64
    | header (msgpack) | payload (the buffers, each zero-padded to a multiple of 8 bytes)

The checksum covers header and payload, so a flipped or missing byte is found
before any decoding starts. Decoders additionally check every size they read,
so an ``Encoded`` built by hand with inconsistent fields fails the same way:
with ``CorruptEncodedError`` (a ``ValueError``), never a wrong tensor.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import xxhash

MAGIC = b"STMK"
VERSION = 1
_PREFIX = struct.Struct("<4sBIQQ")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class CorruptEncodedError(ValueError):
    """Encoded data is truncated, corrupted or inconsistent; the message says which part."""


def require(cond: bool, what: str) -> None:
    """Raise CorruptEncodedError(what) unless cond: used by every decoder on every size it reads."""
    if not cond:
        raise CorruptEncodedError(what)


@dataclass
class Encoded:
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    encode_s: float = 0.0  # wall time of encode (host clock; includes a device sync on CUDA)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def raw_nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the buffers, each padded to 8 so that every buffer parses aligned."""
        return sum(_pad8(b.numel()) for b in self.buffers.values())

    @property
    def nbytes(self) -> int:
        """Exact length of ``to_bytes()``; cheap (no copy): what the store allocates."""
        return _PREFIX.size + len(self._header()) + self.payload_nbytes

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.nbytes if self.nbytes else 1.0

    @property
    def escapes(self) -> int:
        return int(self.meta.get("escapes", 0))

    @property
    def device(self) -> torch.device:
        for b in self.buffers.values():
            return b.device
        return torch.device("cpu")

    def _header(self) -> bytes:
        return msgpack.packb({
            "codec": self.codec,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "meta": self.meta,
            "buffers": [[k, int(v.numel())] for k, v in self.buffers.items()],
        }, use_bin_type=True)

    def to(self, device: torch.device | str) -> "Encoded":
        return Encoded(self.codec, self.dtype, self.shape, self.meta,
                       {k: v.to(device) for k, v in self.buffers.items()}, self.encode_s)

    def to_bytes(self) -> bytes:
        """Serialize (copies device buffers to the host)."""
        header = self._header()
        payload = b"".join(v.cpu().numpy().tobytes() + bytes(_pad8(v.numel()) - v.numel())
                           for v in self.buffers.values())
        h = xxhash.xxh3_64()
        h.update(header)
        h.update(payload)
        return _PREFIX.pack(MAGIC, VERSION, len(header), len(payload), h.intdigest()) + header + payload

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> "Encoded":
        """Parse and verify; buffers are CPU tensors (copies, so ``buf`` may be reused)."""
        mv = memoryview(buf).cast("B")
        require(len(mv) >= _PREFIX.size, f"truncated: {len(mv)} bytes, the fixed prefix alone is {_PREFIX.size}")
        magic, version, hlen, plen, digest = _PREFIX.unpack_from(mv, 0)
        require(magic == MAGIC, f"bad magic {bytes(magic)!r}: not STORM-encoded data")
        require(version == VERSION, f"unsupported format version {version} (this build reads {VERSION})")
        body = mv[_PREFIX.size:]
        require(len(body) == hlen + plen,
                f"truncated or padded: header+payload should be {hlen + plen} bytes, got {len(body)}")
        h = xxhash.xxh3_64()
        h.update(body)
        require(h.intdigest() == digest, "checksum mismatch: the encoded bytes were corrupted")
        try:
            hdr = msgpack.unpackb(bytes(body[:hlen]), raw=False)
            codec, dtype = str(hdr["codec"]), DTYPES[hdr["dtype"]]
            shape = tuple(int(s) for s in hdr["shape"])
            meta = dict(hdr["meta"])
            layout = [(str(k), int(n)) for k, n in hdr["buffers"]]
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
            raise CorruptEncodedError(f"unreadable header: {e!r}") from None
        require(all(s >= 0 for s in shape), f"negative dimension in shape {shape}")
        require(sum(_pad8(n) for _, n in layout) == plen and all(n >= 0 for _, n in layout),
                "buffer sizes in the header do not add up to the payload length")
        payload = (torch.frombuffer(bytearray(body[hlen:]), dtype=torch.uint8) if plen
                   else torch.empty(0, dtype=torch.uint8))
        buffers, off = {}, 0
        for k, n in layout:
            buffers[k] = payload[off:off + n]
            off += _pad8(n)
        return cls(codec, dtype, shape, meta, buffers)

    def buffer(self, name: str) -> torch.Tensor:
        require(name in self.buffers, f"codec {self.codec!r}: missing buffer {name!r}")
        return self.buffers[name]

    def meta_int(self, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
        v = self.meta.get(name)
        require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
                f"codec {self.codec!r}: field {name!r} is {v!r}, expected an integer in [{lo}, {hi}]")
        return v

    def meta_bytes(self, name: str, length: int | None = None) -> bytes:
        v = self.meta.get(name)
        require(isinstance(v, (bytes, bytearray)) and (length is None or len(v) == length),
                f"codec {self.codec!r}: table {name!r} missing or of wrong length")
        return bytes(v)
