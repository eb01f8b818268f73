"""The delivery rules on every wire (issue 3, acceptance 2): through the real
daemon, the real SDK of each provider parsing the emulator's bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess
from tests.wires import WIRES, DaemonFactory, request_for

pytestmark = pytest.mark.slow

# Events before the first text: Anthropic message_start + content_block_start,
# Bedrock messageStart (a text block has no contentBlockStart).
FRAMING = {"openai": 0, "anthropic": 2, "bedrock": 1}


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon({wire: wire for wire in WIRES}, daemon={"workers_spare": 3})


def _run(daemon: DaemonProcess, wire: str, key: str) -> list[dict[str, Any]]:
    with daemon.client() as client:
        call_id = client.submit(wire, request_for(wire, key))
        return list(client.events(call_id, timeout_s=30.0))


@pytest.mark.parametrize("wire", WIRES)
def test_tool_call_and_reasoning_assembled(daemon: DaemonProcess, emu: EmulatorClient,
                                           wire: str) -> None:
    args = {"query": "weather in Paris", "days": 3, "units": "metric"}
    emu.script(f"tool-{wire}", [{"fault": "ok", "reasoning": True, "chunks": 8,
                                 "tool_call": {"name": "search", "arguments": json.dumps(args)}}])
    events = _run(daemon, wire, f"tool-{wire}")
    done = events[-1]
    assert done["status"] == "completed", done
    fragments = [e for e in events if e["op"] == "delta" and e["kind"] == "tool_call"]
    assert len(fragments) > 2  # assembled across many deltas
    (call,) = done["response"]["tool_calls"]
    assert call["name"] == "search" and json.loads(call["arguments"]) == args
    assert done["response"]["finish_reason"] == "tool_calls"
    reasoning = "".join(e["data"] for e in events if e.get("kind") == "reasoning")
    assert reasoning and done["response"]["reasoning"] == reasoning


@pytest.mark.parametrize("wire", WIRES)
def test_drop_mid_tool_call_is_named_never_executed(daemon: DaemonProcess, emu: EmulatorClient,
                                                    wire: str) -> None:
    tool = {"name": "transfer_funds", "arguments": json.dumps({"amount": 100, "to": "x"})}
    emu.script(f"drop-{wire}", [{"fault": "no_finish", "text": "Sure.", "chunks": 2,
                                 "tool_call": tool}])
    done = _run(daemon, wire, f"drop-{wire}")[-1]
    assert done["status"] == "partial", done
    assert done["response"]["dropped_tool_names"] == ["transfer_funds"]
    assert done["response"]["tool_calls"] == []


@pytest.mark.parametrize("wire", WIRES)
def test_no_stop_reason_after_text_is_partial_length(daemon: DaemonProcess,
                                                     emu: EmulatorClient, wire: str) -> None:
    emu.script(f"nostop-{wire}", [{"fault": "no_finish"}])
    events = _run(daemon, wire, f"nostop-{wire}")
    done = events[-1]
    assert done["status"] == "partial", done
    assert done["response"]["finish_reason"] == "length"
    assert done["response"]["content"] == emu.log(f"nostop-{wire}")[0]["text"]
    assert len(emu.log(f"nostop-{wire}")) == 1  # text was delivered: never retried


@pytest.mark.parametrize("wire", WIRES)
def test_empty_stream_is_retried_then_a_clear_error(daemon: DaemonProcess,
                                                    emu: EmulatorClient, wire: str) -> None:
    emu.script(f"empty-{wire}", [{"fault": "empty"}] * 3)
    done = _run(daemon, wire, f"empty-{wire}")[-1]
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "retries_exhausted"
    assert "empty" in done["error"]["message"]
    assert len(emu.log(f"empty-{wire}")) == 3


@pytest.mark.parametrize("wire", WIRES)
def test_error_event_inside_the_stream_is_retried(daemon: DaemonProcess, emu: EmulatorClient,
                                                  wire: str) -> None:
    emu.script(f"inerr-{wire}", [{"fault": "error_event", "after": FRAMING[wire]}])
    done = _run(daemon, wire, f"inerr-{wire}")[-1]
    assert done["status"] == "completed", done
    sent = emu.log(f"inerr-{wire}")
    assert len(sent) == 2 and done["response"]["content"] == sent[1]["text"]


def test_all_wires_share_one_daemon(daemon: DaemonProcess) -> None:
    with daemon.client(timeout_s=5.0) as client:
        assert client.status()["op"] == "status_reply"
