"""Start-up errors of the real `streamfence` command: each one exits non-zero
at once with ONE line on stderr (no traceback) that names the file, the key
and the reason; and what must be accepted starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from tests.harness import DaemonProcess, free_port
from tests.wires import STALE_S, DaemonFactory, profile_for, request_for

pytestmark = pytest.mark.slow

UNSET_KEY_ENV = "STREAMFENCE_TEST_KEY_THAT_IS_NOT_SET"


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory, emulator: EmulatorProcess) -> Iterator[DaemonProcess]:
    """One real daemon for the tests that need one running: `log_level = "info"`
    (lower case), a profile whose api_key_env is unset; SIGTERM must stop it
    cleanly (exit 0) at the end."""
    assert UNSET_KEY_ENV not in os.environ
    nokey = dict(profile_for("openai", emulator), stale_timeout_s=STALE_S,
                 api_key_env=UNSET_KEY_ENV)
    proc = module_daemon({"emu": "openai", "nokey": nokey}, daemon={"log_level": "info"})
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]  # SIGTERM: a clean stop


def _env() -> dict[str, str]:
    """Our environment without STREAMFENCE_* overrides."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}


def _run(cwd: Path, *args: str, timeout: float = 30.0,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """`streamfence ARGS` (a daemon that should have refused to start is killed
    by the timeout, which fails the test)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "streamfence.cli", *args], cwd=cwd,
                          env=_env() | (env or {}), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - started


def _serve(tmp_path: Path, config: str,
           env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    path = tmp_path / "streamfence.toml"
    path.write_text(config)
    proc, _ = _run(tmp_path, "serve", "--config", str(path), env=env)
    return proc, path


def _one_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Non-zero exit, stderr is one line holding every fragment."""
    assert proc.returncode not in (0, None), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def _daemon_table(tmp_path: Path, **extra: str) -> str:
    settings = {"state_dir": str(tmp_path / "state"), "endpoint": f"ipc://{tmp_path}/front",
                **extra}
    return "[daemon]\n" + "".join(f'{k} = "{v}"\n' for k, v in settings.items())


# ---- the state directory ------------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write: a read-only tmpfs as root, else 0500."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        os.chmod(where, 0o500)
        try:
            yield where
        finally:
            os.chmod(where, 0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs",
                              str(where)], capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"as root only a read-only mount makes a directory unwritable, and "
                    f"mount failed: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30, check=True)


@pytest.mark.parametrize("below", [False, True], ids=["is-read-only", "under-read-only"])
def test_state_dir_read_only(tmp_path: Path, read_only_dir: Path, below: bool) -> None:
    state = read_only_dir / "state" if below else read_only_dir
    proc, _ = _serve(tmp_path, _daemon_table(tmp_path, state_dir=str(state)))
    line = _one_line(proc, "daemon.state_dir", repr(str(state)))
    if os.geteuid() == 0:
        assert ("Read-only file system" if below else "read-only file system") in line, line
    else:
        assert ("Permission denied" if below else "not writable") in line, line


def test_state_dir_is_a_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.write_text("not a directory\n")
    proc, _ = _serve(tmp_path, _daemon_table(tmp_path))
    _one_line(proc, "daemon.state_dir", str(state), "not a directory")


def test_state_dir_under_proc(tmp_path: Path) -> None:
    proc, _ = _serve(tmp_path, _daemon_table(tmp_path, state_dir="/proc/streamfence-state"))
    _one_line(proc, "daemon.state_dir", "/proc/streamfence-state", "system tree")
    assert not Path("/proc/streamfence-state").exists()


def test_second_serve_on_the_same_state_dir_names_the_holder(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    holder = daemon.proc.pid
    proc, took = _run(daemon.state_dir, "serve", "--config", str(daemon.config_path))
    _one_line(proc, f"pid {holder}", str(daemon.state_dir))
    assert took < 10, f"the second daemon took {took:.1f} s to give up"
    # The first one is untouched: it still answers and still holds the lock.
    assert (daemon.state_dir / "daemon.lock").read_text().strip() == str(holder)
    with daemon.client() as client:
        assert client.status()["processes"]["supervisor"] == holder


# ---- the configuration --------------------------------------------------------------


def test_lowercase_log_level_is_accepted(daemon: DaemonProcess) -> None:
    assert 'log_level = "info"' in daemon.config_path.read_text()
    assert any(r.get("level") == "INFO" and r.get("message", "").startswith("ready")
               for r in daemon.log_records()), daemon.log_text()[-2000:]
    assert not any(r.get("level") == "DEBUG" for r in daemon.log_records())


def test_unknown_log_level_is_refused(tmp_path: Path) -> None:
    proc, path = _serve(tmp_path, _daemon_table(tmp_path, log_level="loud"))
    _one_line(proc, str(path), "daemon.log_level", "'loud'")
    assert not (tmp_path / "state").exists()  # refused before anything is created


def test_endpoint_port_out_of_range_is_refused(tmp_path: Path) -> None:
    proc, path = _serve(tmp_path, _daemon_table(tmp_path, endpoint="tcp://127.0.0.1:77555"))
    _one_line(proc, str(path), "daemon.endpoint", "1 to 65535", "77555")


def test_base_url_without_scheme_is_refused(tmp_path: Path) -> None:
    config = (_daemon_table(tmp_path)
              + '[providers.openai]\nkind = "openai"\nbase_url = "api.openai.com/v1"\n')
    proc, path = _serve(tmp_path, config)
    _one_line(proc, str(path), "providers.openai.base_url", "http", "'api.openai.com/v1'")


def test_public_tcp_endpoint_without_curve_is_refused(tmp_path: Path) -> None:
    config = _daemon_table(tmp_path, endpoint="tcp://0.0.0.0:7856", auth="none")
    proc, path = _serve(tmp_path, config)
    _one_line(proc, str(path), "daemon.endpoint", "tcp://0.0.0.0:7856",
              "reachable from other hosts", 'daemon.auth = "curve"')


def test_misspelt_auth_in_the_environment_is_refused(tmp_path: Path) -> None:
    """STREAMFENCE_AUTH=CURVE must not start a daemon without authentication."""
    proc, _ = _serve(tmp_path, _daemon_table(tmp_path), env={"STREAMFENCE_AUTH": "CURVE"})
    _one_line(proc, "STREAMFENCE_AUTH", "'CURVE'", "curve, none")
    assert not (tmp_path / "state").exists()


# ---- credentials and the daemon -----------------------------------------------------

def test_unset_api_key_env_warns_at_start_and_fails_calls(daemon: DaemonProcess,
                                                          emu: EmulatorClient) -> None:
    warnings = [r for r in daemon.log_records() if r.get("level") == "WARNING"
                and "'nokey'" in r.get("message", "") and UNSET_KEY_ENV in r.get("message", "")]
    assert warnings, f"no start-up WARNING naming the profile: {daemon.log_text()[-3000:]}"
    with daemon.client() as client:
        done = client.run("nokey", request_for("openai", "no-key"), timeout_s=30.0)
        ok = client.run("emu", request_for("openai", "with-key"), timeout_s=30.0)
    assert ok["status"] == "completed", ok  # the other profile works
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "credentials_missing", done["error"]
    assert UNSET_KEY_ENV in done["error"]["message"], done["error"]
    assert done["attempts"] == 1, done  # final: a retry cannot set the variable
    assert emu.log("no-key") == []  # nothing went to the provider without its key


def test_submit_without_a_daemon_says_so_in_one_line(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "streamfence.toml"
    config.write_text(_daemon_table(tmp_path, endpoint=endpoint))
    proc, took = _run(tmp_path, "submit", "--config", str(config), "--provider", "x", "hi",
                      timeout=30)
    line = _one_line(proc, endpoint, "streamfence serve")
    assert took < 15, f"took {took:.1f} s: {line}"


def test_client_command_with_a_bad_endpoint_is_one_line(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "status", "--endpoint", "not-an-endpoint")
    _one_line(proc, "not-an-endpoint")


def test_keys_command_on_an_unusable_state_dir_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "streamfence.toml"
    config.write_text(_daemon_table(tmp_path, state_dir="/proc/streamfence-keys"))
    proc, _ = _run(tmp_path, "keys", "new", "alice", "--config", str(config))
    _one_line(proc, "daemon.state_dir", "system tree")

