"""SIGHUP never stops the daemon (issue 28, defect 3): the supervisor reads
its config again (supervisor/reload.py; tests/test_reload_e2e.py) and keeps
running, and no child (sink, zygote, workers, gateway) dies of it either,
as when a closing terminal sends SIGHUP to the whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from tests.harness import DaemonProcess, free_port, healthy, wait_until
from tests.wires import profile_for, request_for

pytestmark = pytest.mark.slow

RELOADED = "nothing to apply changed"  # the config file is the same


@pytest.fixture
def daemon(tmp_path: Path, emulator: EmulatorProcess) -> Iterator[tuple[DaemonProcess, str]]:
    port = free_port()
    proc = DaemonProcess(tmp_path / "state", {"emu": profile_for("openai", emulator)},
                         tables={"http": {"listen": f"127.0.0.1:{port}"}})
    url = f"http://127.0.0.1:{port}"
    try:
        proc.start()
        wait_until(lambda: healthy(url), 30.0, f"the gateway to answer {url}/healthz")
        yield proc, url
    finally:
        proc.cleanup()
    assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


def _reloads(daemon: DaemonProcess) -> list[dict[str, object]]:
    return [r for r in daemon.log_records()
            if r.get("level") == "INFO" and RELOADED in str(r.get("message", ""))]


def test_sighup_reloads_and_nothing_stops(daemon: tuple[DaemonProcess, str],
                                           emu: EmulatorClient) -> None:
    proc, url = daemon
    assert proc.proc is not None
    supervisor = proc.proc.pid
    with proc.client() as client:
        before = client.status()
    children = proc.remember_descendants()
    assert before["processes"]["gateway"] in children  # the gateway is there to be hit

    os.kill(supervisor, signal.SIGHUP)  # an operator who expects a reload
    wait_until(lambda: len(_reloads(proc)) >= 1, 10.0, "the supervisor's reload")
    # A closing terminal: every process of the daemon's group at once.
    for pid in {supervisor, *children}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
    wait_until(lambda: len(_reloads(proc)) >= 2, 10.0, "the second reload")

    emu.script("after-hup", [{"fault": "ok", "chunks": 5}])
    with proc.client() as client:
        done = client.run("emu", request_for("openai", "after-hup"), timeout_s=30.0)
        after = client.status()
    assert done["status"] == "completed"
    assert done["response"]["content"] == emu.log("after-hup")[0]["text"]
    assert healthy(url)
    assert proc.proc.poll() is None, "the supervisor stopped"
    gone = [pid for pid in children if not psutil.pid_exists(pid)
            or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE]
    assert not gone, f"processes died of SIGHUP: {gone}"
    assert after["processes"] == before["processes"]
    for name in ("sink_restarts", "zygote_restarts", "gateway_restarts"):
        assert after["counters"].get(name, 0) == 0, (name, after["counters"])
    assert len(_reloads(proc)) == 2  # one reload per SIGHUP the supervisor got


def test_a_restarted_child_ignores_sighup_too(daemon: tuple[DaemonProcess, str],
                                             emu: EmulatorClient) -> None:
    """A child the supervisor restarts after its loop runs is spawned with
    SIGHUP handled, not ignored, in the supervisor: it ignores it itself."""
    proc, url = daemon
    with proc.client() as client:
        before = client.status()["processes"]
        for name in ("sink", "gateway", "zygote"):
            os.kill(before[name], signal.SIGKILL)

        def restarted() -> dict[str, int] | None:
            now: dict[str, int] = client.status()["processes"]
            fresh = all(now.get(n) not in (None, before[n]) for n in ("sink", "gateway", "zygote"))
            return now if fresh else None

        after = wait_until(restarted, 30.0, "the sink, gateway and zygote to be restarted")
        wait_until(lambda: healthy(url), 30.0, "the restarted gateway to answer")
        wait_until(lambda: any(w["state"] == "idle" for w in client.status()["workers"]),
                   30.0, "an idle worker of the restarted zygote")
        children = proc.remember_descendants() & {p.pid for p in psutil.Process(
            after["supervisor"]).children(recursive=True)}
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)
        emu.script("after-restart-hup", [{"fault": "ok", "chunks": 5}])
        done = client.run("emu", request_for("openai", "after-restart-hup"), timeout_s=30.0)
        assert done["status"] == "completed"
        assert client.status()["processes"] == after
    gone = [pid for pid in children if not psutil.pid_exists(pid)
            or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE]
    assert not gone, f"restarted processes died of SIGHUP: {gone}"
    assert healthy(url)
