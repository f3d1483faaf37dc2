"""README.md stays a user's guide, and the docs and the code's comments name only files that exist.

The README is what a new user reads first, so it is kept short (the design, the planner's model,
operations, security and the results log live in docs/). docs/results.md cites the script and the
JSON each figure comes from; a benchmark script or a result file that was moved or deleted leaves
a figure nobody can reproduce, so every such path named in README.md and docs/*.md must exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_MAX_LINES = 450
# A path ends at whitespace, a backtick, a quote, a bracket or a comma; a trailing full stop is prose.
_BENCH_SCRIPT = re.compile(r"bench/[A-Za-z0-9_\-/]+\.(?:py|sh)\b")
_RESULT_FILE = re.compile(r"bench/results/[^\s`'\")\],]+")
_TEST_FILE = re.compile(r"tests/[A-Za-z0-9_\-/]+\.py\b")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# In code (comments, docstrings, messages): a module named by its path under src/ (storm/hooks.py,
# stormd/wire/pool.py), or a file of the repository's bench/, tests/, docs/ or deploy/.
_CODE_PATH = re.compile(r"(?<![\w./-])((?:storm|stormd)/[A-Za-z0-9_/]+\.py|bench/[A-Za-z0-9_\-/]+\.(?:py|sh)"
                        r"|tests/[A-Za-z0-9_\-/]+\.py|docs/[A-Za-z0-9_\-]+\.md|deploy/[A-Za-z0-9_.\-]+[A-Za-z0-9])")
CODE = sorted({*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
               *ROOT.glob("bench/*.sh")} - {Path(__file__).resolve()})  # this file names missing ones on purpose


def _paths(pattern: re.Pattern[str], text: str) -> set[str]:
    return {match.rstrip(".:;") for match in pattern.findall(text)}


def _missing(pattern: re.Pattern[str], files: list[Path] = PAGES,
             exists: Callable[[str], bool] = lambda p: (ROOT / p).is_file()) -> dict[str, list[str]]:
    """Per file (the docs' pages by default), the paths matching `pattern` that do not exist
    (by default: as files under the repository root)."""
    missing = {}
    for f in files:
        absent = sorted(p for p in _paths(pattern, f.read_text()) if not exists(p))
        if absent:
            missing[f.relative_to(ROOT).as_posix()] = absent
    return missing


def test_the_readme_is_at_most_450_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: it is the user's guide; move detail to "
        f"docs/ (architecture.md, planner.md, operations.md, security.md, results.md) and link to it")


def test_the_docs_pages_exist_and_the_readme_links_each():
    names = {page.name for page in DOCS}
    assert {"architecture.md", "planner.md", "operations.md", "security.md", "results.md"} <= names, names
    readme = README.read_text()
    unlinked = sorted(name for name in names if f"(docs/{name})" not in readme)
    assert not unlinked, f"README.md does not link to {unlinked}"


@pytest.mark.parametrize("what, pattern", [
    ("bench/ script", _BENCH_SCRIPT),
    ("bench/results/ file", _RESULT_FILE),
    ("tests/ file", _TEST_FILE),
])
def test_every_file_the_docs_name_exists(what, pattern):
    missing = _missing(pattern)
    assert not missing, f"the docs name a {what} that does not exist (moved or deleted?): {missing}"


def _code_path_exists(path: str) -> bool:
    base = ROOT / "src" if path.split("/")[0] in ("storm", "stormd") else ROOT
    return (base / path).exists()


def test_every_file_the_code_names_exists():
    """A comment that sends the reader to a module or a script that moved or was deleted sends them nowhere."""
    missing = _missing(_CODE_PATH, CODE, _code_path_exists)
    assert not missing, f"code names files that do not exist (moved or deleted?): {missing}"


def test_the_code_path_pattern_finds_what_it_should():
    text = ("# storm/hooks.py and stormd/wire/pool.py (bench/offload.py, bench/ab.sh); see docs/graph.md, "
            "tests/test_docs.py, deploy/stormd.toml. Not tests/kernels/x or a.storm/b.py")
    assert _paths(_CODE_PATH, text) == {"storm/hooks.py", "stormd/wire/pool.py", "bench/offload.py", "bench/ab.sh",
                                        "docs/graph.md", "tests/test_docs.py", "deploy/stormd.toml"}
    assert _code_path_exists("storm/hooks.py") and _code_path_exists("deploy/stormd.toml")
    assert not _code_path_exists("storm/no_such_module.py")


def test_the_results_page_cites_scripts_and_result_files():
    """The page of figures names where each comes from; without citations the checks above pass vacuously."""
    text = (ROOT / "docs" / "results.md").read_text()
    assert len(_paths(_BENCH_SCRIPT, text)) >= 10, sorted(_paths(_BENCH_SCRIPT, text))
    assert len(_paths(_RESULT_FILE, text)) >= 20, sorted(_paths(_RESULT_FILE, text))


def test_every_relative_link_resolves():
    broken = {}
    for page in PAGES:
        targets = [t for t in _LINK.findall(page.read_text()) if "://" not in t]
        absent = sorted(t for t in targets if not (page.parent / t).exists())
        if absent:
            broken[page.relative_to(ROOT).as_posix()] = absent
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_path_patterns_find_what_they_should():
    """The regexes above, on known text: a path in backticks, at the end of a sentence, in a link."""
    text = ("run `python bench/frontier.py --quick` (`bench/results/a-b_c.json`, `bench/results/x.png`). "
            "See bench/offload.py. [p](planner.md#x) and tests/test_docs.py.")
    assert _paths(_BENCH_SCRIPT, text) == {"bench/frontier.py", "bench/offload.py"}
    assert _paths(_RESULT_FILE, text) == {"bench/results/a-b_c.json", "bench/results/x.png"}
    assert _paths(_TEST_FILE, text) == {"tests/test_docs.py"}
    assert _LINK.findall(text) == ["planner.md"]
