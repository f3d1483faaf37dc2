"""Daemon settings: what stormd reads from its file, its environment and its flags.

Every setting is one row of ``SETTINGS``: its TOML key (the ``DaemonConfig``
field), its ``STORMD_*`` variable and its ``--flag`` all derive from that
name, so the three sources cannot drift apart. ``load`` merges them with the
precedence CLI > environment > file > defaults and validates each value where
it is read, so an error names the key, where it came from and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from .wire.endpoint import normalize_endpoint
from .wire.pool import MIN_POOL_SIZE
from .wire.protocol import CLIENT_HEARTBEAT, CODECS, MAX_MESSAGE_BYTES
from .wire.sizes import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib; tomli is the same parser, published separately
    import tomli as tomllib


# client_max_keys unless given is this share of max_keys: one rank's on a node of eight GPUs, so that
# one session cannot take the keys the others need.
KEY_SHARES = 8


@dataclass
class DaemonConfig:
    socket: str
    pool_size: int = 1 << 30
    pool_dir: str = "/dev/shm"
    client_timeout: float = 10.0  # seconds without a message before a client is dropped
    drain_timeout: float = 5.0  # below docker stop's 10 s grace, so a drain under docker still exits 0
    log_level: str = "INFO"
    log_format: str = "text"
    error_log_interval: float = 10.0
    metrics: bool = False  # off unless asked: the endpoint answers whoever reaches it (docs/security.md)
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 9466
    hwm: int = 1000  # ZeroMQ high-water mark per client and direction, in messages
    client_max_backlog: int = 10000  # unread replies a client may leave before its session is ended
    client_max_backlog_bytes: int = 64 << 20  # and their bytes
    max_message_size: int = 2 << 20  # larger frames are dropped by ZeroMQ before they are buffered
    max_sessions_per_peer: int = 16  # HELLOs one socket connection may hold open (a process needs one)
    max_sessions: int = 1024  # sessions of the whole daemon
    max_keys: int = 1 << 18  # tensors the daemon holds at once, all sessions together
    client_max_keys: int = max_keys // KEY_SHARES  # tensors one session may hold (load: of the max_keys given)
    curve_secret_key: str = ""  # tcp:// only: the server's CURVE secret key file (zmq.auth format)
    curve_authorized_keys: str = ""  # tcp:// only: directory of the clients' CURVE public key files
    spill: bool = False  # move the oldest tensors to spill_dir when the pool is full
    spill_dir: str = "/var/tmp"
    spill_limit: int = 16 << 30
    client_quota: int = 0  # bytes one session may hold (pool + spill, extents' sizes); 0: no limit
    client_priority: int = 0
    clients: dict = field(default_factory=dict)  # name -> {"quota": bytes, "priority": int}
    codec: str = "raw"  # how clients encode tensors before storing them (told at HELLO)
    cuda_ipc: bool = True  # copy clients' CUDA tensors in the daemon through CUDA IPC, where it sees a GPU
    check_extents: bool = False  # refuse a placement that overlaps a live extent (tests, debugging)


CONFIG_ENV = "STORMD_CONFIG"
ENV_PREFIX = "STORMD_"


class ConfigError(ValueError):
    """A setting stormd refuses; the message names the key, its source and the allowed values."""


class _Invalid(ValueError):
    """Raised by a kind's check; ``load`` adds the key and the source."""


# --- kinds: how a value is read from TOML and from text (env, CLI), and what is allowed ---

class _Kind:
    allowed: str

    def from_toml(self, v: Any) -> Any:
        raise NotImplementedError

    def from_text(self, s: str) -> Any:
        return self.from_toml(s)

    def to_toml(self, v: Any) -> str:
        return json.dumps(v)  # a JSON string or number is also a TOML one


def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(v), type(v).__name__)


def _wrong_type(kind: _Kind, v: Any) -> _Invalid:
    return _Invalid(f"wrong type: got {_type_name(v)} {v!r}; allowed: {kind.allowed}")


def _out_of_range(kind: _Kind, v: Any) -> _Invalid:
    return _Invalid(f"{v!r} is out of range; allowed: {kind.allowed}")


