"""stormd: the per-node daemon that owns STORM's host pool and activation store."""

from .wire.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION"]
