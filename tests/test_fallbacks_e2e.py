"""Streaming fall-backs (docs/ARCHITECTURE.md §4.7) through the real daemon: Bedrock's IAM
denial of the streaming action, keep-alive-only streams, the non-streaming
probe after a 5xx, and the stream_options rejection."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess
from tests.wires import request_for

pytestmark = pytest.mark.slow


def _run(daemon: DaemonProcess, wire: str, key: str, **kw: Any) -> list[dict[str, Any]]:
    with daemon.client() as client:
        call_id = client.submit("emu", request_for(wire, key), **kw)
        return list(client.events(call_id, timeout_s=30.0))


def test_bedrock_iam_denial_falls_back_to_converse(make_daemon: Any,
                                                   emu: EmulatorClient) -> None:
    emu.script("denied", [{"fault": "access_denied"}])
    daemon = make_daemon(wire="bedrock")
    events = _run(daemon, "bedrock", "denied")
    done = events[-1]
    assert done["status"] == "completed", done
    sent = emu.log("denied")
    assert [r["path"].rsplit("/", 1)[-1] for r in sent] == ["converse-stream", "converse"]
    text = "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == "text")
    assert text == done["response"]["content"] == sent[1]["text"]


def test_keepalive_only_stream_switches_the_profile_to_non_streaming(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("pings", [{"fault": "keepalive_only", "stall_s": 0.3, "keepalive_every_s": 0.05}])
    daemon = make_daemon()
    done = _run(daemon, "openai", "pings")[-1]
    assert done["status"] == "completed", done
    sent = emu.log("pings")
    assert [r["stream"] for r in sent] == [True, False]
    assert done["response"]["content"] == sent[1]["text"]
    # Remembered for the profile: the next call does not stream at all.
    _run(daemon, "openai", "pings-next")
    assert [r["stream"] for r in emu.log("pings-next")] == [False]


def test_a_5xx_before_any_delta_triggers_one_probe_whose_4xx_wins(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("probe", [{"fault": "status", "status": 500, "message": "upstream error"},
                         {"fault": "status", "status": 404,
                          "message": "The model `emu-model` does not exist"}])
    daemon = make_daemon()
    done = _run(daemon, "openai", "probe")[-1]
    assert done["status"] == "failed", done
    assert "does not exist" in done["error"]["message"]
    assert [r["stream"] for r in emu.log("probe")] == [True, False]
    # One probe per window: another 5xx right after streams again.
    emu.script("probe-2", [{"fault": "status", "status": 503}])
    _run(daemon, "openai", "probe-2")
    assert [r["stream"] for r in emu.log("probe-2")] == [True, True]


def test_stream_options_rejection_retries_without_it_and_is_remembered(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("opts", [{"fault": "status", "status": 400,
                         "message": "Unrecognized request argument supplied: stream_options"}])
    daemon = make_daemon()
    done = _run(daemon, "openai", "opts")[-1]
    assert done["status"] == "completed", done
    assert done["attempts"] == 1  # the retry without it did not spend the budget
    sent = emu.log("opts")
    assert [r["has_stream_options"] for r in sent] == [True, False]
    _run(daemon, "openai", "opts-next")
    assert [r["has_stream_options"] for r in emu.log("opts-next")] == [False]