class _Size(_Kind):
    def __init__(self, minimum: int):
        self.minimum = minimum
        self.allowed = f"a size of at least {format_size(minimum)}: bytes or a number with a unit (512MiB, 8GiB)"

    def from_toml(self, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise _wrong_type(self, v)
        try:
            n = parse_size(v)
        except ValueError as e:
            raise _Invalid(f"{e}; allowed: {self.allowed}") from None
        if n < self.minimum:
            raise _out_of_range(self, v)
        return n

    def to_toml(self, v: int) -> str:
        return json.dumps(format_size(v))


class _Number(_Kind):
    def __init__(self, lo: float, hi: float, integer: bool = False):
        self.lo, self.hi, self.integer = lo, hi, integer
        self.allowed = f"{'an integer' if integer else 'a number'} from {lo:g} to {hi:g}"

    def from_toml(self, v: Any) -> float | int:
        types = (int,) if self.integer else (int, float)
        if isinstance(v, bool) or not isinstance(v, types):
            raise _wrong_type(self, v)
        if not self.lo <= v <= self.hi:
            raise _out_of_range(self, v)
        return v if self.integer else float(v)

    def from_text(self, s: str) -> float | int:
        try:
            v: float | int = int(s) if self.integer else float(s)
        except ValueError:
            raise _wrong_type(self, s) from None
        return self.from_toml(v)


class _Choice(_Kind):
    def __init__(self, *options: str):
        self.options = options
        self.allowed = "one of " + ", ".join(options)

    def from_toml(self, v: Any) -> str:
        if not isinstance(v, str):
            raise _wrong_type(self, v)
        for o in self.options:
            if v.lower() == o.lower():
                return o
        raise _Invalid(f"{v!r} is not allowed; allowed: {self.allowed}")


class _Text(_Kind):
    def __init__(self, allowed: str, check: Callable[[str], str]):
        self.allowed = allowed
        self.check = check

    def from_toml(self, v: Any) -> str:
        if not isinstance(v, str):
            raise _wrong_type(self, v)
        try:
            return self.check(v)
        except ValueError as e:
            raise _Invalid(f"{e}; allowed: {self.allowed}") from None


class _Flag(_Kind):
    allowed = "true or false (in the environment also 1/0, yes/no, on/off)"
    TEXT = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}

    def from_toml(self, v: Any) -> bool:
        if not isinstance(v, bool):
            raise _wrong_type(self, v)
        return v

    def from_text(self, s: str) -> bool:
        if s.strip().lower() not in self.TEXT:
            raise _wrong_type(self, s)
        return self.TEXT[s.strip().lower()]

    def to_toml(self, v: bool) -> str:
        return "true" if v else "false"


class _ClientTable(_Kind):
    allowed = ("a table of client name -> { quota = SIZE, priority = INT }, the quota required (0: no limit) and "
               "the priority optional (in the environment or a flag: name=SIZE or name=SIZE:PRIORITY, comma "
               "separated)")
    NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

    def from_toml(self, v: Any) -> dict:
        if not isinstance(v, dict):
            raise _wrong_type(self, v)
        out = {}
        for name, row in v.items():
            if not self.NAME.match(name) or not isinstance(row, dict) or set(row) - {"quota", "priority"}:
                raise _Invalid(f"client {name!r}: {row!r} is not allowed; allowed: {self.allowed}")
            if "quota" not in row:  # taken as 0, it held the client to no quota at all, not to client_quota
                raise _Invalid(f"client {name!r} names no quota; allowed: {self.allowed}")
            out[name] = {"quota": _Size(0).from_toml(row["quota"]),
                         "priority": _Number(-1000, 1000, integer=True).from_toml(row.get("priority", 0))}
        return out

    def from_text(self, s: str) -> dict:
        table: dict[str, dict[str, Any]] = {}
        for item in filter(None, (x.strip() for x in s.split(","))):
            name, _, rest = item.partition("=")
            quota, _, priority = rest.partition(":")
            try:
                row: dict[str, Any] = {"priority": int(priority or 0)}
            except ValueError:
                raise _Invalid(f"{item!r}: priority {priority!r} is not an integer; allowed: {self.allowed}") from None
            if quota.strip():  # else from_toml refuses the row, naming the client
                row["quota"] = quota.strip()
            table[name.strip()] = row
        return self.from_toml(table)

    def to_toml(self, v: dict) -> str:
        # names quoted: a bare "team.a" is a dotted key, which reads back as a table "team" holding "a"
        rows = ", ".join(f"{json.dumps(n)} = {{ quota = {json.dumps(format_size(r['quota']))}, "
                         f"priority = {r['priority']} }}" for n, r in v.items())
        return f"{{ {rows} }}" if rows else "{}"


