"""storm.offload's options and environment variables: each bad one refused where it is given,
naming it and what it accepts; sizes read as whole bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import storm


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="mode"):
        with storm.offload(mode="fast"):
            pass
    for name in ("min_bytes", "prefetch_bytes", "max_held_bytes"):
        for bad in (-1, "lots", None, True):
            with pytest.raises(ValueError, match=f"{name} must be bytes.*got {bad!r}"):
                storm.offload(**{name: bad})
    sized = storm.offload(min_bytes="1KiB", prefetch_bytes="64MiB", max_held_bytes=1 << 20, budget="8GiB")
    assert [sized.options[k] for k in ("min_bytes", "prefetch_bytes", "max_held_bytes", "budget")] == \
        [1024, 64 << 20, 1 << 20, 8 << 30]
    assert storm.offload(budget=0.25).options["budget"] == 0.25  # a fraction stays one
    with pytest.raises(ValueError, match="size"):
        with storm.offload(mode="embedded", pool_size="lots"):
            pass


def test_bad_budgets_are_refused():
    for bad in (0.0, 1.5, -3, "much", True):
        with pytest.raises(ValueError):
            storm.offload(budget=bad)


def test_a_budget_of_1_is_refused_as_one_byte_naming_the_fraction_meant():
    """budget=0.5 is half a step's bytes, so budget=1 reads as all of them; as an int it was one byte,
    and every save stayed on the device past it."""
    for call in (lambda: storm.offload(budget=1), lambda: storm.plan([torch.nn.Linear(2, 2)], budget=1)):
        with pytest.raises(ValueError, match=r"budget=1 is one byte; give 1.0 for every offloadable byte"):
            call()
    assert storm.offload(budget=1.0).options["budget"] == 1.0


def test_an_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="codec"):
        storm.offload(codec="gzip")


BAD_OPTIONS = [
    ({"pool_size": -1}, "pool_size must be bytes: at least 4KiB: an int or a size such as '512MiB'; got -1"),
    ({"pool_size": "-1"}, "pool_size must be bytes: at least 4KiB.*got '-1'"),
    ({"pool_size": "abc"}, "pool_size must be bytes: at least 4KiB.*got 'abc'"),
    ({"pool_size": 0}, "pool_size must be bytes: at least 4KiB.*got 0"),
    ({"pool_size": "0"}, "pool_size must be bytes: at least 4KiB.*got '0'"),
    ({"pool_size": 1.5}, "pool_size must be bytes.*got 1.5"),
    ({"min_bytes": 1.5}, "min_bytes must be bytes: an int >= 0 or a size such as '256MiB'; got 1.5"),
    ({"min_bytes": "1.5"}, "min_bytes must be bytes.*got '1.5'.*not a whole number of bytes"),
    ({"prefetch_bytes": "-1"}, "prefetch_bytes must be bytes.*got '-1'"),
    ({"max_held_bytes": 2.5}, "max_held_bytes must be bytes.*got 2.5"),
    ({"budget": "abc"}, r"budget must be bytes \(an int >= 0 or a size such as '8GiB'\) or a fraction in \(0, 1\], "
                        r"got 'abc'"),
    ({"budget": -1}, "budget must be bytes.*got -1"),
    ({"budget": 1.5}, "budget must be bytes.*fraction in .0, 1.*got 1.5"),
    ({"mode": "deamon"}, "mode must be one of 'auto', 'daemon', 'embedded'; got 'deamon'"),
    ({"codec": "lz4"}, "codec must be None .*got 'lz4'"),
    ({"socket": "http://host/x"}, "socket 'http://host/x': use a path, ipc://PATH or tcp://127.0.0.1:PORT"),
    ({"verify": "no"}, "verify must be True or False; got 'no'"),
    ({"socket": 5}, "socket must be a path, ipc://PATH or tcp://127.0.0.1:PORT; got 5"),
    ({"socket": "   "}, "socket '   ' is blank"),
    ({"socket": "/tmp/" + "d" * 120 + "/s.sock"}, "its path is 132 bytes and a unix socket's may have at most 107"),
]


def test_a_socket_given_as_a_path_object_is_that_path(tmp_path):
    """pathlib.Path is how a careless user passes a path: it gave AttributeError ('startswith')."""
    assert storm.offload(socket=tmp_path / "s.sock").options["socket"] == f"ipc://{tmp_path}/s.sock"


@pytest.mark.parametrize("options,message", BAD_OPTIONS, ids=[repr(o) for o, _ in BAD_OPTIONS])
def test_each_bad_option_is_refused_where_it_is_given_naming_it(options, message):
    """Issue 38, item 12: refused by the constructor (not at ``with``), naming the option and what
    it accepts. On main pool_size=0 became 2 GiB, min_bytes=1.5 became 1, '-1' and 'abc' gave
    "cannot read size" without the option's name, a misspelt mode passed until ``with``."""
    with pytest.raises(ValueError, match=message):
        storm.offload(**options)
    with pytest.raises(ValueError, match=message):  # storm.plan passes the options on, checked as early
        storm.plan([nn.Linear(2, 2)], **{"budget": 1.0, **options})


