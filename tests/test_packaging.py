"""Packaging acceptance: the wheel, installed into a fresh virtual environment
beside PyPI's `supervisor` (supervisord, whose import package is also called
`supervisor`), gives a working `streamfence` command and one import package,
`streamfence`, that keeps working when supervisor is uninstalled.

Resolving the dependencies against the package index costs ~50 s of a 2-core
machine (the index pages of boto3 and botocore are large) and pip's own HTTP
cache stores nothing here, so the resolved dependencies are kept as wheels (`pip
wheel` builds any that PyPI has only as a source archive) in a wheelhouse
(~/.cache/streamfence-tests/wheelhouse, or under $XDG_CACHE_HOME) and the
fresh environment installs from it offline. The wheelhouse is filled again
from the index when it is a week old, or when it lacks what the wheel now
requires; delete it to force that.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
REFRESH_AFTER_S = 7 * 24 * 3600


def _wheelhouse() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "streamfence-tests" / "wheelhouse"


def _env() -> dict[str, str]:
    """Our environment without what would make the fresh one see the checkout
    or this virtual environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


class Steps:
    """Runs commands, times them, and fails with the command's output."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.times: list[tuple[str, float]] = []

    def run(self, what: str, cmd: list[str | Path], timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        try:
            proc = subprocess.run([str(c) for c in cmd], cwd=self.cwd, env=_env(),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{what}: no end after {timeout:.0f}s: {' '.join(map(str, cmd))}\n"
                        f"{self.summary()}\nstderr tail:\n{str(exc.stderr or '')[-3000:]}")
        self.times.append((what, time.monotonic() - started))
        if check and proc.returncode != 0:
            pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n"
                        f"stdout tail:\n{proc.stdout[-3000:]}\nstderr tail:\n"
                        f"{proc.stderr[-3000:]}\n{self.summary()}")
        return proc

    def summary(self) -> str:
        return "timings: " + ", ".join(f"{what} {s:.1f}s" for what, s in self.times)


def _pip() -> list[str | Path]:
    """This environment's pip, pointed at other interpreters with --python
    (pip >= 22.3), so that the fresh environment need not get a pip of its own."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.fail(f"pip is not installed in {sys.prefix} (needed to build and install the "
                    f"wheel): {proc.stderr.strip()}")
    return [sys.executable, "-m", "pip"]


def _wheel_contents(wheel: Path) -> tuple[list[str], list[str], str]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        record = zf.read(f"{dist_info}/RECORD").decode()
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    recorded = [row[0] for row in csv.reader(io.StringIO(record)) if row]
    return names, recorded, entry_points


def _top_level(paths: list[str]) -> set[str]:
    """What a wheel's files install at the top of site-packages: the first path
    part, except the metadata directory; a .data directory's purelib and
    platlib count as the top level too."""
    tops = set()
    for path in paths:
        parts = path.split("/")
        if parts[0].endswith(".dist-info"):
            continue
        if parts[0].endswith(".data"):
            if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                tops.add(parts[2])
            continue
        tops.add(parts[0])
    return {t.removesuffix(".py") for t in tops}


def test_wheel_installs_one_import_package_beside_supervisor(tmp_path: Path) -> None:
    steps = Steps(tmp_path)
    pip = _pip()

    # 1. the wheel, and what is in it
    dist = tmp_path / "dist"
    steps.run("build the wheel", [*pip, "wheel", "--no-deps", "-q", "-w", dist, ROOT])
    wheels = sorted(dist.glob("streamfence-*.whl"))
    assert len(wheels) == 1, f"expected one streamfence wheel in {dist}: {os.listdir(dist)}"
    wheel = wheels[0]
    names, recorded, entry_points = _wheel_contents(wheel)
    assert _top_level(names) == {"streamfence"}, (
        f"the wheel must install exactly one top-level import package, streamfence; "
        f"it installs {sorted(_top_level(names))}")
    assert _top_level(recorded) == {"streamfence"}, sorted(_top_level(recorded))
    assert "streamfence/py.typed" in names, "streamfence/py.typed (PEP 561) is not in the wheel"
    assert "streamfence/workers/warmup.pem" in names, "a spare's TLS warm-up needs warmup.pem"
    static = {p.relative_to(ROOT).as_posix()
              for p in (ROOT / "streamfence" / "gateway" / "static").iterdir()}
    assert static <= set(names), f"the console's files the wheel lacks: {sorted(static - set(names))}"
    in_tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "streamfence").rglob("*.py")}
    missing = sorted(in_tree - set(names))
    assert not missing, f"modules of the tree that the wheel lacks: {missing}"
    assert "streamfence = streamfence.cli:main" in entry_points, entry_points

    # 2. a fresh virtual environment with the wheel and PyPI's supervisor
    venv = tmp_path / "venv"
    steps.run("create the venv", [sys.executable, "-m", "venv", "--without-pip", venv])
    python, bindir = venv / "bin" / "python", venv / "bin"
    into: list[str | Path] = [*pip, "--python", python]
    wanted: list[str | Path] = [wheel, "supervisor"]
    house = _wheelhouse()
    stamp = house / ".filled"
    fresh = stamp.exists() and time.time() - stamp.stat().st_mtime < REFRESH_AFTER_S
    offline: list[str | Path] = [*into, "install", "-q", "--no-compile", "--no-index", "--find-links", house,
               *wanted]
    if not fresh or steps.run("install from the wheelhouse", offline,
                              check=False).returncode != 0:
        house.mkdir(parents=True, exist_ok=True)
        steps.run("fill the wheelhouse from the index",
                  [*pip, "wheel", "-q", "-w", house, *wanted], timeout=600)
        for copy in house.glob("streamfence-*.whl"):  # the wheel goes in by its path
            copy.unlink()
        stamp.touch()
        steps.run("install from the wheelhouse", offline)

    # 3. both commands work
    helped = steps.run("streamfence --help", [bindir / "streamfence", "--help"])
    for command in ("serve", "submit", "status", "demo"):
        assert command in helped.stdout, f"`streamfence --help` lacks {command}:\n{helped.stdout}"
    version = steps.run("supervisord --version", [bindir / "supervisord", "--version"])
    assert version.stdout.strip()[:1].isdigit(), version.stdout
    both = steps.run("import both", [python, "-c",
                                     "import streamfence, supervisor.supervisord; "
                                     "print(streamfence.__file__); print(supervisor.__file__)"])
    site = venv / "lib"
    for path in both.stdout.split():
        assert Path(path).resolve().is_relative_to(site.resolve()), (
            f"{path} is not from the fresh environment ({site})")

    # 4. without supervisor, streamfence still imports
    steps.run("uninstall supervisor", [*into, "uninstall", "-y", "-q", "supervisor"])
    after = steps.run("import streamfence", [
        python, "-c",
        "import importlib.util, streamfence; from streamfence import Client; "
        "assert importlib.util.find_spec('supervisor') is None, 'supervisor still installed'; "
        "print(streamfence.__file__)"])
    assert Path(after.stdout.strip()).resolve().is_relative_to(site.resolve()), after.stdout
    print(steps.summary())
