"""CURVE authentication and encryption for tcp:// sockets: the server's half.

A tcp:// port on loopback is open to every local user, so stormd serves it only
with CURVE; the key files, the client's half and why are in stormd/wire/curve.py.
"""

from __future__ import annotations

from pathlib import Path

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator

from .wire.curve import CurveKeyError, load_key


def secure_server(sock: zmq.Socket, ctx: zmq.Context, secret_key: str, authorized_dir: str) -> AsyncioAuthenticator:
    """Make ``sock`` a CURVE server admitting only the authorized keys. Call before bind, in the event loop."""
    public, secret = load_key(secret_key, "curve_secret_key", need_secret=True)
    d = Path(authorized_dir)
    if not d.is_dir() or not any(d.glob("*.key")):
        raise CurveKeyError(f"curve_authorized_keys: {authorized_dir} is not a directory holding client public "
                            f"key files (*.key); with none, no client could connect")
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(d))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth
