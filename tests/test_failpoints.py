"""The failpoints themselves (protocol/failpoints.py): the spec's grammar,
each action in a real process, `@N`, once per daemon with a directory, the
record of passes; and that ARCHITECTURE §7 lists exactly the points the
code places."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamfence.protocol import failpoints
from streamfence.protocol.failpoints import POINTS, Action, parse

ROOT = Path(__file__).resolve().parent.parent
SOME_POINT = "sink.after_commit"


def test_a_spec_parses_into_actions() -> None:
    armed = parse(f"{SOME_POINT}=crash; worker.before_final=pause(800ms)@2;"
                  "gateway.replay_to_live=pause(1.5s);*=count")
    assert armed == {SOME_POINT: Action("crash"),
                     "worker.before_final": Action("pause", 0.8, 2),
                     "gateway.replay_to_live": Action("pause", 1.5),
                     "*": Action("count")}
    assert parse("") == {}


@pytest.mark.parametrize("spec, says", [
    ("nowhere.at_all=crash", "'nowhere.at_all' is no failpoint"),
    (f"{SOME_POINT}=explode", "is not NAME=ACTION"),
    (f"{SOME_POINT}=pause", "pause takes a time"),
    (f"{SOME_POINT}=crash(5ms)", "pause takes a time"),
    (f"{SOME_POINT}=crash@0", "@N counts from 1"),
    (f"{SOME_POINT}", "is not NAME=ACTION"),
])
def test_a_bad_spec_is_refused_naming_the_entry(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(spec)


def _pass_through(spec: str, times: int, where: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A process armed with `spec` passes SOME_POINT `times` times, printing
    what each pass returned."""
    code = ("from streamfence.protocol.failpoints import ARMED, failpoint\n"
            f"for i in range({times}):\n"
            f"    print(i, bool(ARMED) and failpoint({SOME_POINT!r}), flush=True)\n")
    env = dict(os.environ, STREAMFENCE_FAILPOINTS=spec)
    env.pop("STREAMFENCE_FAILPOINTS_DIR", None)
    if where is not None:
        env["STREAMFENCE_FAILPOINTS_DIR"] = str(where)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=30)


def test_crash_kills_the_process_at_the_armed_pass() -> None:
    proc = _pass_through(f"{SOME_POINT}=crash@3", 5)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.split("\n")[:2] == ["0 False", "1 False"]
    assert "2 " not in proc.stdout


def test_drop_is_answered_once_raise_raises_and_pause_returns() -> None:
    assert _pass_through(f"{SOME_POINT}=drop@2", 3).stdout.split() == \
        ["0", "False", "1", "True", "2", "False"]
    raised = _pass_through(f"{SOME_POINT}=raise", 2)
    assert raised.returncode == 1 and "FailpointError: failpoint sink.after_commit" in raised.stderr
    paused = _pass_through(f"{SOME_POINT}=pause(10ms)", 2)
    assert paused.returncode == 0 and paused.stdout.split() == ["0", "False", "1", "False"]


def test_disarmed_no_point_acts_and_nothing_is_recorded(tmp_path: Path) -> None:
    proc = _pass_through("", 3, where=tmp_path)
    assert proc.returncode == 0
    assert failpoints.hits(str(tmp_path)) == []


def test_with_a_directory_an_action_fires_once_for_all_processes(tmp_path: Path) -> None:
    """A restarted process passes the point again but does not fire: a sink
    armed to crash after a commit crashes once, not at every restart."""
    first = _pass_through(f"{SOME_POINT}=crash", 2, where=tmp_path)
    second = _pass_through(f"{SOME_POINT}=crash", 2, where=tmp_path)
    assert first.returncode == -signal.SIGKILL
    assert second.returncode == 0
    assert failpoints.hits(str(tmp_path)) == [SOME_POINT] * 3


def test_a_wildcard_count_records_every_pass(tmp_path: Path) -> None:
    proc = _pass_through("*=count", 2, where=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split()[1::2] == ["False", "False"]
    assert failpoints.hits(str(tmp_path)) == [SOME_POINT] * 2


# ---- the list in ARCHITECTURE and the places in the code --------------------------------

def _placed() -> dict[str, list[str]]:
    """Point name -> the files that pass through it (`failpoint("name")`)."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "streamfence").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "failpoint" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                found.setdefault(str(node.args[0].value), []).append(
                    str(path.relative_to(ROOT)))
    return found


def test_architecture_lists_exactly_the_points() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## 7.", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z]+\.[a-z_]+)` \|", section, re.M))
    assert listed == set(POINTS), (f"only in ARCHITECTURE §7: {sorted(listed - set(POINTS))}; "
                                   f"only in POINTS: {sorted(set(POINTS) - listed)}")


def test_every_point_is_placed_once_and_every_placed_point_is_known() -> None:
    placed = _placed()
    assert set(placed) <= set(POINTS), f"unknown points placed: {set(placed) - set(POINTS)}"
    missing = sorted(set(POINTS) - set(placed))
    assert not missing, f"points no code passes through: {missing}"
    twice = {n: files for n, files in placed.items() if len(files) > 1}
    assert not twice, f"points placed more than once: {twice}"