def _absolute_dir(v: str) -> str:
    if not os.path.isabs(v):
        raise ValueError(f"{v!r} is not an absolute path")
    return v


def _optional_path(v: str) -> str:
    return v and _absolute_dir(v)  # "" means not set


def _ip_address(v: str) -> str:
    return str(ipaddress.ip_address(v))  # raises ValueError naming the bad address


@dataclass(frozen=True)
class Setting:
    name: str  # the DaemonConfig field and TOML key; env STORMD_NAME; flag --name-with-dashes
    kind: _Kind
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SETTINGS: tuple[Setting, ...] = (
    Setting("socket", _Text("a path, ipc://PATH or tcp://127.0.0.1:PORT", normalize_endpoint),
            "where clients connect (default $XDG_RUNTIME_DIR/stormd/stormd.sock or /tmp/stormd-UID/stormd.sock)"),
    Setting("pool_size", _Size(MIN_POOL_SIZE), "host pool size: bytes or e.g. 512MiB, 8GiB"),
    Setting("pool_dir", _Text("an absolute path", _absolute_dir), "tmpfs directory for the pool segment"),
    Setting("client_timeout", _Number(0.05, 86400),
            "seconds without a message (clients ping every second) before a client is dropped"),
    Setting("drain_timeout", _Number(0, 3600),
            "on SIGTERM or `stormctl drain`: seconds to keep answering GETs while clients still hold tensors"),
    Setting("log_level", _Choice("DEBUG", "INFO", "WARNING", "ERROR"), "log level"),
    Setting("log_format", _Choice("text", "json"), "text (key=value) or json, one object per line"),
    Setting("error_log_interval", _Number(0.1, 3600),
            "error replies: the first of each code per interval is logged, the rest are counted"),
    Setting("metrics", _Flag(), "serve Prometheus metrics over HTTP on metrics_address:metrics_port (off by "
            "default: any local user, and any host that reaches a non-loopback address, can read them)"),
    Setting("metrics_address", _Text("an IP address (127.0.0.1 keeps metrics on this host)", _ip_address),
            "address the metrics endpoint binds"),
    Setting("metrics_port", _Number(0, 65535, integer=True), "port of the metrics endpoint (0: any free port)"),
    Setting("hwm", _Number(1, 1_000_000, integer=True),
            "ZeroMQ high-water mark per client and direction (messages): a client that sends faster than "
            "stormd answers is slowed there, without slowing the others"),
    Setting("client_max_backlog", _Number(1, 10_000_000, integer=True),
            "replies a client may leave unread beyond the socket's buffers before its session is ended "
            "(logged, its tensors freed); no reply is dropped before that"),
    Setting("client_max_backlog_bytes", _Size(MAX_MESSAGE_BYTES),
            "bytes of the replies a client may leave unread beyond the socket's buffers before its session is "
            "ended, like client_max_backlog"),
    Setting("max_message_size", _Size(MAX_MESSAGE_BYTES),
            "frames larger than this are dropped by ZeroMQ as they arrive, never buffered, and their connection "
            f"is closed (requests are at most {format_size(MAX_MESSAGE_BYTES)}; larger frames up to this one get "
            f"a BAD_MESSAGE reply)"),
    Setting("max_sessions_per_peer", _Number(1, 1_000_000, integer=True),
            "sessions (HELLOs) one client socket may hold open; one more is refused with TOO_MANY_SESSIONS"),
    Setting("max_sessions", _Number(1, 1_000_000, integer=True),
            "sessions the daemon serves at once, all clients together; one more is refused with TOO_MANY_SESSIONS"),
    Setting("max_keys", _Number(1, 100_000_000, integer=True),
            "tensors the daemon holds at once, all clients together (each costs daemon memory beside its pool "
            "bytes); a PUT beyond it is refused with POOL_FULL and its tensor stays on the client's device"),
    Setting("client_max_keys", _Number(0, 100_000_000, integer=True),
            f"tensors one session may hold at once (not given: max_keys / {KEY_SHARES}, so that one client cannot "
            "take the keys the others need; 0: no limit but max_keys); a PUT beyond it is refused with QUOTA"),
    Setting("curve_secret_key", _Text("empty, or an absolute path", _optional_path),
            "tcp:// only (required there): the server's CURVE secret key file, as zmq.auth.create_certificates "
            "writes it"),
    Setting("curve_authorized_keys", _Text("empty, or an absolute path", _optional_path),
            "tcp:// only (required there): directory of the CURVE public key files of the clients allowed in"),
    Setting("spill", _Flag(), "when the pool is full, move the tensors backward needs last to files in spill_dir "
            "(off: the client keeps such tensors on its device)"),
    Setting("spill_dir", _Text("an absolute path", _absolute_dir),
            "directory on local disk for the spill file (not a tmpfs: that would use the RAM spill frees)"),
    Setting("spill_limit", _Size(MIN_POOL_SIZE), "most bytes the spill file may hold; must fit on spill_dir's disk"),
    Setting("client_quota", _Size(0), "bytes one session (a training process's connection) may hold in pool "
            "and spill together, each tensor counted at its extent's size (0: no limit); a PUT beyond it is "
            "refused with QUOTA"),
    Setting("client_priority", _Number(-1000, 1000, integer=True),
            "clients with a lower priority are spilled first"),
    Setting("clients", _ClientTable(), "per-client quota and priority by the name a client gives in HELLO "
            "(TOML: clients = { trainer = { quota = \"8GiB\", priority = 1 } }; env/flag: trainer=8GiB:1,eval=1GiB:0); "
            "each names its quota (0: no limit), the priority may be left out (0)"),
    Setting("codec", _Choice("auto", *CODECS),
            "how clients encode tensors before storing them: raw, auto (per CPU tensor the best "
            "lossless codec that saves at least 5%) or one codec of storm.kernels; CUDA tensors: "
            "auto and ancf_exp put bf16 tensors of at least 4 MiB in frames encoded on the GPU, "
            "auto bool ones (dropout's masks) in frames of a bit an element and float32 ones at or "
            "with compressed high halves; the rest is stored raw"),
    Setting("cuda_ipc", _Flag(), "copy clients' CUDA tensors in stormd, on its own streams, through CUDA IPC "
            "(where stormd sees a GPU; the pool is page-locked at start-up, about a second per GiB); "
            "off: clients copy them into the pool themselves"),
    Setting("check_extents", _Flag(), "check every pool extent handed to a tensor against those still live and "
            "refuse (INTERNAL) one that overlaps another: a guard against placement bugs, for tests and "
            "debugging (costs time on every PUT and FREE)"),
)
_BY_NAME = {s.name: s for s in SETTINGS}


