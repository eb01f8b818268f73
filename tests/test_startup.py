"""Issue 32, "ready in under 2 s" (docs/PERFORMANCE.md, "Issue 32: start-up"),
on the real daemon and real processes, no timing asserted (scripts/bench
startup.py measures it):

- a process imports a provider SDK only for a profile of its kind: the
  supervisor, the sink, the command line's `status` and `keys` none; the
  zygote of a daemon with one openai profile only openai (its "zygote ready"
  line names the SDKs its process has loaded);
- a profile of a kind added by a reload (SIGHUP) still serves: its worker
  imports the SDK on the first attempt of that kind; a zygote started after
  the reload warms it;
- READY=1 reaches the service manager when a call can run: a call sent the
  moment it arrives runs to its end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for, request_for

SDKS = ("openai", "anthropic", "botocore", "boto3", "aiohttp")
_REPORT = (f"import atexit, sys; atexit.register(lambda: print(sorted(m for m in {SDKS!r} "
           "if m in sys.modules), file=sys.stderr)); ")


def _sdks_after(code: str, *, cwd: Path | None = None) -> list[str]:
    """The SDKs a fresh interpreter has imported once `code` ran (its last
    stderr line, printed at exit)."""
    done = subprocess.run([sys.executable, "-c", _REPORT + code], capture_output=True,
                          text=True, timeout=60, cwd=cwd)
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1].replace("'", '"'))
    return loaded


@pytest.mark.parametrize("module", ["streamfence", "streamfence.supervisor.daemon",
                                    "streamfence.sink.process", "streamfence.workers.zygote",
                                    "streamfence.workers.worker", "streamfence.cli"])
def test_no_role_imports_a_provider_sdk_at_its_top(module: str) -> None:
    assert _sdks_after(f"import {module}") == []


@pytest.mark.parametrize("argv", [["status", "--endpoint", "ipc:///nonexistent/sf", "--json"],
                                  ["keys", "list", "--config", "streamfence.toml"]])
def test_the_command_line_status_and_keys_import_no_sdk(argv: list[str],
                                                        tmp_path: Path) -> None:
    (tmp_path / "streamfence.toml").write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n')
    code = f"sys.argv = ['streamfence', *{argv!r}]; from streamfence.cli import main; main()"
    assert _sdks_after(code, cwd=tmp_path) == []


def _zygote_lines(proc: DaemonProcess) -> list[str]:
    return [str(r["message"]) for r in proc.log_records()
            if str(r.get("message", "")).startswith("zygote ready in")]


def _zygote_sdks(proc: DaemonProcess) -> list[str]:
    """The SDKs the zygote's "ready" line says its process loaded (the last line)."""
    lines = _zygote_lines(proc)
    assert lines, "no zygote ready line in the log"
    return lines[-1].rsplit("SDKs loaded: ", 1)[1].rstrip(")").split(", ")


@pytest.mark.slow
def test_one_openai_profile_warms_openai_only_and_a_reload_adds_a_kind(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient) -> None:
    proc = DaemonProcess(tmp_path / "state", {"oa": profile_for("openai", emulator)})
    try:
        proc.start()
        assert _zygote_sdks(proc) == ["openai"]
        with proc.client() as client:
            done = client.run("oa", request_for("openai", "one-wire"), timeout_s=30.0)
        assert done["status"] == "completed", done
        # A reload adds a profile of each other kind: each serves, from a
        # worker of the same zygote (it imports the SDK on that first attempt).
        with proc.config_path.open("a") as config:
            for wire in ("anthropic", "bedrock"):
                config.write(f"[providers.{wire}]\n" + "".join(
                    f"{k} = {json.dumps(v)}\n" for k, v in profile_for(wire, emulator).items()))
        assert proc.proc is not None
        os.kill(proc.proc.pid, signal.SIGHUP)
        wait_until(lambda: any("reload: " in str(r.get("message", ""))
                               for r in proc.log_records()), 15.0, "the reload's lines")
        with proc.client() as client:
            zygote = client.status()["processes"]["zygote"]
            for wire in ("anthropic", "bedrock"):
                emu.script(f"added-{wire}", [{"fault": "ok", "chunks": 3}])
                done = client.run(wire, request_for(wire, f"added-{wire}"), timeout_s=30.0)
                assert done["status"] == "completed", (wire, done)
                assert done["response"]["content"] == emu.log(f"added-{wire}")[0]["text"]
            after = client.status()
        assert after["processes"]["zygote"] == zygote  # no restart was needed
        assert after["counters"].get("zygote_restarts", 0) == 0
        # A zygote started after the reload (here, after a kill) warms every kind.
        os.kill(zygote, signal.SIGKILL)
        wait_until(lambda: len(_zygote_lines(proc)) == 2, 60.0, "a second zygote's ready line")
        assert _zygote_sdks(proc) == ["openai", "anthropic", "botocore"]
    finally:
        proc.cleanup()
    assert not proc.survivors, proc.survivors


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A service manager's end: an AF_UNIX datagram socket at a short path."""
    folder = tempfile.mkdtemp(prefix="sfn")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(f"{folder}/notify")
    yield f"{folder}/notify", sock
    sock.close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_ready_comes_when_a_call_can_run(tmp_path: Path, emulator: EmulatorProcess,
                                         emu: EmulatorClient,
                                         notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    proc = DaemonProcess(tmp_path / "state", {"oa": profile_for("openai", emulator)},
                         env={"NOTIFY_SOCKET": path})
    failed: list[BaseException] = []

    def start() -> None:
        try:
            proc.start()
        except BaseException as exc:  # the test fails on it below
            failed.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    try:
        sock.settimeout(60.0)
        try:
            ready = sock.recv(4096).decode().split("\n")
        except TimeoutError:
            pytest.fail("no READY=1 within 60 s")
        assert ready[0] == "READY=1", ready
        # At once: a status that shows a worker and the sink, and a call that runs.
        emu.script("at-ready", [{"fault": "ok", "chunks": 3}])
        with proc.client(timeout_s=10.0) as client:
            status: dict[str, Any] = client.status()
            done = client.run("oa", request_for("openai", "at-ready"), timeout_s=30.0)
        assert any(w["state"] in ("idle", "reserved", "busy") for w in status["workers"])
        assert status["processes"]["sink"] is not None, status["processes"]
        assert done["status"] == "completed", done
        readies = [r for r in proc.log_records() if str(r.get("message")).startswith("ready:")]
        assert len(readies) == 1, readies
        starter.join(timeout=60.0)
        assert not failed, failed
    finally:
        starter.join(timeout=60.0)
        proc.cleanup()
    assert not proc.survivors, proc.survivors
