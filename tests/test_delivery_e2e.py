"""Delivery semantics (docs/ARCHITECTURE.md, "Behaviour rules"), each rule
driven through the real daemon against the emulator: partial output, retries
that deliver nothing twice, notices, restart policy, breaker, cancel,
idempotency, deadline, reconnect with from_seq, and per-attempt diagnostics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import Client, ClientError
from tests.harness import DaemonProcess, wait_until
from tests.wires import DaemonFactory, request_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(module_daemon: DaemonFactory) -> DaemonProcess:
    return module_daemon(daemon={"workers_spare": 3, "breaker_cooldown_s": 600.0})


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


def run(client: Client, key: str, **kw: Any) -> list[dict[str, Any]]:
    call_id = client.submit("emu", request_for("openai", key), **kw)
    events = list(client.events(call_id, timeout_s=30.0))
    assert events and events[-1]["op"] == "done", events
    return events


def texts(events: list[dict[str, Any]], kind: str = "text") -> str:
    return "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == kind)


def test_visible_text_then_failure_ends_partial_without_retry(client: Client,
                                                              emu: EmulatorClient) -> None:
    emu.script("partial", [{"fault": "disconnect", "after": 4}])
    events = run(client, "partial")
    done = events[-1]
    assert done["status"] == "partial", done
    assert done["attempts"] == 1
    assert done["response"]["finish_reason"] == "length"
    assert done["response"]["partial"] is True
    sent = emu.log("partial")
    assert len(sent) == 1  # no retry: it would duplicate text
    assert done["response"]["content"] == texts(events)
    assert sent[0]["sent_text"].startswith(done["response"]["content"])
    assert done["response"]["content"]


def test_no_visible_text_counts_as_nothing_delivered(client: Client, emu: EmulatorClient) -> None:
    emu.script("reasoning-only", [{"fault": "disconnect", "after": 3, "reasoning": True}])
    events = run(client, "reasoning-only")
    done = events[-1]
    assert done["status"] == "completed", done
    assert done["attempts"] == 2
    sent = emu.log("reasoning-only")
    assert done["response"]["content"] == sent[1]["text"]
    assert any(e["op"] == "delta" and e["kind"] == "reasoning" and e["attempt"] == 1
               for e in events)


def test_tool_call_in_flight_is_retried_with_a_notice(client: Client, emu: EmulatorClient) -> None:
    args = json.dumps({"city": "Paris", "units": "metric", "days": 5})
    tool = {"name": "get_weather", "arguments": args}
    emu.script("tool-drop", [{"fault": "disconnect", "after": 4, "tool_call": tool},
                             {"fault": "ok", "tool_call": tool}])
    events = run(client, "tool-drop")
    done = events[-1]
    assert done["status"] == "completed", done
    notices = [e for e in events if e["op"] == "delta" and e["kind"] == "notice"]
    # Attempt 1 says its tool call was dropped; attempt 2 opens with the retry notice.
    assert [n["attempt"] for n in notices] == [1, 2], notices
    assert "get_weather" in notices[0]["data"]
    assert "tool call" in notices[1]["data"] and "retried" in notices[1]["data"]
    calls = done["response"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(args)
    assert done["response"]["finish_reason"] == "tool_calls"


def test_dropped_tool_calls_are_named_and_noticed(client: Client, emu: EmulatorClient) -> None:
    tool = {"name": "delete_files", "arguments": json.dumps({"path": "/tmp/x"})}
    emu.script("dropped", [{"fault": "no_finish", "text": "Let me do that.", "chunks": 3,
                            "tool_call": tool}])
    events = run(client, "dropped")
    done = events[-1]
    assert done["status"] == "partial", done
    assert done["response"]["dropped_tool_names"] == ["delete_files"]
    assert done["response"]["tool_calls"] == []  # never handed out for execution
    assert any(e["kind"] == "notice" and "delete_files" in e["data"]
               for e in events if e["op"] == "delta")


def test_context_overflow_ends_without_continuation(client: Client, emu: EmulatorClient) -> None:
    emu.script("overflow", [{"fault": "status", "status": 400, "error_code": "context_length_exceeded",
                             "message": "This model's maximum context length is 8192 tokens. "
                                        "However, your messages resulted in 9000 tokens."}])
    done = run(client, "overflow")[-1]
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "context_overflow"
    assert done["response"]["content"] == ""
    assert len(emu.log("overflow")) == 1


def test_content_filter_ending_is_marked(client: Client, emu: EmulatorClient) -> None:
    emu.script("filtered", [{"fault": "ok", "finish_reason": "content_filter"}])
    events = run(client, "filtered")
    done = events[-1]
    assert done["response"]["finish_reason"] == "content_filter"
    assert any(e["kind"] == "notice" and "content filter" in e["data"]
               for e in events if e["op"] == "delta")


def test_restart_policy_subscriber_sees_attempt1_reset_attempt2_done(
        client: Client, emu: EmulatorClient) -> None:
    emu.script("restart", [{"fault": "stall", "after": 4, "stall_s": 3.0}])
    events = run(client, "restart", options={"stale_timeout_s": 0.5, "on_partial": "restart"})
    ops = [(e["op"], e.get("attempt")) for e in events]
    reset_at = ops.index(("reset", 2))
    assert all(op == "delta" and attempt == 1 for op, attempt in ops[:reset_at])
    assert reset_at > 0
    assert all(op == "delta" and attempt == 2 for op, attempt in ops[reset_at + 1:-1])
    done = events[-1]
    assert done["status"] == "completed"
    sent = emu.log("restart")
    assert done["response"]["content"] == sent[1]["text"]
    assert texts(events[reset_at + 1:]) == sent[1]["text"]


def test_breaker_counts_each_stale_attempt_once_and_fails_fast(
        client: Client, emu: EmulatorClient) -> None:
    session = "breaker-session"
    stall = {"fault": "stall", "after": 0, "stall_s": 3.0}
    opts = {"stale_timeout_s": 0.3, "max_attempts": 1}
    for i in range(5):
        emu.script(f"brk-{i}", [stall])
        done = run(client, f"brk-{i}", session_id=session, options=opts)[-1]
        assert done["error"]["code"] == "stream_stalled", done
        pairs = [b for b in client.status()["breakers"] if b["session_id"] == session]
        # Stale for up to 10x its timeout, yet counted once per attempt.
        assert pairs[0]["consecutive_stale"] == i + 1, pairs
    assert pairs[0]["state"] == "open"
    before = len(emu.log())
    with pytest.raises(ClientError) as info:
        client.submit("emu", request_for("openai", "brk-6"), session_id=session, options=opts)
    assert info.value.code == "breaker_open"
    assert "breaker" in info.value.message and session in info.value.message
    assert len(emu.log()) == before  # no request reached the provider
    # Another session on the same provider is unaffected.
    assert run(client, "brk-other", session_id="other-session")[-1]["status"] == "completed"


@pytest.mark.parametrize("after", [0, 2])  # before the first chunk, and mid-stream
def test_cancel_while_streaming_kills_the_attempt(client: Client, daemon: DaemonProcess,
                                                  emu: EmulatorClient, after: int) -> None:
    key = f"cancel-run-{after}"
    emu.script(key, [{"fault": "stall", "after": after, "stall_s": 10.0}])
    call_id = client.submit("emu", request_for("openai", key))
    wait_until(lambda: any(r["chunks_sent"] >= after for r in emu.log(key)), 10,
               f"the request, {after} chunk(s) into the stream")
    pid = wait_until(lambda: next((w["pid"] for w in client.status()["workers"]
                                   if w["call_id"] == call_id and w["state"] == "busy"), 0),
                     10, "the call's busy worker")
    assert client.cancel(call_id)["op"] == "cancelling"
    done = list(client.events(call_id, timeout_s=10.0))[-1]
    assert done["status"] == "cancelled", done
    wait_until(lambda: not any(w["pid"] == pid for w in client.status()["workers"]), 5,
               "the cancelled attempt's worker to be reaped")
    assert len(emu.log(key)) == 1


def test_cancel_during_backoff_is_immediate(client: Client, emu: EmulatorClient) -> None:
    emu.script("cancel-backoff", [{"fault": "status", "status": 429, "retry_after": 30}])
    call_id = client.submit("emu", request_for("openai", "cancel-backoff"))
    wait_until(lambda: any(c["call_id"] == call_id and c["state"] == "backoff"
                           for c in client.status()["calls"]["running"]), 10,
               "the call to be backing off")
    client.cancel(call_id)
    done = list(client.events(call_id, timeout_s=5.0))[-1]  # far less than the 30 s backoff
    assert done["status"] == "cancelled"
    assert len(emu.log("cancel-backoff")) == 1


def test_repeated_idempotency_key_starts_nothing(client: Client, emu: EmulatorClient) -> None:
    first = client.submit("emu", request_for("openai", "idem"), idempotency_key="order-42")
    second = client.submit("emu", request_for("openai", "idem"), idempotency_key="order-42")
    assert second == first
    done = list(client.events(first, timeout_s=30.0))[-1]
    assert done["status"] == "completed"
    third = client.submit("emu", request_for("openai", "idem"), idempotency_key="order-42",
                          subscribe=False)
    assert third == first
    assert len(emu.log("idem")) == 1


def test_deadline_bounds_the_call_including_retries(client: Client,
                                                    emu: EmulatorClient) -> None:
    emu.script("deadline", [{"fault": "stall", "after": 0, "stall_s": 10.0}])
    done = run(client, "deadline", options={"deadline_s": 1.0, "stale_timeout_s": 20.0})[-1]
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "deadline_exceeded"


def test_reconnect_with_from_seq_reassembles_exactly(daemon: DaemonProcess,
                                                     emu: EmulatorClient) -> None:
    emu.script("resume", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.03}])
    first = daemon.client()
    call_id = first.submit("emu", request_for("openai", "resume"))
    seen: list[dict[str, Any]] = []
    for event in first.events(call_id, timeout_s=10.0):
        seen.append(event)
        if len(seen) == 10:
            break
    first.close()  # the subscribing client dies mid-stream
    with daemon.client() as second:
        second.subscribe(call_id, from_seq=seen[-1]["seq"])
        rest = list(second.events(call_id, timeout_s=30.0))
    events = seen + rest
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    done = events[-1]
    assert texts(events) == done["response"]["content"] == emu.log("resume")[0]["text"]
    # A subscriber that arrives after done gets the full replay, then done.
    with daemon.client() as late:
        late.subscribe(call_id, from_seq=0)
        replay = list(late.events(call_id, timeout_s=10.0))
    assert [e["seq"] for e in replay] == [e["seq"] for e in events]
    assert replay[-1]["response"] == done["response"]


def test_result_exposes_per_attempt_diagnostics(client: Client, emu: EmulatorClient) -> None:
    emu.script("diag", [{"fault": "disconnect", "after": 0}, {"fault": "ok", "chunks": 6}])
    call_id = client.submit("emu", request_for("openai", "diag"), subscribe=False)
    done = client.result(call_id, wait_s=20.0)
    assert done is not None and done["status"] == "completed"
    diag = done["diagnostics"]
    assert [d["attempt"] for d in diag] == [1, 2]
    assert diag[0]["error_class"] == "transient" and diag[0]["how"] == "ended"
    assert diag[1]["finish_reason"] == "stop" and diag[1]["chunks"] >= 6
    assert diag[1]["first_chunk_ms"] is not None and diag[1]["bytes"] > 0