def default_config_paths(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Searched in order when neither --config nor $STORMD_CONFIG names a file; the first that exists is read."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return [Path(xdg) / "stormd" / "stormd.toml", Path("/etc/stormd/stormd.toml")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per setting, plus --config and --print-config. Defaults are None: 'not given'."""
    p.add_argument("--config", metavar="PATH", default=None,
                   help=f"TOML file (env {CONFIG_ENV}; else the first of "
                        f"{', '.join(str(x) for x in default_config_paths())} that exists)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    for s in SETTINGS:
        default = _default_text(s)
        text = f"{s.help} ({default}env {s.env})".replace("%", "%%")  # argparse %-formats help ("saves 5%")
        if isinstance(s.kind, _Flag):
            p.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(s.flag, dest=s.name, default=None, metavar=s.name.upper(), help=text)


def _default_text(s: "Setting") -> str:
    """'default VALUE; ' for --help, as the TOML file would spell it; '' for a setting whose default
    is worked out at start (the socket: its help says how)."""
    f = next(f for f in dataclasses.fields(DaemonConfig) if f.name == s.name)
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    shown = "none" if value in (None, "", {}, []) else s.kind.to_toml(value).strip('"')
    return f"default {shown}; "


def load(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """Defaults, then the TOML file, then STORMD_* variables, then flags; raises ConfigError."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = _config_path(args.config, env)
    if path is not None:
        for name, v in _read_toml(path).items():
            values[name] = _parse(name, v, str(path), from_text=False)
    for s in SETTINGS:
        if env.get(s.env):
            values[s.name] = _parse(s.name, env[s.env], s.env, from_text=True)
    for s in SETTINGS:
        v = getattr(args, s.name, None)
        if v is not None:
            values[s.name] = v if isinstance(v, bool) else _parse(s.name, v, s.flag, from_text=True)
    values.setdefault("socket", normalize_endpoint(None, env))
    values.setdefault("client_max_keys", max(values.get("max_keys", DaemonConfig.max_keys) // KEY_SHARES, 1))
    config = DaemonConfig(**values)
    check_curve(config)
    return config


def setting_warnings(config: DaemonConfig) -> list[str]:
    """Settings allowed (tests and odd setups use them) that would not work as an operator means."""
    warnings = []
    if not 0 < config.client_max_keys < config.max_keys:  # fine for one client alone on the node
        warnings.append(f"client_max_keys {config.client_max_keys} lets one session hold every key of the daemon "
                        f"(max_keys {config.max_keys}): one client can have every other client's PUT refused "
                        f"POOL_FULL; leave client_max_keys out (max_keys / {KEY_SHARES}) or give less")
    if config.client_timeout < 3 * CLIENT_HEARTBEAT:
        warnings.append(f"client_timeout {config.client_timeout:g} s leaves room for fewer than three of the "
                        f"clients' heartbeats (one each {CLIENT_HEARTBEAT:g} s): a live client idle between steps "
                        f"may be dropped and its tensors freed; give at least {3 * CLIENT_HEARTBEAT:g}")
    return warnings


def unknown_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each STORMD_* variable that is no setting: a misspelt one would otherwise be
    ignored without a word, and stormd run with a default the operator meant to change."""
    env = os.environ if environ is None else environ
    known = [s.env for s in SETTINGS] + [CONFIG_ENV]
    warnings = []
    for name in sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known):
        # compared without the prefix, which every name shares and which would make any name look close
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), [k.removeprefix(ENV_PREFIX) for k in known],
                                          n=1)
        hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else "`stormd --help` names each setting's variable"
        warnings.append(f"ignoring environment variable {name}: stormd has no such setting; {hint}")
    return warnings


