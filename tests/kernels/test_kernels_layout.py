"""The layout of storm.kernels: no import cycle among its modules (imports inside functions
included: the GPU kernels are imported lazily, and a lazy import closes a cycle as surely as a
top-level one), each Triton module under storm/kernels/gpu/ imports nothing from the CPU side but
the frame's layout, and no module grows past what a reader takes in at once."""
from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "src" / "storm" / "kernels"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Dotted name (``kernels.codecs.ancf``; a package by its own name) -> file."""
    out = {}
    for f in KERNELS.rglob("*.py"):
        parts = list(f.relative_to(KERNELS.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of storm.kernels that ``name`` imports, anywhere in its file. ``from . import x``
    imports module x when there is one (its package is already being imported: not an edge)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("storm.kernels"):
            target = "kernels" + node.module[len("storm.kernels"):]
        else:
            continue
        for alias in node.names:
            dep = f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
            if dep in modules and dep != name:
                out.add(dep)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_the_graph_sees_lazy_imports() -> None:
    """The check below would pass vacuously if it missed the imports inside functions."""
    graph = _graph()
    assert "kernels.gpu.frame" in graph["kernels.frame"]  # imported inside encode_frame
    assert "kernels.gpu.huffman_code" in graph["kernels.huffman"]


def test_no_import_cycle_in_kernels() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_gpu_modules_import_only_gpu_modules_and_the_frame_layout() -> None:
    for name, deps in _graph().items():
        if name.startswith("kernels.gpu"):
            outside = {d for d in deps if not d.startswith("kernels.gpu")} - {"kernels.frame_layout"}
            assert not outside, f"{name} imports {sorted(outside)} from the CPU side"


def test_no_module_over_max_lines() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long
