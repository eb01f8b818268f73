"""Issue 13, item 2 (the transcript side): a lock that another process holds
on transcript.db, longer than sqlite3's default 5 s busy timeout and than
the sink's busy timeout per try, is waited for (the sink's storage-fault
retry, ARCHITECTURE §4.15). The sink does not die, and the call completes
exactly from its one provider request."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import pytest

from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.sink.store import BUSY_TIMEOUT_S
from tests.harness import DaemonProcess, assert_one_exact_answer

pytestmark = pytest.mark.slow

HOLD_S = 7.0  # the fault: longer than sqlite3's default busy timeout (5 s)


def test_a_lock_held_on_the_transcript_is_waited_for(make_daemon: Any,
                                                      emu: EmulatorClient) -> None:
    assert HOLD_S > BUSY_TIMEOUT_S  # past one try's wait: the retry carries it
    emu.script("locked", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon()
    request = {"model": "gpt-emu#locked", "messages": [{"role": "user", "content": "x"}]}
    with daemon.client(timeout_s=30.0) as client:
        call_id = client.submit("emu", request, options={"stale_timeout_s": 2.0})
        events = client.events(call_id, timeout_s=30.0)
        first = [next(events) for _ in range(3)]
        # A backup tool's write transaction, from another connection (process-wide lock).
        other = sqlite3.connect(daemon.state_dir / "transcript.db", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            time.sleep(HOLD_S)  # the fault itself: the lock held this long
            other.execute("ROLLBACK")
        finally:
            other.close()
        rest = list(events)
        status = client.status()
    assert_one_exact_answer([*first, *rest], emu.log("locked"))
    assert status["counters"].get("sink_restarts", 0) == 0, status["counters"]