def check_curve(config: DaemonConfig) -> None:
    """tcp:// is reachable by every local user, so it is served only with CURVE authentication and
    encryption; an ipc:// socket is protected by its directory's permissions instead."""
    if config.socket.startswith("tcp://"):
        missing = [n for n in ("curve_secret_key", "curve_authorized_keys") if not getattr(config, n)]
        if missing:
            raise ConfigError(f"socket {config.socket}: tcp:// needs CURVE keys; set {' and '.join(missing)} "
                              f"(see `stormd --help` and README, 'Threat model')")


def _config_path(given: str | None, env: Mapping[str, str]) -> Path | None:
    named = given or env.get(CONFIG_ENV)
    if named:
        if not _is_file(Path(named)):
            raise ConfigError(f"config file {named} does not exist or is not a file")
        return Path(named)
    return next((p for p in default_config_paths(env) if _is_file(p)), None)


def _is_file(path: Path) -> bool:
    """Path.is_file, except that an error other than the file's absence (no permission to look, a
    name too long) is a ConfigError naming the file: stormd must not run without a file it was
    meant to read, nor stop with a traceback."""
    try:
        return path.is_file()
    except OSError as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: OSError) -> ConfigError:
    return ConfigError(f"cannot read config file {path}: {e.strerror or e}")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        text = raw.decode("utf-8")  # TOML files are UTF-8 whatever the locale (read_text would use the locale's)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path} is not UTF-8, as a TOML file must be: byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start} (line {line}): {e.reason}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    unknown = [k for k in data if k not in _BY_NAME]
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; allowed keys: {', '.join(_BY_NAME)}")
    return data


def _parse(name: str, v: Any, source: str, from_text: bool) -> Any:
    kind = _BY_NAME[name].kind
    try:
        return kind.from_text(v) if from_text else kind.from_toml(v)
    except _Invalid as e:
        raise ConfigError(f"{source}: {name}: {e}") from None


def to_toml(config: DaemonConfig) -> str:
    """The configuration as a TOML file that ``load`` reads back to the same values."""
    lines = ["# stormd effective configuration (CLI > STORMD_* environment > file > defaults)"]
    for s in SETTINGS:
        lines.append(f"# {s.help}")
        lines.append(f"{s.name} = {s.kind.to_toml(getattr(config, s.name))}")
    return "\n".join(lines) + "\n"

