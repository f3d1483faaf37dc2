"""stormctl's output: whole columns whatever the terminal, with each client's name (issue 41, first hour)."""

from __future__ import annotations

import contextlib
import io

import pytest
from rich.console import Console

from stormd import ctl

CLIENT = {"session": 7, "name": "trainer-rank-0", "pid": 4242, "host": "node-a", "connected_s": 12.0, "idle_s": 0.5,
          "keys": 3, "held_bytes": 3 << 20, "peak_held_bytes": 5 << 20, "puts": 9, "gets": 6, "bytes_in": 9 << 20,
          "bytes_out": 6 << 20, "pool_full": 0}


def printed(report: ctl.Report, *, terminal: bool, width: int) -> str:
    out = io.StringIO()
    # show() prints plain columns with print(): route both to the same buffer
    console = Console(file=out, force_terminal=terminal, width=width)
    with contextlib.redirect_stdout(out):
        ctl.show(report, console)
    return out.getvalue()


def test_piped_or_narrow_stats_print_every_column_whole_with_the_clients_name():
    report = ctl.clients_report({"clients": [CLIENT], "total": 1}, "ipc:///run/stormd/stormd.sock")
    for terminal, width in ((False, 80), (True, 40)):
        text = printed(report, terminal=terminal, width=width)
        assert "…" not in text, text
        header, row = text.splitlines()[1:3]
        assert header.split("  ")[0:2] == ["session", "name"] and "connected s" in header and "pool full" in header
        assert row.split()[:4] == ["7", "trainer-rank-0", "4242", "node-a"]


def test_a_wide_terminal_gets_rich_table():
    report = ctl.clients_report({"clients": [CLIENT], "total": 1}, "ipc:///s")
    text = printed(report, terminal=True, width=400)
    assert "┃" in text or "│" in text  # drawn by rich
    assert "trainer-rank-0" in text and "…" not in text


@pytest.mark.parametrize("name, host", [("[/x]", "node-a"), ("[red]trainer", "[bold]node-b")])
def test_a_wide_terminal_shows_names_and_hosts_as_the_clients_gave_them(name, host):
    """A HELLO's name and host are any text a client chose: drawn as rich markup, a closing tag
    crashed stormctl and an opening one was drawn, not shown."""
    report = ctl.clients_report({"clients": [{**CLIENT, "name": name, "host": host}], "total": 1}, "ipc:///[s]")
    text = printed(report, terminal=True, width=400)
    assert name in text and host in text and "ipc:///[s]" in text, text


# a STATUS reply as a stormd of before its start-up and page-lock figures sent it
OLDER_STATUS = {"server": "stormd 1", "draining": False, "uptime_s": 3.0,
                "node": {"clients": 1, "used": 1 << 20, "capacity": 1 << 30, "peak": 2 << 20, "keys": 1,
                         "fragmentation": 0.0, "free_extents": 1, "errors": {"POOL_FULL": 2}},
                "traffic": {"puts": 1, "bytes_in": 1 << 20, "gets": 0, "bytes_out": 0}}


def test_a_client_without_a_name_shows_a_dash_and_status_prints_plain_when_piped():
    report = ctl.clients_report({"clients": [{**CLIENT, "name": ""}]}, "ipc:///s")
    assert report.rows[0][1] == "-"
    text = printed(ctl.status_report(OLDER_STATUS, "ipc:///s"), terminal=False, width=20)
    assert "pool used      1.0 MiB of 1GiB (0.1%), peak 2.0 MiB" in text
    assert "errors         POOL_FULL 2" in text


def test_status_prints_the_start_up_and_the_page_locked_pool_where_stormd_says_them():
    cuda = {**OLDER_STATUS, "startup_s": 4.25, "page_lock_s": 1.5,
            "node": {**OLDER_STATUS["node"], "page_locked_bytes": 1 << 30}}
    text = printed(ctl.status_report(cuda, "ipc:///s"), terminal=False, width=20)
    assert "started in     4.25 s (process start to serving)" in text
    assert "page-locked    1024.0 MiB at start, in 1.50 s" in text
    cpu = {**cuda, "page_lock_s": None, "node": {**cuda["node"], "page_locked_bytes": 0}}
    text = printed(ctl.status_report(cpu, "ipc:///s"), terminal=False, width=20)
    assert "page-locked    0.0 MiB (stormd makes no CUDA copies)" in text
    text = printed(ctl.status_report(OLDER_STATUS, "ipc:///s"), terminal=False, width=20)
    assert "started in" not in text and "page-locked" not in text  # an older stormd says neither


def test_status_prints_how_loaded_the_event_loop_has_been():
    busy = {**OLDER_STATUS, "uptime_s": 10.0, "traffic": {**OLDER_STATUS["traffic"], "requests": 4000, "busy_s": 0.5}}
    text = printed(ctl.status_report(busy, "ipc:///s"), terminal=False, width=20)
    assert "answering      4000 requests in 0.5 s, 125 µs each (5.0% of uptime)" in text
    assert "answering" not in printed(ctl.status_report(OLDER_STATUS, "ipc:///s"), terminal=False, width=20)


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_a_timeout_that_is_no_positive_finite_number_is_a_usage_error(timeout, capsys):
    """argparse refuses it (exit 2) naming --timeout: -1 polled forever, nan and inf crashed."""
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["ping", "--timeout", timeout, "--socket", "ipc:///nonexistent/stormd.sock"])
    assert exit_.value.code == 2
    assert "--timeout: " in capsys.readouterr().err

