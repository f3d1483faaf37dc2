"""``stormctl``: ask a running stormd how it is doing, or tell it to drain.

    stormctl status            # pool, clients, traffic, errors
    stormctl stats             # one row per connected client
    stormctl ping              # round-trip time
    stormctl drain             # refuse new tensors, exit once clients hold none
    stormctl --json status     # the daemon's reply as JSON, for scripts

Exit status: 0 on an answer, 1 when no daemon answers or it refuses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table

from .wire.endpoint import normalize_endpoint
from .wire.protocol import ProtocolError, pack, unpack
from .wire.sizes import format_size

VERBS = {"status": "STATUS", "stats": "CLIENTS", "ping": "PING", "drain": "DRAIN"}


class CtlError(Exception):
    """No answer, or an error reply; the message says which daemon and why."""


def request(endpoint: str, op: str, timeout: float) -> dict[str, Any]:
    """One request on a fresh DEALER socket (no HELLO: admin verbs and PING need no session)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(pack({"op": op, "id": 1}))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise CtlError(f"no stormd answered at {endpoint} within {timeout:g} s "
                           f"(is it running? is --socket or $STORMD_SOCKET right?)")
        try:
            reply = unpack(sock.recv())
        except ProtocolError as e:  # e.g. a reply over the size any client decodes, from an older stormd
            raise CtlError(f"stormd at {endpoint} answered {op} with a reply stormctl cannot read: "
                           f"{e.message}") from None
    finally:
        sock.close(linger=0)
    if not reply.get("ok"):
        raise CtlError(f"stormd at {endpoint} refused {op}: {reply.get('error')}: {reply.get('message')}")
    return reply


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render_status(reply: dict[str, Any], endpoint: str) -> Table:
    node, traffic = reply["node"], reply["traffic"]
    t = Table(title=f"stormd at {endpoint}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    state = "draining" if reply["draining"] else "serving"
    rows = [
        ("server", reply["server"]), ("state", state), ("uptime", f"{reply['uptime_s']:.0f} s"),
        ("clients", str(node["clients"])),
        ("pool used", f"{_mib(node['used'])} of {format_size(node['capacity'])} "
                      f"({100 * node['used'] / node['capacity']:.1f}%), peak {_mib(node['peak'])}"),
        ("tensors held", str(node["keys"])),
        ("fragmentation", f"{node['fragmentation']:.3f} ({node['free_extents']} free extents)"),
        ("stored (PUT)", f"{traffic['puts']} tensors, {_mib(traffic['bytes_in'])}"),
        ("fetched (GET)", f"{traffic['gets']} tensors, {_mib(traffic['bytes_out'])}"),
        ("errors", ", ".join(f"{k} {v}" for k, v in sorted(node["errors"].items())) or "none"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def render_clients(reply: dict[str, Any], endpoint: str) -> Table:
    shown, total = len(reply["clients"]), reply.get("total", len(reply["clients"]))
    t = Table(title=f"clients of stormd at {endpoint}")
    if total > shown:  # the daemon bounds its reply; it lists those holding the most bytes
        t.caption = (f"{shown} of {total} clients shown, those holding the most bytes; "
                     f"{total - shown} more not shown (stormctl status counts them all)")
    for col in ("session", "pid", "host", "connected s", "idle s", "tensors", "held", "peak held",
                "PUT", "GET", "in", "out", "pool full"):
        t.add_column(col, justify="left" if col == "host" else "right")
    for c in reply["clients"]:
        t.add_row(str(c["session"]), str(c["pid"]), c["host"], f"{c['connected_s']:.0f}", f"{c['idle_s']:.1f}",
                  str(c["keys"]), _mib(c["held_bytes"]), _mib(c["peak_held_bytes"]), str(c["puts"]),
                  str(c["gets"]), _mib(c["bytes_in"]), _mib(c["bytes_out"]), str(c["pool_full"]))
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stormctl", description="Query or drain a running stormd.")
    p.add_argument("verb", choices=list(VERBS), help="status | stats (per client) | ping | drain")
    p.add_argument("--socket", default=None, help="the daemon's socket (default: $STORMD_SOCKET or the runtime dir)")
    p.add_argument("--json", action="store_true", help="print the reply as JSON instead of a table")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    a = p.parse_args(argv)
    try:
        endpoint = normalize_endpoint(a.socket)
    except ValueError as e:
        p.error(str(e))
    started = time.perf_counter()
    try:
        reply = request(endpoint, VERBS[a.verb], a.timeout)
    except CtlError as e:
        print(f"stormctl: {e}", file=sys.stderr)
        return 1
    rtt_ms = (time.perf_counter() - started) * 1e3
    reply = {k: v for k, v in reply.items() if k not in ("id", "ok")}
    if a.verb == "ping":
        reply["rtt_ms"] = round(rtt_ms, 3)
    if a.json:
        print(json.dumps({"endpoint": endpoint, **reply}, indent=2, sort_keys=True))
        return 0
    console = Console()
    if a.verb == "ping":
        console.print(f"stormd at {endpoint} answered in {rtt_ms:.2f} ms")
    elif a.verb == "stats":
        console.print(render_clients(reply, endpoint))
    else:
        if a.verb == "drain":
            console.print(f"stormd at {endpoint} is draining: it refuses new tensors and exits once clients "
                          f"hold none (or at its drain deadline)")
        console.print(render_status(reply, endpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
