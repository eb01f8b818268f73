"""Strict tooling as a test, so CI holds the line: ruff over the tree, mypy
(strict, see pyproject.toml's [tool.mypy]) over the code and its tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed beside {sys.executable} (pip install -e '.[test]')")
    return found


def test_ruff_is_clean() -> None:
    proc = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_strict_is_clean() -> None:
    """What `mypy` runs (pyproject's packages) is what CI holds: the code, the
    tests (so a fake that drifts from the Protocol it stands for fails) and the
    scripts (the chaos judges and the bench read the daemon's types too)."""
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert mypy["strict"] is True and mypy["packages"] == ["streamfence", "tests", "scripts"]
    proc = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:]
