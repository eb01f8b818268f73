"""SIGHUP reloads the config file (supervisor/reload.py; README "Reload"),
on the real daemon, while calls stream on the three wires: the running
calls end exactly as if nothing happened (one provider request each), a
profile added serves, one removed refuses new submits while its running
call finishes, a new identity limit applies to the next submit; an invalid
file changes nothing and says why; a setting that needs a restart keeps
its value and says so. `streamfence reload` and `streamfence stop` do the
same from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol.client import Client, ClientError
from streamfence.protocol.keys import KeyStore
from tests.harness import DaemonProcess, assert_one_exact_answer, wait_until
from tests.wires import WIRES, profile_for, profiles_for, request_for

pytestmark = pytest.mark.slow

SLOW = {"fault": "ok", "chunks": 40, "chunk_delay_s": 0.1}  # ~4 s of streaming


def _config(proc: DaemonProcess, providers: dict[str, dict[str, Any]], tail: str = "",
            daemon: dict[str, Any] | None = None) -> None:
    """Rewrite the daemon's config file: its [daemon] table (with `daemon`'s
    changes), these profiles, then `tail` (an edit, as an operator makes it)."""
    changes = daemon or {}
    head = proc.config_path.read_text().split("\n[providers.", 1)[0].splitlines()
    lines = [line for line in head if line.split(" = ")[0] not in changes]
    lines += [f"{k} = {json.dumps(v)}" for k, v in changes.items()]
    for name, table in providers.items():
        lines.append(f"[providers.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    proc.config_path.write_text("\n".join(lines) + "\n" + tail)


def _lines(proc: DaemonProcess, level: str, text: str) -> list[str]:
    return [str(r["message"]) for r in proc.log_records()
            if r.get("level") == level and text in str(r.get("message", ""))]


def _reloaded(proc: DaemonProcess) -> list[str]:
    """Wait for a reload's INFO lines (what changed, or that nothing did)."""
    return wait_until(lambda: _lines(proc, "INFO", "reload: "), 15.0,
                      "the reload's lines in the daemon's log")


@pytest.fixture
def daemon(tmp_path: Path, emulator: EmulatorProcess) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "state", profiles_for(emulator, {w: w for w in WIRES}))
    try:
        yield proc.start()
    finally:
        proc.cleanup()
    assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


class Follower(threading.Thread):
    """One call submitted and followed to its end on its own client."""

    def __init__(self, proc: DaemonProcess, wire: str, key: str) -> None:
        super().__init__(daemon=True)
        self.events: list[dict[str, Any]] = []
        self._client = proc.client(timeout_s=30.0)
        self.call_id = self._client.submit(wire, request_for(wire, key))

    def run(self) -> None:
        with self._client:
            self.events.extend(self._client.events(self.call_id, timeout_s=30.0))

    def streaming(self) -> bool:
        events = list(self.events)
        return any(e["op"] == "delta" for e in events) and events[-1]["op"] != "done"


def _refused(client: Client, provider: str, request: dict[str, Any]) -> ClientError:
    with pytest.raises(ClientError) as info:
        client.submit(provider, request, subscribe=False)
    return info.value


