"""Where stormd's socket lives: stormd binds it, the client and stormctl find it, all through here.

An endpoint is a path, ``ipc://PATH`` or ``tcp://LOOPBACK:PORT``; not given, it is
``$STORMD_SOCKET``, else ``stormd.sock`` in a directory private to this uid. What one side accepts
the others do, since they read it with the same function.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

import zmq

SOCKET_ENV = "STORMD_SOCKET"
SOCKET_NAME = "stormd.sock"


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Private directory of this uid for the socket: $XDG_RUNTIME_DIR/stormd, else /tmp/stormd-UID."""
    xdg = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        return Path(xdg) / "stormd"
    return Path(f"/tmp/stormd-{os.getuid()}")


ACCEPTED = "a path, ipc://PATH or tcp://127.0.0.1:PORT"


def normalize_endpoint(value: object, environ: Mapping[str, str] | None = None) -> str:
    """The ZeroMQ endpoint of a socket given as a path, ipc://PATH or tcp://LOOPBACK:PORT; for None
    (not given) $STORMD_SOCKET, read the same way, else the runtime directory's socket. stormd, the
    client and stormctl all find the socket here, so what one accepts the others do. ``value`` may be
    anything a user gave (a str, a path, None): anything else is a ValueError."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"socket must be {ACCEPTED}; got {value!r}")
    if value is not None and value and not value.strip():
        raise ValueError(f"socket {value!r} is blank: give {ACCEPTED}")
    if not value:
        env = os.environ if environ is None else environ
        if not env.get(SOCKET_ENV):
            return f"ipc://{runtime_dir(env) / SOCKET_NAME}"
        try:
            return normalize_endpoint(env[SOCKET_ENV])
        except ValueError as e:
            raise ValueError(f"{SOCKET_ENV}: {e}") from None
    if value.startswith("ipc://"):
        path = value[len("ipc://"):]
        if not path.strip():
            raise ValueError(f"socket {value!r} names no path: give {ACCEPTED}")
        return _fits_unix_socket(f"ipc://{os.path.abspath(path)}")  # absolute, as a plain path is made
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
        raise ValueError(f"socket {value!r}: use {ACCEPTED}")
    return _fits_unix_socket(f"ipc://{os.path.abspath(value)}")


def _fits_unix_socket(endpoint: str) -> str:
    """A unix socket's path has a fixed room in the kernel's address (sun_path); a longer one fails
    only at bind or connect, deep in ZeroMQ."""
    n = len(endpoint[len("ipc://"):].encode())
    if n > zmq.IPC_PATH_MAX_LEN:
        raise ValueError(f"socket {endpoint!r}: its path is {n} bytes and a unix socket's may have at most "
                         f"{zmq.IPC_PATH_MAX_LEN}; use a shorter one, e.g. in $XDG_RUNTIME_DIR")
    return endpoint


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint; None for tcp://."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def ensure_private_dir(path: Path) -> None:
    """Create the socket's directory 0700; refuse one that is a symlink, that another user owns or
    that others can enter. A symlink is refused, not followed: its owner (e.g. another user who made
    /tmp/stormd-UID first) could repoint it, after this check, at a directory of theirs."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass  # checked below as it is, symlink or not
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        try:
            target = repr(os.readlink(path))
        except OSError:  # repointed or removed since
            target = "somewhere"
        raise PermissionError(f"socket directory {path} is a symlink (to {target}, owned by uid {st.st_uid}); "
                              f"stormd does not follow it, since whoever owns the link can repoint it. Accepted: "
                              f"a directory of this user that others cannot enter; remove the link, or give "
                              f"--socket a path in a directory of yours")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"socket directory {path} is not a directory; accepted: a directory of this user")
    if st.st_uid != os.getuid():
        raise PermissionError(f"socket directory {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o007:
        raise PermissionError(f"socket directory {path} is open to other users (mode {oct(stat.S_IMODE(st.st_mode))}); "
                              f"chmod o-rwx it")


def socket_is_live(path: Path) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``; a killed daemon leaves
    its socket file behind, and connecting to that fails at once instead of waiting for a reply."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
