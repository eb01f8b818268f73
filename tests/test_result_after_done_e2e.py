"""Read your writes: a client that has seen a call's done and asks for its
result gets that done, never `pending`. The sink sends the done to the
call's subscribers before the supervisor hears that it is stored; the
supervisor answers a finishing call's `result` from the transcript, where
the done is before anyone can see it (docs/PROTOCOL.md, "result")."""

from __future__ import annotations

from pathlib import Path

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol import failpoints
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for, request_for


def test_a_result_asked_after_the_done_is_that_done(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient) -> None:
    """The sink stands still between sending the done and answering the
    supervisor's finish (`sink.after_done_sent`): the call is still live at
    the supervisor when the client, holding the done, asks. Red before the
    fix: `pending` (two CI runs of test_reply_budget_e2e met it)."""
    emu.script("seen", [{"fault": "ok", "chunks": 3}])
    points = tmp_path / "failpoints"
    points.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state", {"emu": profile_for("openai", emulator)},
        env={failpoints.ENV: "sink.after_done_sent=pause(5s)@1",
             failpoints.DIR_ENV: str(points)})
    with daemon, daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "seen"))
        done = list(client.events(call_id, timeout_s=20.0))[-1]
        # The sink records its pass just after the send: the done may come first.
        wait_until(lambda: "sink.after_done_sent" in failpoints.hits(str(points)), 10.0,
                   "the sink to stand still after sending the done")
        result = client.result(call_id)
        live = client.status()["calls"]["active"]  # built before it waits (1 s) for the sink
    assert done["op"] == "done" and done["status"] == "completed", done
    assert result is not None, "a client that saw the done was told the call is pending"
    assert (result["seq"], result["response"]) == (done["seq"], done["response"])
    assert live, "the pause was over before the result was asked: the test proves nothing"
