"""Running under systemd: the shipped unit (contrib/systemd/streamfence.service)
parses and agrees with the daemon, and the real daemon notifies READY=1 once
it serves and STOPPING=1 at SIGTERM over $NOTIFY_SOCKET."""

from __future__ import annotations

import configparser
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.config.model import DaemonConfig
from streamfence.devtools.emulator.control import EmulatorProcess
from tests.harness import DaemonProcess
from tests.wires import profile_for

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "contrib" / "systemd" / "streamfence.service"
INSTALLED_AT = "/opt/streamfence/bin/streamfence"  # the unit's ExecStart, as shipped
SHUTDOWN_S = 6.0  # after the drain, the daemon waits this long at most for its children


def _service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def _seconds(value: str) -> float:
    assert value.endswith("s") and value[:-1].isdigit(), f"write it as N s: {value!r}"
    return float(value[:-1])


def test_the_unit_file_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` on the unit, its ExecStart pointed at this
    checkout's `streamfence`: no error and no warning."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed: apt-get install systemd (.ci/run does)")
    here = Path(sys.executable).parent / "streamfence"
    assert here.exists(), f"{here}: the console script of pip install -e ."
    text = UNIT.read_text()
    assert f"ExecStart={INSTALLED_AT} serve " in text
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(INSTALLED_AT, str(here)))
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), \
        proc.stdout + proc.stderr


def test_the_unit_agrees_with_the_daemon() -> None:
    service = _service()
    assert service["Type"] == "notify"
    assert service["ExecStart"].endswith(" serve --config /etc/streamfence/streamfence.toml")
    assert service["Restart"] == "on-failure" and _seconds(service["RestartSec"]) > 0
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"  # SIGHUP: supervisor/reload.py
    # The state dir must be private, or the daemon refuses it (supervisor/statedir.py).
    assert service["StateDirectory"] == "streamfence"
    assert service["StateDirectoryMode"] == "0700"
    assert service["User"] == "streamfence"
    # SIGTERM to the supervisor alone, and time for its drain and its children.
    assert service["KillMode"] == "mixed"
    assert service["KillSignal"] == "SIGTERM"
    grace = DaemonConfig().stop_grace_s
    assert _seconds(service["TimeoutStopSec"]) > grace + SHUTDOWN_S
    for hardening in ("NoNewPrivileges", "PrivateTmp"):
        assert service[hardening] == "yes"
    assert service["ProtectSystem"] == "strict"


# ---- the readiness notification, on the real daemon ---------------------------------


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A service manager's end: an AF_UNIX datagram socket at a short path."""
    folder = tempfile.mkdtemp(prefix="sfn")
    path = f"{folder}/notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield path, sock
    sock.close()
    shutil.rmtree(folder, ignore_errors=True)


def _notification(sock: socket.socket, timeout_s: float, what: str) -> dict[str, str]:
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(4096).decode()
    except TimeoutError:
        pytest.fail(f"no notification within {timeout_s:.0f} s: expected {what}")
    return dict(line.split("=", 1) for line in data.split("\n"))


@pytest.mark.slow
def test_ready_once_serving_and_stopping_at_sigterm(
        tmp_path: Path, emulator: EmulatorProcess,
        notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    emu = dict(profile_for("openai", emulator), stale_timeout_s=30.0)
    daemon = DaemonProcess(tmp_path / "state", {"emu": emu}, env={"NOTIFY_SOCKET": path})
    failed: list[BaseException] = []

    def start() -> None:
        try:
            daemon.start()
        except BaseException as exc:  # the test fails on it below
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    try:
        ready = _notification(sock, 60.0, "READY=1")
        assert ready["READY"] == "1", ready
        assert ready["STATUS"] == f"serving on {daemon.endpoint}"
        # When it said so, it was serving: it answers, with a warm worker.
        with daemon.client(timeout_s=5.0) as client:
            status: dict[str, Any] = client.status()
        assert any(w["state"] == "idle" for w in status["workers"]), status["workers"]
        starter.join(timeout=60.0)
        assert not failed, failed
        assert daemon.stop() == 0, daemon.log_text()[-3000:]  # SIGTERM
        stopping = _notification(sock, 5.0, "STOPPING=1")
        assert stopping["STOPPING"] == "1", stopping
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)  # READY and STOPPING once each
    finally:
        starter.join(timeout=60.0)
        daemon.cleanup()
    assert not daemon.survivors, daemon.survivors
