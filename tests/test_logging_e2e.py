"""Logging through the real worker path (docs/ARCHITECTURE.md §4.9): every record
a worker emits, the SDK's and httpx2's own included, reaches the daemon's log
carrying the call's session_id, call_id and attempt; a failure before
delivery is logged at ERROR with its traceback."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from tests.harness import DaemonProcess, wait_until

pytestmark = pytest.mark.slow


def test_worker_records_carry_the_call_context_and_failures_a_traceback(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("logs", [{"fault": "status", "status": 500, "message": "emulated outage"}])
    daemon: DaemonProcess = make_daemon()
    with daemon.client() as client:
        call_id = client.submit(
            "emu", {"model": "gpt-emu#logs", "messages": [{"role": "user", "content": "x"}]},
            session_id="sess-logging-1", options={"max_attempts": 1})
        done = list(client.events(call_id, timeout_s=30.0))[-1]
    assert done["status"] == "failed", done

    def worker_records() -> list[dict[str, Any]]:
        return [r for r in daemon.log_records() if r.get("call_id") == call_id
                and str(r.get("process_name")).startswith("worker-")]

    def failed_record() -> bool:
        return any(r["level"] == "ERROR" and "failed before delivery" in r["message"]
                   for r in worker_records())

    # The worker's records reach the log through the supervisor, in their order
    # but not all at once: wait for the last one this test reads.
    wait_until(lambda: any(r["logger"] == "httpx2" for r in worker_records()), 10,
               "an httpx2 record from the worker in the daemon's log")
    wait_until(failed_record, 10, "the worker's 'failed before delivery' record in the log")
    records = worker_records()
    sdk = [r for r in records if r["logger"].split(".")[0] in ("httpx2", "openai")]
    assert sdk, records
    for record in sdk:
        assert record["session_id"] == "sess-logging-1", record
        assert record["attempt"] == 1, record
    failures = [r for r in records if r["level"] == "ERROR"
                and "failed before delivery" in r["message"]]
    assert len(failures) == 1, records
    failure = failures[0]
    assert failure["session_id"] == "sess-logging-1" and failure["attempt"] == 1
    assert "Traceback (most recent call last)" in failure.get("traceback", ""), failure
    assert "InternalServerError" in failure["traceback"]
