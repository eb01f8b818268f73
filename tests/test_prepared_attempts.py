"""A worker prepares its attempt while the journal and the sink commit it,
and sends nothing before the supervisor's W_GO (workers/send_gate.py,
ARCHITECTURE §2.2): an attempt that is never authorized, or cancelled
before its go, costs no provider request and no worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol import failpoints
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for, request_for


@pytest.mark.parametrize("wire", ["openai", "anthropic", "bedrock"])
def test_an_attempt_cancelled_before_its_go_never_reaches_the_provider(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient, wire: str) -> None:
    """The sink stands still after storing the attempt's epoch: the worker holds
    the prepared attempt (its SDK request built), the client cancels, and the
    supervisor, on the sink's answer, drops the attempt instead of sending
    it. Red if the worker sent at once (no gate: httpx's request hook, or
    botocore's before-send): the emulator would have the request. The same
    worker then serves the next call."""
    held, after = f"held-{wire}", f"after-{wire}"
    emu.script(held, [{"fault": "ok", "chunks": 5}])
    emu.script(after, [{"fault": "ok", "chunks": 5}])
    points = tmp_path / "failpoints"
    points.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state", {"emu": profile_for(wire, emulator)},
        daemon={"workers_spare": 1},
        env={failpoints.ENV: "sink.after_authorize=pause(1500ms)@1",
             failpoints.DIR_ENV: str(points)})
    with daemon, daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for(wire, held))
        wait_until(lambda: "sink.after_authorize" in failpoints.hits(str(points)), 20.0,
                   "the sink to stand still after storing the attempt's epoch")
        client.cancel(call_id)
        result = client.result(call_id, wait_s=30.0)
        assert result is not None and result["status"] == "cancelled", result
        second = client.result(client.submit("emu", request_for(wire, after)), wait_s=30.0)
        status = client.status()
    assert emu.log(held) == [], "a dropped attempt reached the provider"
    assert second is not None and second["status"] == "completed", second
    assert len(emu.log(after)) == 1
    assert status["pool"]["killed_total"] == 0, status["pool"]
