"""The main job (storm/examples/train_gpt.py) and the installed package's layout."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import storm.examples.train_gpt as train_gpt

SMALL = ["--steps", "2", "--seq", "32", "--d-model", "32", "--layers", "1", "--heads", "2", "--batch", "2",
         "--min-bytes", "0"]


def test_train_gpt_embedded_checks_gradients_bit_for_bit(capsys):
    assert train_gpt.main([*SMALL, "--mode", "embedded"]) == 0
    out = capsys.readouterr().out
    assert "gradients bit-identical" in out and "through embedded store" in out
    n, total = out.split("first step: ")[1].split(" ")[0].split("/")
    assert n == total and int(total) > 10
    # the run's peak beside the one of a step without STORM (issue 53: the peak alone said nothing)
    assert re.search(r"peak RSS [\d.]+ MiB \([\d.]+ MiB by the end of the first step without STORM", out), out


def test_train_gpt_with_a_plan_traces_plans_and_explains(capsys):
    args = ["--steps", "4", "--seq", "32", "--d-model", "32", "--layers", "3", "--heads", "2", "--batch", "2",
            "--min-bytes", "0", "--mode", "embedded", "--no-check", "--quiet", "--plan", "0.3"]
    assert train_gpt.main(args) == 0
    out = capsys.readouterr().out
    assert "storm.plan: budget 30% of" in out
    decisions = [" ".join(line.split()[5:]) for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(decisions) == 3 and set(decisions) <= {"keep", "offload", "recompute", "recompute, inputs offloaded"}
    assert set(decisions) != {"keep"}  # 30% of the saves cannot stay as they are


@pytest.mark.parametrize("args, says", [
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--batch", "-2"], "--batch: must be at least 1"),
    (["--heads", "3"], "--d-model 128 is not a multiple of --heads 3"),
    (["--min-bytes", "x"], "--min-bytes: cannot read size 'x': use bytes or a number with a unit"),
    (["--max-held-bytes", "1.5"], "--max-held-bytes: size '1.5' is not a whole number of bytes"),
    # --plan: "half" and "1.5" gave a traceback, "2" was taken as 2 bytes; --device gpu a torch traceback
    (["--plan", "half"], "--plan: must be a size with a unit (such as 64MiB) or a fraction in (0, 1]"),
    (["--plan", "2"], "--plan: must be a size with a unit (such as 64MiB) or a fraction in (0, 1] with a decimal "
                      "point (such as 0.3); got '2'"),
    (["--plan", "1.5"], "--plan: must be a size with a unit"),
    (["--device", "gpu"], "--device: not a torch device: 'gpu' (use cpu, cuda or cuda:N)"),
    (["--plot", "/nonexistent/memory.png"], "--plot /nonexistent/memory.png: there is no directory /nonexistent"),
])
def test_train_gpt_refuses_bad_arguments_clearly(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        train_gpt.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_train_gpt_without_a_daemon_in_daemon_mode_says_so_and_exits_1(tmp_path, monkeypatch, capsys):
    """storm's errors end the run with their message and exit status 1 (it was a StormUnavailable
    traceback)."""
    monkeypatch.setenv("STORMD_SOCKET", str(tmp_path / "none.sock"))
    assert train_gpt.main([*SMALL, "--mode", "daemon"]) == 1
    assert "stormd" in capsys.readouterr().err


def test_train_gpt_takes_sizes_as_the_python_api_does(capsys):
    """Issue 41, first hour: `--min-bytes 64KiB` was refused ('invalid int value')."""
    assert train_gpt.main([*SMALL, "--mode", "embedded", "--min-bytes", "1KiB", "--max-held-bytes", "8MiB"]) == 0
    assert "gradients bit-identical" in capsys.readouterr().out


def test_train_gpt_plot_without_matplotlib_says_which_extra_before_training(monkeypatch, capsys):
    """Issue 41, first hour: without matplotlib, --plot failed after training with a raw ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: find_spec gives None
    with pytest.raises(SystemExit) as e:
        train_gpt.main([*SMALL, "--mode", "embedded", "--plot", "memory.png"])
    err = capsys.readouterr()
    assert e.value.code == 2 and "pip install matplotlib" in err.err
    assert "step" not in err.out  # refused before any training


def test_train_gpt_exits_nonzero_when_a_gradient_differs(monkeypatch, capsys):
    monkeypatch.setattr(train_gpt, "same_bits", lambda a, b: False)
    assert train_gpt.main([*SMALL, "--mode", "embedded"]) == 1


def test_train_gpt_console_script_through_the_daemon(daemon):
    exe = Path(sys.executable).parent / "storm-train-gpt"
    r = subprocess.run([str(exe), *SMALL, "--mode", "daemon", "--socket", daemon.endpoint],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "through stormd at " + daemon.endpoint in r.stdout


def test_wheel_holds_every_module_under_src_at_its_name(tmp_path):
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(root)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"storm", "stormd"}, top  # nothing else lands top-level in site-packages
    # every module under src/, subpackages included, at its installed name
    # (storm.kernels.gpu once went missing: `pip install .` then failed on import)
    src = root / "src"
    expected = {f.relative_to(src).as_posix() for f in src.rglob("*.py")}
    missing = sorted(expected - set(names))
    assert not missing, missing
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "stormd = stormd.main:main" in text and "storm-train-gpt = storm.examples.train_gpt:main" in text


def _readme_install(line_start: str) -> list[str]:
    """The `pip install` arguments of the README's command line that starts with ``line_start``."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith(line_start))
    words = shlex.split(line.split("&&")[0])
    assert words[:2] == ["pip", "install"], line
    return words[2:]


@pytest.mark.parametrize("line_start", ["pip install . ", "pip install -e "], ids=["install", "test-install"])
def test_checkout_named_storm_imports_the_package_from_its_parent(tmp_path, line_start):
    """A checkout in a folder named `storm`, installed with the README's command, then `import storm`
    run from the folder above it (the current directory comes first on sys.path, and its `storm`
    folder, with no __init__.py, is a namespace package candidate): the installed package wins.
    setuptools' default editable finder loses there (pypa/setuptools#3557)."""
    root = Path(__file__).resolve().parent.parent
    checkout = tmp_path / "storm"
    shutil.copytree(root, checkout, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                                  ".pytest_cache", ".hypothesis", "bench", "tests"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site_dir = next(env_dir.glob("lib/python*/site-packages"))
    # this interpreter's packages (torch, setuptools, pip) under the new environment's own; not its
    # other sys.path entries, where an editable install of this checkout may have put the package
    sites = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site_dir / "base.pth").write_text("\n".join(sites) + "\n")
    args = [str(checkout) + a[1:] if a.startswith(".") else a for a in _readme_install(line_start)]  # '.[test]'
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                        *args], capture_output=True, text=True, timeout=600, cwd=checkout)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(python), "-c",
                        "import storm, stormd.wire; print(storm.offload.__module__, storm.__file__)"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("storm.hooks "), r.stdout


def test_every_train_gpt_option_says_what_it_does_and_its_default(capsys):
    with pytest.raises(SystemExit):
        train_gpt.main(["--help"])
    options = capsys.readouterr().out.split("options:", 1)[1]
    blocks = re.split(r"\n  (?=-)", options)[1:]  # one per option, its help lines joined
    vague = [b.split()[0] for b in blocks if not b.startswith("-h") and not re.search(r"\(default:\s", b)]
    assert len(blocks) >= 15 and not vague, vague
