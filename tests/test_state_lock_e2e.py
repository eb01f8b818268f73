"""One daemon per state dir whatever happens to a file, and a state dir that
stays private and leaves nothing behind (supervisor/statedir.py,
supervisor/runtimedir.py):

- the lock is the state directory's own: deleting `daemon.lock` under a
  running daemon lets no second one start, and the refusal names the state
  dir and the running daemon's pid (the kernel's, the note being gone);
- a socket a live process accepts on is never unlinked or bound again: a
  second daemon on the same ipc endpoint, or on a state dir put back under
  the same long path, is refused naming the socket and the pid; a dead
  daemon's socket is cleared;
- the daemon's own files that others could read are private again after a
  start; a runtime dir under the temp dir (a long state_dir) is gone after
  the stop.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from streamfence.devtools.emulator.control import EmulatorProcess
from streamfence.supervisor import statedir
from streamfence.supervisor.runtimedir import claim_sockets
from tests.harness import DaemonProcess
from tests.wires import profiles_for, request_for

# ---- the pieces, in this process ----------------------------------------------------------


def test_the_lock_is_the_directory_and_survives_its_note(tmp_path: Path) -> None:
    state = statedir.prepare(tmp_path / "state")
    held = statedir.StateLock(state)
    try:
        (state / statedir.LOCK_NAME).unlink()
        with pytest.raises(statedir.StateDirBusy) as info:
            statedir.StateLock(state)
        assert info.value.holder == str(os.getpid())
        assert str(state) in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    finally:
        held.release()
    statedir.StateLock(state).release()  # released: the next one takes it


def test_a_live_socket_is_refused_and_a_dead_one_cleared(tmp_path: Path) -> None:
    ctx = zmq.Context()
    live_path = str(tmp_path / "live")
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(f"ipc://{live_path}")
    dead_path = str(tmp_path / "dead")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(dead_path)  # bound, never listening: what a killed daemon leaves
    try:
        with pytest.raises(statedir.StateDirError) as info:
            claim_sockets([dead_path, live_path], "/the/state")
        assert live_path in str(info.value) and f"pid {os.getpid()}" in str(info.value)
        assert "/the/state" in str(info.value)
        assert not os.path.exists(dead_path)  # cleared on the way
        assert stat.S_ISSOCK(os.lstat(live_path).st_mode)  # left to its owner
    finally:
        sock.close()
        ctx.term()


def test_the_daemons_own_loose_files_are_made_private(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    state = statedir.prepare(tmp_path / "state")
    (state / "keys").mkdir(mode=0o755)
    (state / "keys" / "server.key_secret").write_text("secret")
    (state / "journal.db").write_text("")
    (state / "notes.txt").write_text("")  # not the daemon's: left as it is
    for path, mode in (("keys", 0o755), ("keys/server.key_secret", 0o644), ("journal.db", 0o640),
                       ("notes.txt", 0o644)):
        os.chmod(state / path, mode)
    statedir.make_private(state)
    modes = {p: stat.S_IMODE((state / p).stat().st_mode)
             for p in ("keys", "keys/server.key_secret", "journal.db", "notes.txt")}
    assert modes == {"keys": 0o700, "keys/server.key_secret": 0o600, "journal.db": 0o600,
                     "notes.txt": 0o644}, {k: oct(v) for k, v in modes.items()}
    assert "3 file(s)" in caplog.text and "journal.db 640 -> 600" in caplog.text, caplog.text


# ---- the real daemon -------------------------------------------------------------------------


def _serve(config: Path, timeout: float = 30.0) -> tuple[subprocess.CompletedProcess[str], float]:
    """`streamfence serve` that should refuse: a start that does not is killed by
    the timeout, which fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "serve", "--config",
                           str(config)], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - started