def test_sighup_while_calls_stream(daemon: DaemonProcess, emulator: EmulatorProcess,
                                   emu: EmulatorClient) -> None:
    assert daemon.proc is not None
    capped = KeyStore(daemon.state_dir / "keys").register("capped", daemon.endpoint)
    profiles = profiles_for(emulator, {w: w for w in WIRES})
    for wire in WIRES:
        emu.script(f"hup-{wire}", [SLOW])
    followers = [Follower(daemon, wire, f"hup-{wire}") for wire in WIRES]
    for follower in followers:
        follower.start()
    with daemon.client() as admin:
        exc = _refused(admin, "late", request_for("openai", "late-before"))
        assert exc.code == "unknown_provider", exc
    wait_until(lambda: all(f.streaming() for f in followers), 20.0,
               "a delta of each of the three calls")

    # The edit: a profile added, one changed, one removed (its call streams
    # on), a limit for an identity; then SIGHUP, as `kill -HUP` sends it.
    del profiles["bedrock"]
    profiles["openai"]["read_timeout_s"] = 90.0
    profiles["late"] = profile_for("anthropic", emulator)
    _config(daemon, profiles, "[identities.capped]\nmax_in_flight = 1\n")
    os.kill(daemon.proc.pid, signal.SIGHUP)
    lines = _reloaded(daemon)
    assert all(f.streaming() for f in followers), "a call ended before the reload: too fast"
    assert ("reload: providers: added late; changed openai (read_timeout_s); removed bedrock"
            in lines), lines
    assert "reload: identities: added capped" in lines, lines

    for follower in followers:
        follower.join(timeout=30.0)
        assert not follower.is_alive(), "a call did not end"
    for wire, follower in zip(WIRES, followers, strict=True):
        assert_one_exact_answer(follower.events, emu.log(f"hup-{wire}"))

    emu.script("late-after", [{"fault": "ok", "chunks": 3}])
    emu.script("capped-slow", [{"fault": "stall", "after": 1, "stall_s": 60.0}])
    with daemon.client() as admin:
        done = admin.run("late", request_for("anthropic", "late-after"), timeout_s=30.0)
        assert done["status"] == "completed", done
        assert done["response"]["content"] == emu.log("late-after")[0]["text"]
        exc = _refused(admin, "bedrock", request_for("bedrock", "removed"))
        assert exc.code == "unknown_provider" and "bedrock" in exc.message, exc
    with Client(credentials=capped, timeout_s=10.0) as client:
        first = client.submit("openai", request_for("openai", "capped-slow"),
                              options={"stale_timeout_s": 120.0}, subscribe=False)
        exc = _refused(client, "openai", request_for("openai", "capped-second"))
        assert exc.code == "too_many_calls" and "max_in_flight 1" in exc.message, exc
        client.cancel(first)
        cancelled = client.result(first, wait_s=20.0)
        assert cancelled is not None and cancelled["status"] == "cancelled", cancelled
    assert emu.log("removed") == [] and emu.log("capped-second") == []
    assert not _lines(daemon, "ERROR", "")


def test_an_invalid_edit_keeps_the_running_config(daemon: DaemonProcess,
                                                  emulator: EmulatorProcess,
                                                  emu: EmulatorClient) -> None:
    assert daemon.proc is not None
    good = daemon.config_path.read_text()
    profiles = profiles_for(emulator, {w: w for w in WIRES})
    profiles["late"] = dict(profile_for("openai", emulator), kind="openia")
    _config(daemon, profiles, "[identities.x]\nmax_in_flight = -1\n")
    os.kill(daemon.proc.pid, signal.SIGHUP)
    def both() -> list[str] | None:
        lines = _lines(daemon, "ERROR", "reload refused")
        return lines if len(lines) >= 2 else None
    errors = wait_until(both, 15.0, "both problems of the file")
    assert any("providers.late.kind" in e and "did you mean 'openai'" in e for e in errors), errors
    assert any("identities.x.max_in_flight" in e for e in errors), errors
    with daemon.client() as admin:  # the old config: no `late`, bedrock still there
        assert _refused(admin, "late", request_for("openai", "nope")).code == "unknown_provider"
        emu.script("still-bedrock", [{"fault": "ok", "chunks": 3}])
        done = admin.run("bedrock", request_for("bedrock", "still-bedrock"), timeout_s=30.0)
        assert done["status"] == "completed", done

    # A setting that needs a restart: named in one WARNING, its value kept.
    daemon.config_path.write_text(good.replace("workers_spare = 2", "workers_spare = 3"))
    os.kill(daemon.proc.pid, signal.SIGHUP)
    warning = wait_until(lambda: _lines(daemon, "WARNING", "needs a restart"), 10.0,
                         "the needs-a-restart warning")
    assert warning == ["reload: workers_spare changed: needs a restart (the running value "
                       "stays)"], warning
    with daemon.client() as admin:
        assert admin.status()["pool"]["spare"] == 2


def _cli(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamfence.cli", *args,
                           "--config", str(daemon.config_path)],
                          capture_output=True, text=True, timeout=60)


def test_reload_and_stop_from_the_command_line(daemon: DaemonProcess,
                                               emulator: EmulatorProcess) -> None:
    assert daemon.proc is not None
    _config(daemon, profiles_for(emulator, {w: w for w in WIRES}), daemon={"log_level": "DEBUG"})
    reloaded = _cli(daemon, "reload")
    assert reloaded.returncode == 0, reloaded.stderr
    assert f"pid {daemon.proc.pid}" in reloaded.stdout, reloaded.stdout
    lines = _reloaded(daemon)
    assert "reload: log level INFO -> DEBUG" in lines, lines

    stopped = _cli(daemon, "stop", "--timeout", "30")
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped (pid {daemon.proc.pid})" in stopped.stderr, stopped.stderr
    assert daemon.proc.wait(timeout=10) == 0
    again = _cli(daemon, "stop")
    assert again.returncode == 1 and "no streamfence daemon is running on" in again.stderr, \
        again.stderr
    assert _cli(daemon, "reload").returncode == 1
