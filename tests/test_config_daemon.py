"""The config's problems and the daemon's facts, with the real command and a
real daemon (issue 31, items 5 and 8): `serve` on a file with several
problems prints each on its own line and starts nothing; a start with a
misspelt STREAMFENCE_* variable warns of it; an admin's `status` carries
the version, uptime, config path and state dir (and `streamfence status`
shows them first), another identity's does not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, wait_until

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """Our environment without STREAMFENCE_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}


def _cli(cwd: Path, *args: str, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamfence.cli", *args], cwd=cwd,
                          env=_env() | (env or {}), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_serve_names_every_problem_one_a_line(tmp_path: Path) -> None:
    path = tmp_path / "streamfence.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nworkers_spar = 4\n'
                    f'log_level = "loud"\n\n[provders.openai]\nkind = "openai"\n\n'
                    f'[providers.claude]\nkind = "anthropic"\nstale_timout_s = 60\n')
    started = time.monotonic()
    proc = _cli(tmp_path, "serve", "--config", str(path),
                env={"STREAMFENCE_QUEUE_MAX": "lots"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert time.monotonic() - started < 30
    assert "Traceback" not in proc.stderr, proc.stderr
    prefix = f"Error: invalid configuration: {path}: "
    assert proc.stderr.splitlines() == [
        f"{prefix}provders: unknown table (did you mean 'providers'?)",
        f"{prefix}daemon.workers_spar: unknown key (did you mean 'workers_spare'?)",
        f"{prefix}daemon.log_level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
        f"(any case), got 'loud'",
        f"{prefix}providers.claude.stale_timout_s: unknown key (did you mean "
        f"'stale_timeout_s'?)",
        "Error: invalid configuration: environment STREAMFENCE_QUEUE_MAX: expected int, "
        "got 'lots'"], proc.stderr
    assert not (tmp_path / "state").exists()  # refused before anything is made


TYPO = "STREAMFENCE_WORKER_MAX"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon (no provider profile: none is needed) started with a misspelt
    STREAMFENCE_* variable in its environment."""
    proc = DaemonProcess(tmp_path_factory.mktemp("facts") / "state", {}, env={TYPO: "4"})
    try:
        yield proc.start()
    finally:
        proc.cleanup()
    assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


def test_an_unknown_variable_is_a_warning_at_start(daemon: DaemonProcess) -> None:
    warnings = [r["message"] for r in daemon.log_records()
                if r.get("level") == "WARNING" and TYPO in r.get("message", "")]
    assert warnings == [f"environment {TYPO}: streamfence reads no such variable (did you "
                        f"mean STREAMFENCE_WORKERS_MAX?); it is ignored"], \
        daemon.log_text()[-3000:]


def test_an_admins_status_says_which_daemon_and_since_when(daemon: DaemonProcess) -> None:
    with daemon.client() as client:
        first = client.status()
        assert first["version"] == version("streamfence")
        assert first["config_path"] == str(daemon.config_path)
        assert first["state_dir"] == str(daemon.state_dir)
        assert 0 < first["uptime_s"] < 600
        later = wait_until(lambda: (s := client.status())["uptime_s"] > first["uptime_s"]
                           and s, 10, "the uptime to grow")
    assert later["uptime_s"] > first["uptime_s"]


def test_the_status_command_prints_them_first(daemon: DaemonProcess) -> None:
    proc = _cli(daemon.state_dir, "status", "--config", str(daemon.config_path))
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert header.startswith(f"streamfence {version('streamfence')}, up "), header
    assert header.endswith(f", config {daemon.config_path}, state dir {daemon.state_dir}"), \
        header


def test_another_identity_sees_none_of_them(daemon: DaemonProcess) -> None:
    store = KeyStore(daemon.state_dir / "keys")
    store.register("alice", daemon.endpoint)
    with daemon.client(credentials=store.credentials_path("alice")) as client:
        reply = wait_until(lambda: client.status(), 10, "alice's status")
    assert reply["identity"] == "alice" and reply["role"] == "client", reply
    assert not {"version", "uptime_s", "config_path", "state_dir"} & set(reply), reply
