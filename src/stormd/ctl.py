"""``stormctl``: ask a running stormd how it is doing, or tell it to drain.

    stormctl status            # pool, page-locked memory, start-up, clients, traffic, errors
    stormctl stats             # one row per connected client
    stormctl ping              # round-trip time
    stormctl drain             # refuse new tensors, exit once clients hold none
    stormctl --json status     # the daemon's reply as JSON, for scripts

On a terminal wide enough, tables are drawn by rich; piped, redirected or too narrow, the same
rows print as plain aligned columns, nothing cut (--json for scripts that parse them).

A tcp:// daemon is reached with the CURVE keys a training process uses ($STORM_CURVE_SECRET_KEY,
$STORM_CURVE_SERVER_KEY; stormd/wire/curve.py).

Exit status: 0 on an answer, 1 when no daemon answers or it refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .wire.curve import CurveKeyError, client_curve_options
from .wire.endpoint import normalize_endpoint
from .wire.protocol import ProtocolError, pack, unpack
from .wire.sizes import format_size

VERBS = {"status": "STATUS", "stats": "CLIENTS", "ping": "PING", "drain": "DRAIN"}


class CtlError(Exception):
    """No answer, or an error reply; the message says which daemon and why."""


def request(endpoint: str, op: str, timeout: float) -> dict[str, Any]:
    """One request on a fresh DEALER socket (no HELLO: admin verbs and PING need no session)."""
    try:
        options = client_curve_options(endpoint)  # a tcp:// daemon admits only CURVE clients
    except CurveKeyError as e:
        raise CtlError(str(e)) from None
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        for option, value in options.items():
            sock.setsockopt(option, value)
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


@dataclasses.dataclass
class Report:
    """What a verb prints: a titled table, drawn by rich on a terminal wide enough for it, else as
    plain aligned columns that nothing truncates (a pipe, a file, a narrow terminal)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    caption: str = ""
    header: bool = True

    def table(self) -> Table:
        # Text, not markup: cells hold what clients chose (their HELLO's name and host), and the title
        # an endpoint's path; as markup, "[/x]" in a name crashed stormctl and "[red]" was drawn, not shown
        t = Table(title=Text(self.title), caption=Text(self.caption) if self.caption else None,
                  show_header=self.header)
        for i, col in enumerate(self.columns):
            t.add_column(col, justify="right" if i and self.header and col not in TEXT_COLUMNS else "left",
                         style=None if self.header or i else "bold")
        for row in self.rows:
            t.add_row(*map(Text, row))
        return t

    def widths(self) -> list[int]:
        lines = [self.columns, *self.rows] if self.header else self.rows
        return [max((len(line[i]) for line in lines), default=0) for i in range(len(self.columns))]

    def plain(self) -> str:
        lines = [self.columns, *self.rows] if self.header else self.rows
        widths = self.widths()
        out = [self.title]
        for line in lines:
            out.append("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())
        if self.caption:
            out.append(self.caption)
        return "\n".join(out)


TEXT_COLUMNS = {"name", "host"}  # left-aligned; numbers go right


def show(report: Report, console: Console) -> None:
    """rich's table where the terminal shows it whole; plain columns otherwise (rich would cut every
    column to fit a pipe's default width of 80)."""
    drawn = sum(report.widths()) + 3 * len(report.columns) + 1  # each cell padded by one, and the rules
    if console.is_terminal and drawn <= console.width:
        console.print(report.table())
    else:
        print(report.plain())


def status_report(reply: dict[str, Any], endpoint: str) -> Report:
    node, traffic = reply["node"], reply["traffic"]
    state = "draining" if reply["draining"] else "serving"
    rows = [
        ["server", reply["server"]], ["state", state], ["uptime", f"{reply['uptime_s']:.0f} s"],
        *start_rows(reply),
        ["clients", str(node["clients"])],
        ["pool used", (f"{_mib(node['used'])} of {format_size(node['capacity'])} "
                       f"({100 * node['used'] / node['capacity']:.1f}%), peak {_mib(node['peak'])}")],
        ["tensors held", str(node["keys"])],
        ["fragmentation", f"{node['fragmentation']:.3f} ({node['free_extents']} free extents)"],
        ["stored (PUT)", f"{traffic['puts']} tensors, {_mib(traffic['bytes_in'])}"],
        ["fetched (GET)", f"{traffic['gets']} tensors, {_mib(traffic['bytes_out'])}"],
        *busy_rows(reply),
        ["errors", ", ".join(f"{k} {v}" for k, v in sorted(node["errors"].items())) or "none"],
    ]
    return Report(f"stormd at {endpoint}", ["what", "value"], rows, header=False)


def busy_rows(reply: dict[str, Any]) -> list[list[str]]:
    """How loaded the event loop, which answers every client in turn, has been since start; an
    older stormd of the same protocol does not say, and the row is left out."""
    t = reply["traffic"]
    if "busy_s" not in t:
        return []
    per = f", {1e6 * t['busy_s'] / t['requests']:.0f} µs each" if t["requests"] else ""
    return [["answering", f"{t['requests']} requests in {t['busy_s']:.1f} s{per} "
                          f"({100 * t['busy_s'] / max(reply['uptime_s'], 1e-9):.1f}% of uptime)"]]


def start_rows(reply: dict[str, Any]) -> list[list[str]]:
    """What stormd's start took and what it page-locked; an older stormd of the same protocol says
    neither, and its rows are left out."""
    rows = []
    if reply.get("startup_s") is not None:
        rows.append(["started in", f"{reply['startup_s']:.2f} s (process start to serving)"])
    if "page_locked_bytes" in reply["node"]:
        lock_s = reply.get("page_lock_s")
        how = f"at start, in {lock_s:.2f} s" if lock_s is not None else "(stormd makes no CUDA copies)"
        rows.append(["page-locked", f"{_mib(reply['node']['page_locked_bytes'])} {how}"])
    return rows


def clients_report(reply: dict[str, Any], endpoint: str) -> Report:
    shown, total = len(reply["clients"]), reply.get("total", len(reply["clients"]))
    caption = ""
    if total > shown:  # the daemon bounds its reply; it lists those holding the most bytes
        caption = (f"{shown} of {total} clients shown, those holding the most bytes; "
                   f"{total - shown} more not shown (stormctl status counts them all)")
    columns = ["session", "name", "pid", "host", "connected s", "idle s", "tensors", "held", "peak held",
               "PUT", "GET", "in", "out", "pool full"]
    rows = [[str(c["session"]), c.get("name") or "-", str(c["pid"]), c["host"], f"{c['connected_s']:.0f}",
             f"{c['idle_s']:.1f}", str(c["keys"]), _mib(c["held_bytes"]), _mib(c["peak_held_bytes"]), str(c["puts"]),
             str(c["gets"]), _mib(c["bytes_in"]), _mib(c["bytes_out"]), str(c["pool_full"])]
            for c in reply["clients"]]
    return Report(f"clients of stormd at {endpoint}", columns, rows, caption)


def seconds(text: str) -> float:
    """--timeout: a positive, finite number of seconds (zmq polls forever for a negative one)."""
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(s) and s > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stormctl", description="Query or drain a running stormd.")
    p.add_argument("verb", choices=list(VERBS), help="status | stats (per client) | ping | drain")
    p.add_argument("--socket", default=None, help="the daemon's socket (default: $STORMD_SOCKET or the runtime dir)")
    p.add_argument("--json", action="store_true", help="print the reply as JSON instead of a table")
    p.add_argument("--timeout", type=seconds, default=3.0, help="seconds to wait for the answer (default 3)")
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
        print(f"stormd at {endpoint} answered in {rtt_ms:.2f} ms")
    elif a.verb == "stats":
        show(clients_report(reply, endpoint), console)
    else:
        if a.verb == "drain":
            print(f"stormd at {endpoint} is draining: it refuses new tensors and exits once clients "
                  f"hold none (or at its drain deadline)")
        show(status_report(reply, endpoint), console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
