"""The repository stands alone: no tracked file points at folders beside the clone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Tracked paths the check skips (a file, or a folder with its trailing slash).
NOT_CHECKED: tuple[str, ...] = ()
# Written split so that this file does not match itself.
OUTSIDE = (".." + "/shared", "shared" + "/data")


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the tracked files are unknown")
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = _tracked_files()
    assert "pyproject.toml" in files
    hits = []
    for rel in files:
        if rel.startswith(NOT_CHECKED) or not (ROOT / rel).is_file():
            continue
        text = (ROOT / rel).read_bytes().decode("utf-8", errors="replace")
        hits += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                 if any(word in line for word in OUTSIDE)]
    assert not hits, "files outside the repository are not there on a user's machine:\n" + "\n".join(hits)
