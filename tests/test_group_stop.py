"""A stop signal sent to the daemon's whole process group (`kill -TERM
-PGID`; Ctrl-C in a terminal sends SIGINT to the group) is an orderly stop:
the children that die of it while the daemon drains are no failure, so
nothing is logged at ERROR (supervisor/restarts.py). The real daemon in a
process group of its own, with a call streaming when the signal comes."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from tests.harness import DaemonProcess, wait_until
from tests.wires import profiles_for, request_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_group_stop_logs_no_error(tmp_path: Path, emulator: EmulatorProcess,
                                    emu: EmulatorClient, signum: int) -> None:
    emu.script("long", [{"chunks": 40, "chunk_delay_s": 0.1}])
    daemon = DaemonProcess(tmp_path / "state", profiles_for(emulator, {"emu": "openai"}),
                           daemon={"stop_grace_s": 3.0}, new_session=True)
    try:
        daemon.start()
        with daemon.client() as client:
            call_id = client.submit("emu", request_for("openai", "long"), subscribe=False)

            def streaming() -> dict[str, Any] | None:
                return next((w for w in client.status()["workers"]
                             if w["call_id"] == call_id), None)

            wait_until(streaming, 10, "a worker streaming the call")
        assert daemon.proc is not None
        daemon.remember_descendants()
        os.killpg(daemon.proc.pid, signum)
        assert daemon.proc.wait(timeout=30) == 0
        records = list(daemon.log_records())
        assert any(r["message"] == "stopped" for r in records), records[-5:]
        alarming = [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
        assert not alarming, alarming
    finally:
        daemon.cleanup()
    assert not daemon.survivors, daemon.survivors
