"""The import graph of the repository's packages, read from the source (ast), not by importing it.

Three rules, each a test:

- The client (storm/, installed as ``storm``) reaches the daemon only through
  its public surface for clients, ``stormd.wire``, and storm/embedded.py
  through ``stormd.embedded`` besides: the daemon's internals (store, service,
  server, settings) stay free to change without the client.
- No import cycle among the modules of storm/, storm/kernels/ and stormd/. Every
  import counts, a function-level one too: an import deferred into a function
  still ties the two modules together, and one that breaks a cycle at import
  time hides it rather than removing it. Imports of a package's ``__init__``
  as a side effect of importing one of its modules are not counted: every
  module of a package would otherwise be in a cycle with an ``__init__`` that
  re-exports it.
- Tests and benchmarks import the packages by their one name (``storm``,
  ``stormd``): a module loaded under two names is two modules, with two classes
  of each, and an ``except`` on one does not catch the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"  # each folder under it is the package it installs
PACKAGES = ("storm", "stormd")
EMBEDDED_ENTRY = ("storm.embedded", "stormd.embedded")  # the one module of the client that may use the daemon's Service


def _modules() -> dict[str, Path]:
    """Installed module name -> source file, for every module of the repository's packages."""
    out = {}
    for package in PACKAGES:
        for f in sorted((SRC / package).rglob("*.py")):
            parts = f.relative_to(SRC).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository's modules (or, outside them, the dotted names) that ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in modules else module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_client(name: str) -> bool:
    return name.startswith("storm") and not name.startswith(("stormd", "storm.kernels"))


def test_the_client_imports_the_daemon_only_through_stormd_wire():
    wrong = []
    for name, imports in sorted(_graph().items()):
        if not _is_client(name):
            continue
        for target in sorted(imports):
            if target.split(".")[0] != "stormd":
                continue
            if target == "stormd.wire" or target.startswith("stormd.wire.") or (name, target) == EMBEDDED_ENTRY:
                continue
            wrong.append(f"{name} imports {target}")
    assert not wrong, ("the client may import the daemon only through stormd.wire (and storm.embedded "
                       "through stormd.embedded); move what it needs there:\n" + "\n".join(wrong))


def test_no_import_cycle_among_the_repositorys_modules():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def test_tests_and_benchmarks_import_the_packages_by_their_one_name():
    """Not as the folders they once were (client, kernels, examples at the top level)."""
    others = {"client", "kernels", "examples"}
    wrong = []
    for f in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else [])
            wrong += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in others]
    assert not wrong, "import storm.* (storm.kernels, storm.examples) or stormd.*:\n" + "\n".join(wrong)


@pytest.mark.parametrize("importer, imported", [
    ("storm.backend", "storm.connection"),       # inside open_backend's helpers: function-level imports count
    ("storm.backend", "storm.embedded"),
    ("storm.embedded", "stormd.embedded"),
    ("storm.connection", "stormd.wire.protocol"),
    ("storm", "storm.hooks"),                    # a package's relative import
    ("stormd.wire.cuda", "stormd.wire.pool"),
    ("stormd.service", "stormd.wire.protocol"),  # the daemon's own modules read the same surface
    ("stormd.auth", "stormd.wire.curve"),
])
def test_the_graph_sees_the_imports_the_rules_are_about(importer, imported):
    """The rules above pass vacuously on a graph that misses imports: it holds these known ones."""
    assert imported in _graph()[importer]


def test_a_cycle_is_found_and_one_way_imports_are_not():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": {"a", "os"}}
    assert sorted(map(sorted, _cycles(graph))) == [["a", "b", "c"], ["d"]]
