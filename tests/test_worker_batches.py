"""The worker writes the deltas parsed from one provider read in one piece
(workers/worker.py `SinkOutput.reads`, docs/PERFORMANCE.md "Issue 32:
wake-ups"): through the real daemon against the emulator, a burst (many
deltas per read) reaches the subscriber whole and in seq order, and what the
provider sent before a silence reaches the subscriber during the silence,
not after it."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow

TEXT = "".join(f"word{i} " for i in range(600))


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def wire(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory, wire: str) -> DaemonProcess:
    return module_daemon({"emu": wire}, daemon={"workers_spare": 2})


def test_a_burst_written_in_batches_keeps_seq_order(daemon: DaemonProcess, wire: str,
                                                    emu: EmulatorClient) -> None:
    # chunk_delay_s 0: the emulator writes 64 KiB at a time, so one read holds
    # many chunks and the worker writes their deltas together.
    emu.script("burst", [{"fault": "ok", "chunks": 600, "text": TEXT}])
    with daemon.client() as client:
        call_id = client.submit("emu", request_for(wire, "burst"))
        events = list(client.events(call_id, timeout_s=30.0))
    assert events[-1]["op"] == "done" and events[-1]["status"] == "completed", events[-1]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    deltas = [e for e in events if e["op"] == "delta"]
    assert "".join(e["data"] for e in deltas if e["kind"] == "text") == TEXT
    assert len(deltas) >= 600


def test_what_came_before_a_silence_arrives_during_it(daemon: DaemonProcess, wire: str,
                                                      emu: EmulatorClient) -> None:
    # Four chunks, then the provider is silent for a minute: if the worker
    # held a delta until its next read, the subscriber would see it only
    # after the silence, and the events() below would time out first.
    emu.script("gap", [{"fault": "stall", "after": 4, "stall_s": 60.0, "chunks": 8,
                        "text": TEXT[:160]}])
    with daemon.client() as client:
        call_id = client.submit("emu", request_for(wire, "gap"))
        received = ""
        seen: list[dict[str, Any]] = []
        for event in client.events(call_id, timeout_s=20.0):
            seen.append(event)
            assert event["op"] == "delta", f"the call ended during the silence: {seen}"
            if event["kind"] == "text":
                received += event["data"]
            sent = emu.log("gap")[0]["sent_text"]
            if received and received == sent:
                break  # everything sent before the silence, received during it
        client.cancel(call_id)
    assert received and TEXT.startswith(received)
