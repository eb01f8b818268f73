"""The sink dies mid-stream: the supervisor restarts it on the same store and
the attempt in flight goes on under a new epoch (docs/ARCHITECTURE.md §2.8):
the call completes with the provider's whole answer from its one request,
with no reset and no `partial`, and the transcript holds every event a
subscriber saw, once."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol import failpoints
from tests.harness import DaemonProcess, assert_one_exact_answer, process_state, wait_until
from tests.wires import profile_for, request_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["restart", "continue"])
def test_sink_kill_9_mid_stream(make_daemon: Any, emu: EmulatorClient, policy: str) -> None:
    emu.script("sinkdeath", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon()
    # The client probes a silent call only after 20 s: the rest of the stream must
    # come before that (the supervisor subscribes the listener at the new sink, and
    # the client subscribes again from its last seq once its events connection is
    # made again), within the 10 s allowed below.
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "sinkdeath"),
                                options={"on_partial": policy})
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
        after = client.run("emu", request_for("openai", "after-sink"), timeout_s=30.0)
    # Under either policy: the stream went on, one provider request, one answer.
    assert_one_exact_answer(events, emu.log("sinkdeath"))
    assert events[-1]["attempts"] == 1
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
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for("openai", "frozen-sink"),
                                options={"stale_timeout_s": 1.0})
        events = client.events(call_id, timeout_s=30.0)
        first = [next(events) for _ in range(3)]
        sink_pid = client.status()["processes"]["sink"]
        os.kill(sink_pid, signal.SIGSTOP)
        try:
            # The watchdog's look at the attempt a stale timeout after its last
            # chunk, with the sink stopped all along: the provider was not blamed.
            wait_until(lambda: any(r.get("call_id") == call_id and "waiting for the sink" in
                                   r.get("message", "") for r in daemon.log_records()),
                       20.0, "the watchdog to see the attempt waiting for the sink")
            assert process_state(sink_pid) == "T", "the sink was not stopped all along"
        finally:
            os.kill(sink_pid, signal.SIGCONT)
        rest = list(events)
        result = client.result(call_id, wait_s=10.0)
    assert_one_exact_answer([*first, *rest], emu.log("frozen-sink"))
    assert result is not None and [d["how"] for d in result["diagnostics"]] == ["ended"]


CALLS = 10


@pytest.mark.parametrize("second_fault", [
    # The restarted sink dies right after it stored its first rebind's new
    # epoch, before its worker or the supervisor heard of it.
    "sink.after_rebind=crash",
    # A worker stands still right after its T_REBIND (its number moved on,
    # its held deltas not yet sent): the sink is killed meanwhile.
    "worker.after_rebind=pause(1500ms)",
])
def test_a_second_sink_death_during_the_rebinds_costs_no_request(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        second_fault: str) -> None:
    """Issue 28, defect 1: the sink is killed with 10 calls streaming, and
    dies again while the attempts are being rebound at its successor. Every
    call still completes with exactly the provider's text from its one
    request: a sink restart costs no answer and no provider request
    (ARCHITECTURE §2 invariant 8), however many come one on another."""
    keys = [f"twodeaths{i}" for i in range(CALLS)]
    for key in keys:
        emu.script(key, [{"fault": "ok", "chunks": 60, "chunk_delay_s": 0.05}])
    points = tmp_path / "failpoints"
    points.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state", {"emu": dict(profile_for("openai", emulator), stale_timeout_s=30.0)},
        env={failpoints.ENV: second_fault, failpoints.DIR_ENV: str(points)})
    point = second_fault.split("=")[0]
    with daemon, daemon.client(timeout_s=20.0) as client:
        call_ids = [client.submit("emu", request_for("openai", key)) for key in keys]
        wait_until(lambda: all(emu.log(key) for key in keys), 20.0, "every call streaming")
        first = client.status()["processes"]["sink"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: point in failpoints.hits(str(points)), 20.0, f"{point} reached")
        if point.startswith("worker."):  # the worker stands still: kill the sink now
            second = client.status()["processes"]["sink"]
            assert second not in (None, first)
            os.kill(second, signal.SIGKILL)
        results = [client.result(call_id, wait_s=30.0) for call_id in call_ids]
        status = client.status()
    assert status["counters"]["sink_restarts"] == 2
    requests = {key: len(emu.log(key)) for key in keys}
    how = {key: [d["how"] for d in r["diagnostics"]] if r else None
           for key, r in zip(keys, results, strict=True)}
    assert requests == dict.fromkeys(keys, 1), how
    for key, result in zip(keys, results, strict=True):
        assert result is not None and result["status"] == "completed", result
        assert result["response"]["content"] == emu.log(key)[0]["text"], key
        assert result["attempts"] == 1, result
    # The last sink was sent nothing under a superseded number: each worker's
    # first message to it was its hello (T_HELLO first on a new connection).
    assert status["sink"]["dropped"] == 0, status["sink"]["dropped_by_verdict"]


def test_a_sink_death_before_the_worker_connects_costs_no_request(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient) -> None:
    """The 200-schedule run's window (GUARANTEES, "Faults between steps"):
    the sink authorized an attempt and dies while the supervisor stands
    still before W_RUN. The worker's first connection then reaches the
    restarted sink, which was told to rebind the attempt under the next
    number: the worker must learn that number before it writes (a hello
    first on every attempt, §2.8), or its deltas and final are refused as
    stale and the call costs a second provider request."""
    emu.script("early-death", [{"fault": "ok", "chunks": 20, "chunk_delay_s": 0.05}])
    points = tmp_path / "failpoints"
    points.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state", {"emu": dict(profile_for("openai", emulator), stale_timeout_s=30.0)},
        env={failpoints.ENV: "supervisor.before_dispatch=pause(1500ms)",
             failpoints.DIR_ENV: str(points)})
    with daemon, daemon.client(timeout_s=20.0) as client:
        sink_pid = client.status()["processes"]["sink"]
        call_id = client.submit("emu", request_for("openai", "early-death"))
        wait_until(lambda: "supervisor.before_dispatch" in failpoints.hits(str(points)), 20.0,
                   "the supervisor to stand still before W_RUN")
        os.kill(sink_pid, signal.SIGKILL)
        result = client.result(call_id, wait_s=30.0)
        status = client.status()
    assert status["counters"]["sink_restarts"] == 1
    assert result is not None and result["status"] == "completed", result
    assert len(emu.log("early-death")) == 1, [d["how"] for d in result["diagnostics"]]
    assert result["response"]["content"] == emu.log("early-death")[0]["text"]
    assert result["attempts"] == 1, result["diagnostics"]
    assert status["sink"]["dropped"] == 0, status["sink"]["dropped_by_verdict"]
