"""The sink dies mid-stream: the supervisor restarts it on the same store and
the attempt in flight goes on under a new epoch (docs/ARCHITECTURE.md §2.8):
the call completes with the provider's whole answer from its one request,
with no reset and no `partial`, and the transcript holds every event a
subscriber saw, once."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess

pytestmark = pytest.mark.slow


def _req(key: str) -> dict[str, Any]:
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": key}]}


@pytest.mark.parametrize("policy", ["restart", "continue"])
def test_sink_kill_9_mid_stream(make_daemon: Any, emu: EmulatorClient, policy: str) -> None:
    emu.script("sinkdeath", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon()
    # The client probes a silent call only after 20 s: the rest of the stream must
    # come before that (the supervisor subscribes the listener at the new sink, and
    # the client subscribes again from its last seq once its events connection is
    # made again), within the 10 s allowed below.
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", _req("sinkdeath"), options={"on_partial": policy})
        events: list[dict[str, Any]] = []
        for event in client.events(call_id, timeout_s=20.0):
            events.append(event)
            if len(events) == 5:
                break
        sink_pid = client.status()["processes"]["sink"]
        os.kill(sink_pid, signal.SIGKILL)
        events += list(client.events(call_id, timeout_s=10.0))
        status = client.status()
        assert status["counters"]["sink_restarts"] == 1
        assert status["processes"]["sink"] != sink_pid
        after = client.run("emu", _req("after-sink"), timeout_s=30.0)
    done = events[-1]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    sent = emu.log("sinkdeath")
    # Under either policy: the stream went on, one provider request, one answer.
    assert done["status"] == "completed", done
    assert len(sent) == 1, f"the provider was asked {len(sent)} times"
    assert done["response"]["content"] == sent[0]["text"]
    assert not any(e["op"] == "reset" for e in events)
    text = "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == "text")
    assert text == sent[0]["text"]
    assert done["attempts"] == 1
    assert status["counters"]["attempts_rebound"] == 1
    assert after["status"] == "completed"
    # The transcript holds exactly what the subscriber saw.
    with daemon.client() as client:
        client.subscribe(call_id, from_seq=0)
        replay = list(client.events(call_id, timeout_s=10.0))
    assert replay == events


def test_a_frozen_sink_is_not_the_providers_stall(make_daemon: Any, emu: EmulatorClient) -> None:
    """The sink is stopped (SIGSTOP) past the stale timeout while the provider
    sends the rest of the answer: the worker waits for the sink, the watchdog
    does not blame the provider, and once the sink runs again the call
    completes from its one provider request (issue 13, item 5)."""
    emu.script("frozen-sink", [{"fault": "ok", "chunks": 20, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon()
    stale_s = 1.0
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", _req("frozen-sink"), options={"stale_timeout_s": stale_s})
        events = client.events(call_id, timeout_s=30.0)
        first = [next(events) for _ in range(3)]
        sink_pid = client.status()["processes"]["sink"]
        os.kill(sink_pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20.0
            while not emu.log("frozen-sink")[0]["completed"]:
                assert time.monotonic() < deadline, "the provider did not finish within 20 s"
                time.sleep(0.05)
            # The fault itself: frozen for three stale timeouts after the last chunk.
            time.sleep(3 * stale_s)
            assert _state(sink_pid) == "T", "the sink was not stopped all along"
        finally:
            os.kill(sink_pid, signal.SIGCONT)
        rest = list(events)
        result = client.result(call_id, wait_s=10.0)
    done = rest[-1]
    sent = emu.log("frozen-sink")
    assert done["status"] == "completed", done
    assert len(sent) == 1 and done["response"]["content"] == sent[0]["text"]
    seqs = [e["seq"] for e in [*first, *rest]]
    assert seqs == list(range(1, len(seqs) + 1))
    assert result is not None and [d["how"] for d in result["diagnostics"]] == ["ended"]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

