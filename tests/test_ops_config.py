"""stormd's configuration: file, STORMD_* environment and flags, validated with errors that name the key."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest
from test_ops_daemon import wait_for_log

from conftest import Daemon, start_daemon, stop_daemon, stop_process
from stormd.config import (
    SETTINGS,
    ConfigError,
    DaemonConfig,
    add_arguments,
    load,
    setting_warnings,
    to_toml,
    tomllib,
    unknown_environment,
)
from stormd.wire.protocol import CLIENT_HEARTBEAT
from stormd.wire.sizes import format_size, parse_size


def parse(*argv: str, env: dict[str, str] | None = None, home=None) -> DaemonConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return load(p.parse_args(list(argv)), {"XDG_CONFIG_HOME": str(home or "/nonexistent"), **(env or {})})


def write(tmp_path, text: str):
    path = tmp_path / "stormd.toml"
    path.write_text(text)
    return str(path)


def test_every_daemon_setting_has_one_row_for_file_env_and_flag():
    assert [s.name for s in SETTINGS] == [f.name for f in dataclasses.fields(DaemonConfig)]


@pytest.mark.parametrize("program", ["stormd", "stormctl"])
def test_help_lists_every_option(program):
    r = subprocess.run([sys.executable, "-m", "stormd" if program == "stormd" else "stormd.ctl", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {program}")
    if program == "stormd":  # every setting's flag and variable, "%" in its help shown as written
        assert all(s.flag in r.stdout and s.env in r.stdout for s in SETTINGS)
        assert "saves at least 5%)" in " ".join(r.stdout.split())


def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path):
    cfg = write(tmp_path, 'pool_size = "2MiB"\nclient_timeout = 3\n')
    assert parse("--config", cfg).pool_size == 2 << 20
    assert parse("--config", cfg).client_timeout == 3.0
    assert parse("--config", cfg).drain_timeout == DaemonConfig.drain_timeout  # default
    env = {"STORMD_POOL_SIZE": "3MiB"}
    assert parse("--config", cfg, env=env).pool_size == 3 << 20
    assert parse("--config", cfg, "--pool-size", "4MiB", env=env).pool_size == 4 << 20
    assert parse("--config", cfg, "--no-metrics", env={"STORMD_METRICS": "on"}).metrics is False
    assert parse(env={"STORMD_METRICS": "off"}).metrics is False


def test_config_file_is_found_on_the_search_path_and_named_by_env(tmp_path):
    (tmp_path / "stormd").mkdir()
    (tmp_path / "stormd" / "stormd.toml").write_text("metrics_port = 9999\n")
    assert parse(home=tmp_path).metrics_port == 9999
    other = write(tmp_path, "metrics_port = 9998\n")
    assert parse(home=tmp_path, env={"STORMD_CONFIG": other}).metrics_port == 9998


def test_socket_env_keeps_its_meaning(tmp_path):
    assert parse(env={"STORMD_SOCKET": str(tmp_path / "s.sock")}).socket == f"ipc://{tmp_path}/s.sock"


@pytest.mark.parametrize("text,key,expected", [
    ("pool_sise = \"1GiB\"\n", "pool_sise", "unknown key 'pool_sise'; allowed keys: socket, pool_size"),
    ("pool_size = true\n", "pool_size", "wrong type: got a boolean True; allowed: a size of at least 4KiB"),
    ("client_timeout = \"ten\"\n", "client_timeout", "wrong type: got a string 'ten'; allowed: a number"),
    ("metrics = \"yes\"\n", "metrics", "wrong type: got a string 'yes'; allowed: true or false"),
    ("metrics_port = 70000\n", "metrics_port", "70000 is out of range; allowed: an integer from 0 to 65535"),
    ("pool_size = 100\n", "pool_size", "100 is out of range; allowed: a size of at least 4KiB"),
    ("log_format = \"xml\"\n", "log_format", "'xml' is not allowed; allowed: one of text, json"),
], ids=["unknown-key", "wrong-type-size", "wrong-type-number", "wrong-type-bool", "out-of-range-port",
        "out-of-range-size", "not-a-choice"])
def test_config_file_errors_name_the_key_and_the_allowed_values(tmp_path, text, key, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        parse("--config", path)
    assert str(e.value).startswith(path) and key in str(e.value) and expected in str(e.value), str(e.value)


def test_environment_and_flag_errors_name_their_source():
    with pytest.raises(ConfigError, match=r"^STORMD_CLIENT_TIMEOUT: client_timeout: wrong type: got a string 'ten'"):
        parse(env={"STORMD_CLIENT_TIMEOUT": "ten"})
    with pytest.raises(ConfigError, match=r"^--drain-timeout: drain_timeout: -1.0 is out of range; allowed: a number "
                                          r"from 0 to 3600"):
        parse("--drain-timeout", "-1")
    with pytest.raises(ConfigError, match="^--metrics-address: metrics_address: 'localhost' does not appear"):
        parse("--metrics-address", "localhost")
    with pytest.raises(ConfigError, match="config file /nope.toml does not exist"):
        parse("--config", "/nope.toml")


def test_bad_toml_is_refused_with_the_file_and_position(tmp_path):
    with pytest.raises(ConfigError, match=r"stormd.toml is not valid TOML: .*line 1"):
        parse("--config", write(tmp_path, "pool_size = \n"))


@pytest.mark.parametrize("kind,text,message", [
    ("unknown key", "spool_dir = \"/x\"\n", "unknown key 'spool_dir'"),
    ("wrong type", "client_timeout = [1]\n", "client_timeout: wrong type: got list"),
    ("out of range", "client_timeout = 0\n", "client_timeout: 0 is out of range; allowed: a number from 0.05"),
    # a path longer than a unix socket's room failed at bind, deep in ZeroMQ, with a traceback and exit 1
    ("socket too long", f"socket = \"/tmp/{'d' * 120}/s.sock\"\n", "a unix socket's may have at most 107"),
])
def test_stormd_exits_2_on_each_kind_of_config_error(tmp_path, kind, text, message):
    r = subprocess.run([sys.executable, "-m", "stormd", "--config", write(tmp_path, text),
                        "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, (kind, r.stderr)
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize("case", ["latin-1", "search path stormd cannot look in"])
def test_a_config_file_stormd_cannot_decode_or_read_stops_it_with_exit_2_naming_the_file(tmp_path, case):
    """Issue 49, item 6: a Latin-1 comment in stormd.toml ended stormd with a UnicodeDecodeError traceback
    and exit 1, and a config path stat refuses (here a name too long; no permission to look, for a
    user other than root) with an OSError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STORMD_")}
    if case == "latin-1":
        latin = tmp_path / "stormd.toml"
        latin.write_bytes(b'pool_size = "1MiB"\n# caf\xe9\n')
        args = ["--config", str(latin)]
        message = f"{latin} is not UTF-8, as a TOML file must be: byte 0xe9 at offset 24 (line 2)"
    else:
        too_long = tmp_path / ("x" * 300)  # stat fails with ENAMETOOLONG, not with "no such file"
        env["XDG_CONFIG_HOME"] = str(too_long)
        args = []
        message = f"cannot read config file {too_long}/stormd/stormd.toml: File name too long"
    r = subprocess.run([sys.executable, "-m", "stormd", *args, "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_metrics_are_off_unless_turned_on(tmp_path):
    """Issue 49, item 4: the metrics endpoint answers whoever reaches it, so stormd serves it only when
    asked. On b4ebf24 a stormd with no metrics setting served 127.0.0.1:9466 to every local user."""
    assert DaemonConfig(socket="ipc:///x").metrics is False and parse().metrics is False
    assert parse("--metrics").metrics and parse(env={"STORMD_METRICS": "1"}).metrics
    assert parse("--config", write(tmp_path, "metrics = true\n")).metrics
    sock = tmp_path / "run" / "stormd.sock"
    log = tmp_path / "stormd.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STORMD_")}
    # not popen_stormd, which adds --no-metrics; an empty file, so no config on this host counts; port 0,
    # so that a stormd serving metrics anyway takes no port of the node's
    proc = subprocess.Popen([sys.executable, "-m", "stormd", "--config", write(tmp_path, ""), "--socket", str(sock),
                             "--pool-size", "1MiB", "--metrics-port", "0"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        ready = wait_for_log(Daemon(sock, proc, log), r"stormd ready.*", timeout=60).group(0)
    finally:
        stop_process(proc)
    assert "metrics=off" in ready and "metrics endpoint" not in log.read_text(), log.read_text()


def test_print_config_prints_toml_that_reads_back_to_the_same_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stormd", "--print-config", "--pool-size", "3MiB", "--log-format",
                        "json", "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60,
                       env={"STORMD_METRICS_PORT": "9000", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    data = tomllib.loads(r.stdout)
    assert data["pool_size"] == "3MiB" and data["log_format"] == "json" and data["metrics_port"] == 9000
    assert data["socket"] == f"ipc://{tmp_path}/s.sock"
    again = parse("--config", write(tmp_path, r.stdout))
    assert to_toml(again) == r.stdout


def test_a_client_name_with_a_dot_prints_as_a_key_that_reads_back(tmp_path):
    """The clients setting takes names with '.'; printed as a bare key, "team.a" read back as a table
    "team" holding "a", which the setting refused."""
    config = parse("--clients", "team.a=1GiB:1,solo=2GiB")
    assert config.clients == {"team.a": {"quota": 1 << 30, "priority": 1}, "solo": {"quota": 2 << 30, "priority": 0}}
    assert parse("--config", write(tmp_path, to_toml(config))).clients == config.clients


@pytest.mark.parametrize("value", ["trainer", "trainer=", "trainer=:1", "eval=1GiB,trainer"])
def test_a_client_named_without_a_quota_is_refused_naming_the_accepted_form(value):
    """A name without its size was taken as quota 0, no limit, in place of client_quota: a client
    meant to be held to a quota held the pool unbounded, without a word at start."""
    with pytest.raises(ConfigError, match=r"--clients: clients: client 'trainer' names no quota; allowed: .*name=SIZE"):
        parse("--client-quota", "1GiB", "--clients", value)


def test_a_client_row_without_a_quota_in_the_file_is_refused_and_quota_0_means_none(tmp_path):
    with pytest.raises(ConfigError, match=r"clients: client 'trainer' names no quota; allowed: .*quota = SIZE"):
        parse("--config", write(tmp_path, "clients = { trainer = { priority = 1 } }\n"))
    config = parse("--config", write(tmp_path, 'clients = { trainer = { quota = 0, priority = 1 } }\n'),
                   "--clients", "eval=0:2")
    assert config.clients == {"eval": {"quota": 0, "priority": 2}}  # the flag's table replaces the file's
    assert parse("--config", write(tmp_path, 'clients = { trainer = { quota = "0", priority = 1 } }\n')).clients \
        == {"trainer": {"quota": 0, "priority": 1}}


@pytest.mark.parametrize("value", ["ipc://", "ipc://  "])
def test_an_ipc_socket_without_a_path_is_refused_saying_what_is_accepted(value):
    """It was taken as the current directory, which stormd then took for a stale socket to remove."""
    with pytest.raises(ConfigError, match="names no path: give a path, ipc://PATH or tcp://127.0.0.1:PORT"):
        parse("--socket", value)


def test_a_relative_ipc_socket_is_made_absolute_as_a_plain_path_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse("--socket", "ipc://s.sock").socket == parse("--socket", "s.sock").socket == f"ipc://{tmp_path}/s.sock"


@pytest.mark.parametrize("n,text", [(8_000_000_000, "8GB"), (1 << 30, "1GiB"), (1000, "1KB"), (1 << 40, "1TiB"),
                                    (10**12, "1TB"), (1536, "1536"), (1_500_000, "1500KB"), (0, "0")])
def test_a_size_prints_in_the_largest_unit_that_divides_it_and_reads_back(n, text):
    """Issue 38, item 12: --pool-size 8GB printed as 7812500KiB (binary units only)."""
    assert format_size(n) == text
    assert parse_size(format_size(n)) == n


def test_print_config_shows_a_decimal_pool_size_as_given(tmp_path):
    r = subprocess.run([sys.executable, "-m", "stormd", "--print-config", "--pool-size", "8GB",
                        "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert 'pool_size = "8GB"' in r.stdout.splitlines()


@pytest.mark.parametrize("bad,why", [(-1, "size -1 is negative"), ("-1", "cannot read size '-1'"),
                                     ("abc", "cannot read size 'abc'"), ("1.5", "'1.5' is not a whole number of bytes"),
                                     (1.5, "not float"), (True, "not bool"), (None, "not NoneType")])
def test_a_size_is_a_whole_number_of_bytes_or_an_error(bad, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_size(bad)


def test_unknown_stormd_variables_are_named_with_the_closest_setting(tmp_path, monkeypatch):
    """A misspelt STORMD_* variable was ignored without a word; now stormd warns at start."""
    assert unknown_environment({"STORMD_POOLSIZE": "1MiB", "STORMD_SOCKET": "/x", "STORMD_CONFIG": "/y",
                                "STORMD_METRICS": "0", "STORM_POOL_SIZE": "1MiB", "STORMD_XYZZY": "1"}) == [
        "ignoring environment variable STORMD_POOLSIZE: stormd has no such setting; did you mean STORMD_POOL_SIZE?",
        "ignoring environment variable STORMD_XYZZY: stormd has no such setting; `stormd --help` names each "
        "setting's variable"]
    monkeypatch.setenv("STORMD_POOLSIZE", "1MiB")
    d = start_daemon(tmp_path, "--pool-size", "1MiB", "--no-metrics")
    try:
        wait_for_log(d, "ignoring environment variable STORMD_POOLSIZE: .*did you mean STORMD_POOL_SIZE", timeout=30)
    finally:
        stop_daemon(d)


def test_a_client_timeout_too_short_for_the_clients_heartbeats_is_warned_about(tmp_path):
    """Allowed (tests reap silent clients fast with it), but a daemon started so dropped live
    clients idle between steps and freed their tensors, without a word at start."""
    (short,) = setting_warnings(parse("--client-timeout", "0.2"))
    assert "client_timeout 0.2 s" in short and f"at least {3 * CLIENT_HEARTBEAT:g}" in short
    assert setting_warnings(parse()) == []


def test_every_stormd_option_says_what_it_does_and_its_default():
    p = argparse.ArgumentParser()
    add_arguments(p)
    vague = [a.dest for a in p._actions
             if a.dest not in ("help", "config", "print_config") and not (a.help and "default" in a.help)]
    assert not vague, f"stormd --help gives these no default: {vague}"
