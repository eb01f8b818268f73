"""Issue 13, items 1 and 2, end to end: a lock another process holds on
journal.db, and a full disk under the state dir. The supervisor stays up,
every submit meanwhile gets the fault's code at once, `status` says what is
wrong, a running call finishes, and submits are accepted again as soon as
the journal can write, with no restart (docs/GUARANTEES.md, "Storage faults")."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from streamfence.devtools import disks
from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.devtools.launcher import DaemonExited
from streamfence.protocol.client import Client
from streamfence.protocol.client_router import ClientError
from tests.harness import DaemonProcess, assert_one_exact_answer, wait_until

pytestmark = pytest.mark.slow

REQUEST = {"messages": [{"role": "user", "content": "x"}]}


def _submit_refused(client: Client, key: str) -> ClientError:
    with pytest.raises(ClientError) as refused:
        client.submit("emu", dict(REQUEST, model=f"gpt-emu#{key}"))
    return refused.value


def _ended_as(client: Client, call_id: str, wait_s: float = 0.0) -> str | None:
    """The call's status once it ended (waiting up to wait_s); None while it runs."""
    done = client.result(call_id, wait_s=wait_s)
    return None if done is None else str(done["status"])


def _storage(client: Client) -> dict[str, Any] | None:
    storage: dict[str, Any] | None = client.status()["storage"]
    return storage


def test_a_lock_on_the_journal_refuses_submits_and_the_running_call_finishes(
        make_daemon: Any, emu: EmulatorClient) -> None:
    emu.script("running", [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.05}])
    daemon: DaemonProcess = make_daemon()
    supervisor = daemon.proc.pid if daemon.proc else None
    with daemon.client(timeout_s=10.0) as client:
        call_id = client.submit("emu", dict(REQUEST, model="gpt-emu#running"))
        events = client.events(call_id, timeout_s=30.0)
        first = [next(events)]
        other = sqlite3.connect(daemon.state_dir / "journal.db", isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # a backup tool's write transaction
            # The lock is met by the first journal write after it: this submit's.
            refused = _submit_refused(client, "during")
            assert refused.code == "storage_busy", refused
            assert "journal.db is locked by another process" in refused.message
            assert _submit_refused(client, "during2").code == "storage_busy"
            storage = _storage(client)
            assert storage is not None and storage["code"] == "storage_busy", storage
            # The running call ends while the journal cannot write its end.
            rest = list(events)
            done = client.result(call_id, wait_s=10.0)
            assert done is not None and done["status"] == "completed", done
        finally:
            other.execute("ROLLBACK")
            other.close()
        wait_until(lambda: _storage(client) is None, 10.0, "the journal to write again")
        emu.script("after", [{"fault": "ok", "chunks": 3}])
        after = client.submit("emu", dict(REQUEST, model="gpt-emu#after"))
        assert _ended_as(client, after, 20.0) == "completed"
        counters = client.status()["counters"]
    assert_one_exact_answer([*first, *rest], emu.log("running"))
    assert emu.log("during") == [] and emu.log("during2") == []
    assert counters["refused.storage_busy"] == 2, counters
    assert counters.get("sink_restarts", 0) == 0, counters
    assert daemon.proc is not None and daemon.proc.pid == supervisor and daemon.proc.poll() is None
    # What the journal kept meanwhile was written: the call's end and its attempt's.
    assert daemon.journal_rows("SELECT state, status FROM calls WHERE call_id = ?",
                               call_id) == [("done", "completed")]
    assert daemon.journal_rows("SELECT how FROM attempts WHERE call_id = ?",
                               call_id) == [("ended",)]
    text = daemon.log_text()
    assert "writable again" in text and "no transaction is active" not in text


def test_a_full_disk_refuses_submits_with_storage_full_and_resumes(
        small_disk: Callable[[int], Path], make_daemon: Any, emu: EmulatorClient,
        tmp_path: Path) -> None:
    state = small_disk(16)
    daemon: DaemonProcess = make_daemon(name=state.name, start=False)
    daemon.log_path = tmp_path / "daemon.log"  # the log must not share the full disk
    daemon.start()
    supervisor = daemon.proc.pid if daemon.proc else None
    emu.script("before", [{"fault": "ok", "chunks": 3}])
    with daemon.client(timeout_s=10.0) as client:
        before = client.submit("emu", dict(REQUEST, model="gpt-emu#before"))
        assert _ended_as(client, before, 20.0) == "completed"
        filler = disks.fill(state)
        refused = _submit_refused(client, "full")
        assert refused.code == "storage_full", refused
        assert "is full" in refused.message
        storage = _storage(client)
        assert storage is not None and storage["code"] == "storage_full", storage
        assert _submit_refused(client, "full2").code == "storage_full"
        filler.unlink()
        wait_until(lambda: _storage(client) is None, 10.0,
                   "the journal to write again once space is back")
        emu.script("after", [{"fault": "ok", "chunks": 3}])
        after = client.submit("emu", dict(REQUEST, model="gpt-emu#after"))
        assert _ended_as(client, after, 20.0) == "completed"
        counters = client.status()["counters"]
    assert emu.log("full") == [] and emu.log("full2") == []
    assert counters["refused.storage_full"] == 2, counters
    assert daemon.proc is not None and daemon.proc.pid == supervisor
    assert daemon.proc.poll() is None
    daemon.stop()
    assert "no transaction is active" not in daemon.log_text()


def test_a_start_on_a_full_disk_is_refused_with_the_reason_and_forgets_nothing(
        small_disk: Callable[[int], Path], make_daemon: Any, emu: EmulatorClient,
        tmp_path: Path) -> None:
    state = small_disk(16)
    daemon: DaemonProcess = make_daemon(name=state.name, start=False)
    daemon.log_path = tmp_path / "daemon.log"
    daemon.start()
    emu.script("kept", [{"fault": "ok", "chunks": 3}])
    with daemon.client(timeout_s=10.0) as client:
        kept = client.submit("emu", dict(REQUEST, model="gpt-emu#kept"))
        assert _ended_as(client, kept, 20.0) == "completed"
    assert daemon.stop() == 0
    filler = disks.fill(state)
    with pytest.raises(DaemonExited) as refused:
        daemon.start(ready_timeout=10.0)
    assert "the disk holding it is full" in str(refused.value), refused.value
    assert "free space and start again" in str(refused.value)
    assert daemon.stop() not in (0, None)
    filler.unlink()
    daemon.start()
    with daemon.client(timeout_s=10.0) as client:
        assert _ended_as(client, kept) == "completed"
    daemon.stop()
