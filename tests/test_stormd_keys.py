"""The tensors one session may hold (client_max_keys) beside those of the whole daemon (max_keys):
without a bound per session, one client holding max_keys 1-byte tensors, well within a byte quota,
left every other client's PUT refused POOL_FULL."""

from __future__ import annotations

import argparse
import os

import pytest

from helpers import put_fields
from stormd.config import ConfigError, DaemonConfig, add_arguments, load, setting_warnings, to_toml
from stormd.service import Service
from stormd.store_options import StoreOptions
from stormd.wire.pool import SharedPool
from stormd.wire.protocol import PROTOCOL_VERSION, ErrorCode


def parse(*argv: str, env: dict[str, str] | None = None) -> DaemonConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return load(p.parse_args(list(argv)), {"XDG_CONFIG_HOME": "/nonexistent", **(env or {})})


@pytest.fixture
def service_of():
    """A Service (stormd's, in process) built from stormd's settings as ``argv`` gives them."""
    pools = []

    def make(*argv: str) -> Service:
        pools.append(SharedPool.anonymous(1 << 20))
        return Service(pools[-1], store_options=StoreOptions.from_config(parse(*argv)))

    yield make
    for pool in pools:
        pool.close()


class Client:
    """One session of ``service``, as a training process holds it."""

    def __init__(self, service: Service, name: str = ""):
        self.service, self.ids = service, iter(range(2, 1 << 30))
        r = service.handle_message({"op": "HELLO", "id": 1, "version": PROTOCOL_VERSION, "pid": os.getpid(),
                                    "host": "test", **({"name": name} if name else {})})
        assert r["ok"], r
        self.auth = {"session": r["session"], "token": r["token"]}

    def ask(self, op: str, **fields) -> dict:
        return self.service.handle_message({"op": op, "id": next(self.ids), **self.auth, **fields})

    def put(self, key: int) -> dict:
        r = self.ask("PUT", **put_fields(key, 1))
        if r["ok"]:
            assert self.ask("SEAL", key=key)["ok"]
        return r


def test_one_client_storing_all_it_can_leaves_another_room_by_default(service_of):
    """The defect: 1-byte PUTs of one client took every key of the daemon and the other's first PUT
    was POOL_FULL, though the pool was almost empty."""
    service = service_of("--max-keys", "16")
    greedy, other = Client(service), Client(service)
    stored = 0
    while stored <= 16 and greedy.put(stored + 1)["ok"]:
        stored += 1
    assert stored == 16 // 8  # an eighth of max_keys
    assert all(other.put(key)["ok"] for key in (1, 2)), "the other client's PUT was refused"


def test_a_client_at_its_key_limit_leaves_the_others_their_keys(service_of):
    """The greedy client is refused at its own limit, naming it and how to raise it; the other
    client stores as many tensors as its own limit, never POOL_FULL, and the greedy one's
    tensors are all still there."""
    service = service_of("--max-keys", "8", "--client-max-keys", "4")
    greedy, other = Client(service), Client(service, name="eval")
    assert all(greedy.put(key)["ok"] for key in range(1, 5))
    refused = greedy.put(5)
    assert not refused["ok"] and refused["error"] == ErrorCode.QUOTA, refused
    assert "client_max_keys" in refused["message"] and "4 tensors" in refused["message"], refused["message"]
    assert all(other.put(key)["ok"] for key in range(1, 5))  # was POOL_FULL from the first
    assert all(greedy.ask("GET", key=key)["ok"] for key in range(1, 5))
    assert service.handle_message({"op": "PING", "id": 0})["ok"]  # the daemon serves on


def test_keys_freed_give_the_client_its_room_back(service_of):
    service = service_of("--max-keys", "8", "--client-max-keys", "3")
    client = Client(service)
    assert all(client.put(key)["ok"] for key in (1, 2, 3))
    assert client.put(4)["error"] == ErrorCode.QUOTA
    assert client.ask("FREE", keys=[2])["ok"]
    assert client.put(4)["ok"]
    assert client.put(5)["error"] == ErrorCode.QUOTA
    assert client.ask("FREE", all=True)["ok"]
    assert all(client.put(key)["ok"] for key in (6, 7, 8))


def test_max_keys_still_bounds_the_daemon_and_0_leaves_a_session_only_that_bound(service_of):
    service = service_of("--max-keys", "4", "--client-max-keys", "0")
    client = Client(service)
    assert all(client.put(key)["ok"] for key in range(1, 5))
    refused = client.put(5)
    assert refused["error"] == ErrorCode.POOL_FULL and "max_keys" in refused["message"]


@pytest.mark.parametrize("argv,env,expected", [
    ((), {}, 32768),
    (("--max-keys", "80"), {}, 10),  # by default an eighth of max_keys, whatever max_keys is
    (("--max-keys", "7"), {}, 1),
    (("--client-max-keys", "100"), {}, 100),
    ((), {"STORMD_CLIENT_MAX_KEYS": "0"}, 0),
    (("--client-max-keys", "7"), {"STORMD_CLIENT_MAX_KEYS": "9"}, 7),
])
def test_client_max_keys_is_read_from_flags_and_environment(argv, env, expected):
    assert parse(*argv, env=env).client_max_keys == expected


def test_client_max_keys_in_the_file_and_named_clients_get_it(tmp_path):
    path = tmp_path / "stormd.toml"
    path.write_text('client_max_keys = 1000\nclients = { eval = { quota = "1GiB" } }\n')
    config = parse("--config", str(path))
    options = StoreOptions.from_config(config)
    assert options.default_limits.max_keys == 1000 and options.clients["eval"].max_keys == 1000
    path.write_text(to_toml(parse("--max-keys", "80")))  # print-config: the derived default, which reads back
    assert parse("--config", str(path)).client_max_keys == 10


@pytest.mark.parametrize("value,why", [
    ("-1", "-1 is out of range"),
    ("many", "wrong type: got a string 'many'"),
    ("1.5", "wrong type: got a string '1.5'"),
    ("1000000000", "1000000000 is out of range"),
])
def test_a_bad_client_max_keys_is_refused_naming_what_is_accepted(value, why):
    with pytest.raises(ConfigError) as e:
        parse("--client-max-keys", value)
    assert str(e.value).startswith(f"--client-max-keys: client_max_keys: {why}"), str(e.value)
    assert "allowed: an integer from 0 to" in str(e.value)


def test_a_bad_client_max_keys_in_the_file_is_refused(tmp_path):
    path = tmp_path / "stormd.toml"
    path.write_text("client_max_keys = true\n")
    with pytest.raises(ConfigError, match="client_max_keys: wrong type: got a boolean True; allowed: an integer"):
        parse("--config", str(path))


@pytest.mark.parametrize("argv", [("--client-max-keys", "0"), ("--max-keys", "100", "--client-max-keys", "100")])
def test_a_limit_that_lets_one_session_take_every_key_is_warned_about(argv):
    (warning,) = setting_warnings(parse(*argv))
    assert "client_max_keys" in warning and "max_keys" in warning
    assert setting_warnings(parse("--max-keys", "100", "--client-max-keys", "99")) == []
