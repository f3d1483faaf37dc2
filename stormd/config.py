"""Daemon settings and where the socket lives (shared with the client, which must find it)."""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

SOCKET_ENV = "STORMD_SOCKET"
SOCKET_NAME = "stormd.sock"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """'8GiB', '512MiB', '1.5GB', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use bytes or a number with a unit such as 512MiB or 8GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def runtime_dir() -> Path:
    """Private directory of this uid for the socket: $XDG_RUNTIME_DIR/stormd, else /tmp/stormd-UID."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "stormd"
    return Path(f"/tmp/stormd-{os.getuid()}")


def default_endpoint() -> str:
    return os.environ.get(SOCKET_ENV) or f"ipc://{runtime_dir() / SOCKET_NAME}"


def normalize_endpoint(value: str | None) -> str:
    """A path, ipc://PATH or tcp://LOOPBACK:PORT -> a ZeroMQ endpoint; None -> the default."""
    if not value:
        return default_endpoint()
    if value.startswith("ipc://"):
        return value
    if value.startswith("tcp://"):
        u = urlsplit(value)
        try:
            loopback = ipaddress.ip_address(u.hostname or "").is_loopback
        except ValueError:
            loopback = u.hostname == "localhost"
        if not loopback or not u.port:
            raise ValueError(f"socket {value!r}: tcp:// must name a loopback address and a port "
                             f"(tcp://127.0.0.1:PORT); tensors are not sent over the network")
        return value
    if "://" in value:
        raise ValueError(f"socket {value!r}: use a path, ipc://PATH or tcp://127.0.0.1:PORT")
    return f"ipc://{os.path.abspath(value)}"


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def ensure_private_dir(path: Path) -> None:
    """Create the socket's directory 0700; refuse one that another user owns or others can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"socket directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o007:
        raise PermissionError(f"socket directory {path} is open to other users (mode {oct(stat.S_IMODE(st.st_mode))}); "
                              f"chmod o-rwx it")


@dataclass
class DaemonConfig:
    socket: str
    pool_size: int = 1 << 30
    pool_dir: str = "/dev/shm"
    client_timeout: float = 10.0  # seconds without a message before a client is dropped
    log_level: str = "INFO"
