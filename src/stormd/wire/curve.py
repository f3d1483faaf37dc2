"""CURVE keys for tcp:// sockets (ZeroMQ's CurveZMQ, key files in zmq.auth's format): the client's half.

Why: an ipc:// socket is protected by the permissions of its directory, but a
tcp:// port on loopback is open to every local user. So stormd serves tcp://
only with CURVE (stormd/auth.py, the server's half): the server proves itself
with its secret key, and only clients whose public key lies in
``curve_authorized_keys`` get through the ZAP handshake; everyone else's
connection is closed before a message is read.

Keys are made with ``zmq.auth.create_certificates(dir, name)`` (``name.key``:
public, ``name.key_secret``: both halves). The client reads its own secret file
from ``$STORM_CURVE_SECRET_KEY`` and the server's public file from
``$STORM_CURVE_SERVER_KEY``.
"""

from __future__ import annotations

import os
from typing import Literal, Mapping, overload

import zmq
import zmq.auth

CLIENT_SECRET_ENV = "STORM_CURVE_SECRET_KEY"
SERVER_PUBLIC_ENV = "STORM_CURVE_SERVER_KEY"


class CurveKeyError(RuntimeError):
    """A CURVE key file is missing or unreadable; the message names the setting."""


@overload
def load_key(path: str, setting: str, need_secret: Literal[True]) -> tuple[bytes, bytes]: ...
@overload
def load_key(path: str, setting: str, need_secret: bool) -> tuple[bytes, bytes | None]: ...


def load_key(path: str, setting: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of a zmq.auth key file; the secret is None in a public file, which
    ``need_secret`` refuses. Errors name ``setting``, the variable or setting that gave the path."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"{setting}: cannot read CURVE key file {path}: {e}") from None
    if need_secret and not secret:
        raise CurveKeyError(f"{setting}: {path} holds no secret key (use the .key_secret file)")
    return public, secret


def client_curve_options(endpoint: str, environ: Mapping[str, str] | None = None) -> dict[int, bytes]:
    """Socket options giving a client of ``endpoint`` its CURVE keys, read from the environment
    (none for an ipc:// endpoint, which needs none); raises CurveKeyError naming the variable that is
    missing or unreadable. The library's connection and stormctl both set their sockets up with it,
    so whatever reaches a daemon as a client reaches it as an operator too."""
    if not endpoint.startswith("tcp://"):
        return {}
    env = os.environ if environ is None else environ
    missing = [v for v in (CLIENT_SECRET_ENV, SERVER_PUBLIC_ENV) if not env.get(v)]
    if missing:
        raise CurveKeyError(f"{endpoint}: a tcp:// stormd requires CURVE keys; set {' and '.join(missing)}")
    public, secret = load_key(env[CLIENT_SECRET_ENV], CLIENT_SECRET_ENV, need_secret=True)
    server_public, _ = load_key(env[SERVER_PUBLIC_ENV], SERVER_PUBLIC_ENV, need_secret=False)
    return {zmq.CURVE_SECRETKEY: secret, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SERVERKEY: server_public}