def _refused(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode not in (0, None), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _still_serves(daemon: DaemonProcess, key: str) -> None:
    assert daemon.proc is not None
    with daemon.client() as client:
        assert client.status()["processes"]["supervisor"] == daemon.proc.pid
        done = client.run("emu", request_for("openai", key), timeout_s=30.0)
    assert done["status"] == "completed", done


@pytest.mark.slow
def test_a_deleted_lock_file_lets_no_second_daemon_start(make_daemon: Any) -> None:
    daemon: DaemonProcess = make_daemon()
    assert daemon.proc is not None
    (daemon.state_dir / statedir.LOCK_NAME).unlink()
    proc, took = _serve(daemon.config_path)
    _refused(proc, str(daemon.state_dir), f"pid {daemon.proc.pid}")
    assert took < 10, f"the second daemon took {took:.1f} s to give up"
    _still_serves(daemon, "lock-deleted")


@pytest.mark.slow
def test_a_second_daemon_on_the_same_ipc_endpoint_is_refused(
        tmp_path: Path, make_daemon: Any, emulator: EmulatorProcess) -> None:
    daemon: DaemonProcess = make_daemon()
    assert daemon.proc is not None
    other = DaemonProcess(tmp_path / "other", profiles_for(emulator, {"emu": "openai"}),
                          daemon={"endpoint": daemon.endpoint})
    proc, _ = _serve(other.config_path)
    _refused(proc, daemon.endpoint.removeprefix("ipc://"), f"pid {daemon.proc.pid}",
             str(other.state_dir))
    _still_serves(daemon, "endpoint-shared")


@pytest.fixture
def temp() -> Iterator[Path]:
    """A short $TMPDIR for the daemon (its runtime dir's sockets go under it)."""
    path = Path(tempfile.mkdtemp(prefix="sfr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _long_state_dir(tmp_path: Path) -> Path:
    """A state dir whose `run/` would be too long a path for a unix socket."""
    state = tmp_path / ("s" * 60) / ("t" * 60)
    assert len(str(state / "run" / "sink.ctl")) >= 100
    return state


@pytest.mark.slow
def test_a_state_dir_put_back_under_a_running_daemon_takes_none_of_its_sockets(
        tmp_path: Path, temp: Path, emulator: EmulatorProcess) -> None:
    state = _long_state_dir(tmp_path)
    first = DaemonProcess(state, profiles_for(emulator, {"emu": "openai"}),
                          env={"TMPDIR": str(temp)})
    try:
        first.start()
        assert first.proc is not None
        [runtime] = list(temp.iterdir())
        # The state dir moved away and a new one made at its path (a restore
        # from a backup, say): its lock is a new directory's, its runtime
        # dir's path the same.
        moved = state.with_name("moved")
        state.rename(moved)
        second = DaemonProcess(state, profiles_for(emulator, {"emu": "openai"}))
        env = dict(os.environ, TMPDIR=str(temp))
        proc = subprocess.run([sys.executable, "-m", "streamfence.cli", "serve", "--config",
                               str(second.config_path)], env=env, capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
        second.cleanup()
        _refused(proc, str(runtime), f"pid {first.proc.pid}", str(state))
        shutil.rmtree(state)
        moved.rename(state)
        _still_serves(first, "put-back")
    finally:
        first.cleanup()


@pytest.mark.slow
def test_a_long_state_dir_leaves_no_runtime_dir_and_loose_files_are_private(
        tmp_path: Path, temp: Path, emulator: EmulatorProcess) -> None:
    daemon = DaemonProcess(_long_state_dir(tmp_path), profiles_for(emulator, {"emu": "openai"}),
                           env={"TMPDIR": str(temp)})
    try:
        daemon.start()
        [runtime] = list(temp.iterdir())
        assert runtime.name.startswith(f"streamfence-{os.geteuid()}-"), runtime
        with daemon.client() as client:
            done = client.run("emu", request_for("openai", "long-dir"), timeout_s=30.0)
        assert done["status"] == "completed", done
        assert daemon.stop() == 0, daemon.log_text()[-3000:]
        assert list(temp.iterdir()) == [], "the runtime dir outlived the daemon"
        # A copy restored with loose modes: the next start makes the daemon's files private.
        loose = ["journal.db", "transcript.db", "keys", "keys/server.key_secret"]
        for name in loose:
            path = daemon.state_dir / name
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        daemon.start()
        for name in loose:
            mode = stat.S_IMODE((daemon.state_dir / name).stat().st_mode)
            assert mode & 0o077 == 0, f"{name} is still {mode:o}"
        assert any(r.get("level") == "WARNING" and "private now" in r.get("message", "")
                   for r in daemon.log_records()), daemon.log_text()[-3000:]
    finally:
        daemon.cleanup()
    assert list(temp.iterdir()) == []