@pytest.mark.parametrize("modules", [5, "model", [nn.Linear], [nn.Linear(2, 2), None]])
def test_modules_that_are_not_module_instances_are_refused(modules):
    """modules= takes modules, refused where given (5, 'model' and the class nn.Linear gave a raw
    TypeError or AttributeError)."""
    with pytest.raises(ValueError, match="modules must be an nn.Module instance or an iterable of them"):
        storm.offload(modules=modules)


def test_modules_given_as_a_generator_count_in_every_step():
    """A generator (model.modules()) is read once: every call of a decorated function keeps the
    buffer and names the layers. It was used up by the first reader: the buffer was offloaded and
    the report named no layer."""
    model = nn.Linear(128, 128)
    model.register_buffer("b", torch.randn(128, 128))

    @storm.offload(mode="embedded", min_bytes=0, modules=model.modules())
    def forward(x: torch.Tensor) -> torch.Tensor:
        return (model(x) @ model.b).sum()

    made = []
    recreate = storm.Offload._recreate_cm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(storm.Offload, "_recreate_cm", lambda self: made.append(recreate(self)) or made[-1])
        for _ in range(2):
            forward(torch.randn(4, 128)).backward()
    assert [c.stats.kept.get(storm.Keep.MODULE_STATE) for c in made] == [1, 1]
    assert all("Linear" in c.report() for c in made)


@pytest.mark.parametrize("variable,value,message", [
    ("STORM_POOL_SIZE", "abc", "STORM_POOL_SIZE must be bytes: at least 4KiB.*got 'abc'"),
    ("STORM_POOL_SIZE", "0", "STORM_POOL_SIZE must be bytes: at least 4KiB.*got '0'"),
    ("STORMD_SOCKET", "udp://127.0.0.1:1", "STORMD_SOCKET: socket 'udp://127.0.0.1:1': use a path"),
])
def test_a_bad_environment_variable_is_named(variable, value, message, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        storm.offload()


def test_sizes_given_are_read_as_whole_bytes(monkeypatch):
    monkeypatch.setenv("STORM_POOL_SIZE", "8MB")
    o = storm.offload(min_bytes="1.5KiB", prefetch_bytes=0, max_held_bytes="1GB", mode="embedded")
    assert [o.options[k] for k in ("min_bytes", "prefetch_bytes", "max_held_bytes", "pool_size")] == \
        [1536, 0, 10**9, 8 * 10**6]
    with o:
        pass
    assert o._session.backend.pool.size == 8 * 10**6


def test_the_embedded_store_reads_no_daemons_socket_variable(monkeypatch):
    """A garbage $STORMD_SOCKET concerns a daemon; mode='embedded' refused to train over it."""
    monkeypatch.setenv("STORMD_SOCKET", "udp://127.0.0.1:1")
    x = torch.randn(64, 64, requires_grad=True)
    with storm.offload(mode="embedded", min_bytes=0) as ctx:
        loss = x.exp().sum()
    loss.backward()
    assert ctx.stats.offloaded == 1 and ctx.backend_name == "embedded store"
    with pytest.raises(ValueError, match="STORMD_SOCKET"):  # where a daemon is looked for, it is named
        storm.offload(mode="auto")
