"""Which code produced a result: every benchmark records it the same way."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    """$STORM_COMMIT when set (the lent GPU machine gets a copy of the tree whose .git, if any, is
    not this checkout's), else the checkout's HEAD, else "unknown"."""
    if os.environ.get("STORM_COMMIT"):
        return os.environ["STORM_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 and git.stdout.strip() else "unknown"
