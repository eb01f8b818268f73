"""Retention: finished calls older than `retention_days` leave the journal (with
their attempts) and the transcript (with their events); unfinished calls never
do. Unit tests on real SQLite files, the sink's own schedule, `streamfence
prune --older-than` as a subprocess, and the real daemon end to end."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from streamfence.cli.prune import parse_age
from streamfence.devtools.emulator.control import EmulatorClient
from streamfence.protocol.client import ClientError
from streamfence.protocol.codec import encode
from streamfence.protocol.messages import delta_event
from streamfence.sink.retention import PRUNE_FIRST_S, prune_grace_s
from streamfence.sink.state import SinkState
from streamfence.sink.store import TranscriptStore
from streamfence.sink.transcript import TranscriptReader, prune_transcript
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.journal_file import prune_journal
from tests.fakes import Nobody
from tests.harness import DaemonProcess, wait_until
from tests.wires import request_for

DAY = 86400.0


def _sql(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection (as another process would)."""
    db = sqlite3.connect(path, isolation_level=None, timeout=10.0)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


# ---- the journal -------------------------------------------------------------------

def _journal(path: Path, done: Sequence[str], running: Sequence[str] = (),
             pending: Sequence[str] = ()) -> Journal:
    j = Journal(str(path))
    for cid in [*done, *running, *pending]:
        j.add_call(cid, "local", f"key-{cid}", None, "emu", {"model": "m"}, {})
    for cid in [*done, *running]:
        j.start_attempt(cid, 1, "p", None)
        j.end_attempt(cid, 1, "stale", None)
        j.start_attempt(cid, 2, "p", None)
    for cid in done:
        j.finish_call(cid, "completed")
    j.commit()
    return j


def _age_journal(path: Path, seconds: float, prefix: str) -> None:
    _sql(path, "UPDATE calls SET created = created - ?, finished = finished - ? "
               "WHERE call_id LIKE ?", seconds, seconds, prefix + "%")


def test_journal_prune_removes_old_finished_calls_and_their_attempts(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    j = _journal(path, done=["old-done", "new-done"], running=["old-running"],
                 pending=["old-pending"])
    _age_journal(path, 2 * DAY, "old-")
    assert len(j.attempts_of("old-done")) == 2

    assert j.prune(time.time() - DAY) == 1
    assert j.prune_more is False
    assert j.owner_of("old-done") is None
    assert not j.is_finished("old-done")
    assert j.attempts_of("old-done") == []
    assert _sql(path, "SELECT count(*) FROM attempts WHERE call_id = 'old-done'") == [(0,)]
    assert j.call_by_idempotency_key("local", "key-old-done") is None
    # Recent finished calls and unfinished calls (however old) stay.
    assert j.is_finished("new-done")
    assert len(j.attempts_of("new-done")) == 2
    assert {c.call_id for c in j.unfinished()} == {"old-running", "old-pending"}
    assert len(j.attempts_of("old-running")) == 2
    assert j.prune(time.time() - DAY) == 0
    j.close()


def test_journal_prune_goes_oldest_first_in_bounded_batches(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    ids = [f"old-{i:02d}" for i in range(25)]
    j = _journal(path, done=ids)
    for i, cid in enumerate(ids):  # old-00 is the oldest
        _sql(path, "UPDATE calls SET finished = ? WHERE call_id = ?", time.time() - DAY - 100 + i,
             cid)
    cutoff = time.time() - 3600
    assert j.prune(cutoff, limit=10) == 10
    assert j.prune_more is True
    assert [j.owner_of(c) for c in ids[:10]] == [None] * 10
    assert all(j.owner_of(c) == "local" for c in ids[10:])
    assert j.prune(cutoff, limit=10) == 10
    assert j.prune(cutoff, limit=10) == 5
    assert j.prune_more is False
    # A time budget of zero still deletes one call per transaction, and says more are due.
    j.close()
    j = _journal(tmp_path / "j2.db", done=["a", "b", "c"])
    _age_journal(tmp_path / "j2.db", DAY, "")
    assert j.prune(time.time() - 3600, budget_s=0.0) == 1
    assert j.prune_more is True
    j.close()


def test_journal_prune_tick_follows_retention_days_and_its_schedule(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    j = _journal(path, done=["old-1", "old-2", "new"], running=["old-running"])
    _age_journal(path, 2 * DAY, "old-")
    assert j.prune_tick(0) == 0  # 0: keep forever
    assert j.owner_of("old-1") == "local"
    assert j.prune_tick(1.0) == 2
    assert j.owner_of("old-1") is None and j.owner_of("new") == "local"
    assert j.owner_of("old-running") == "local"
    # The next batch is not due yet: nothing happens in the next turns.
    j.add_call("old-3", "local", None, None, "emu", {}, {})
    j.finish_call("old-3", "completed")
    j.commit()  # the loop's turn ends
    _age_journal(path, 2 * DAY, "old-3")
    assert j.prune_tick(1.0) == 0
    assert j.owner_of("old-3") == "local"
    j.close()


def test_prune_journal_from_another_connection_while_the_journal_is_open(
        tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    j = _journal(path, done=[f"old-{i}" for i in range(30)] + ["new"], running=["old-run"])
    _age_journal(path, 2 * DAY, "old-")
    _sql(path, "DROP INDEX calls_finished")  # a journal from before retention
    assert prune_journal(str(path), time.time() - DAY, batch=7) == 30
    assert _sql(path, "SELECT call_id FROM calls ORDER BY call_id") == [("new",), ("old-run",)]
    assert _sql(path, "SELECT DISTINCT call_id FROM attempts ORDER BY call_id") == [
        ("new",), ("old-run",)]
    assert _sql(path, "SELECT count(*) FROM sqlite_master WHERE name = 'calls_finished'") == [
        (1,)]
    # The daemon's connection goes on writing.
    j.add_call("after", "local", None, None, "emu", {}, {})
    j.commit()
    assert j.owner_of("after") == "local"
    j.close()


# ---- the transcript ----------------------------------------------------------------

def _run(cid: str, texts: list[str], first_seq: int = 1) -> list[bytes]:
    return [encode(delta_event(cid, 1, first_seq + i, "text", t)) for i, t in enumerate(texts)]


def _transcript(path: Path, done: Sequence[str], open_: Sequence[str] = ()) -> TranscriptStore:
    store = TranscriptStore(str(path))
    for cid in [*done, *open_]:
        store.set_epoch(cid, 1)
        store.add_run(cid, 1, 1, _run(cid, ["a", "b"]))
        store.commit()
        store.add_run(cid, 3, 1, _run(cid, ["c"], 3))
        store.commit()
    for cid in done:
        store.add(cid, 4, 4, 1, "done", encode({"op": "done", "call_id": cid, "seq": 4}))
        store.set_done(cid, 1, "completed", 4)
    store.commit()
    return store


def _age_transcript(path: Path, seconds: float, prefix: str) -> None:
    _sql(path, "UPDATE calls SET updated_at = updated_at - ? WHERE call_id LIKE ?", seconds,
         prefix + "%")


def test_store_prune_removes_old_finished_calls_and_their_events(tmp_path: Path) -> None:
    path = tmp_path / "transcript.db"
    store = _transcript(path, done=["old-done", "new-done"], open_=["old-open"])
    _age_transcript(path, 2 * DAY, "old-")
    assert store.prune(time.time() - DAY) == 1
    assert store.prune_more is False
    assert store.pruned == 1
    assert store.call_row("old-done") is None
    assert store.events_after("old-done") == []
    assert _sql(path, "SELECT count(*) FROM events WHERE call_id = 'old-done'") == [(0,)]
    reader = TranscriptReader(str(path))
    assert reader.done_event("old-done") is None
    assert "old-done" not in reader.max_epochs()
    reader.close()
    # An unfinished call keeps everything, however old; so does a recent one.
    assert [r.call_id for r in store.unfinished_calls()] == ["old-open"]
    assert len(store.events_after("old-open")) == 3
    row = store.call_row("new-done")
    assert row is not None and row.status == "completed" and row.last_seq == 4
    assert len(store.events_after("new-done")) == 4
    store.close()


def test_store_prune_is_bounded_and_leaves_buffered_writes_alone(tmp_path: Path) -> None:
    path = tmp_path / "transcript.db"
    ids = [f"old-{i:02d}" for i in range(12)]
    store = _transcript(path, done=ids)
    _age_transcript(path, 2 * DAY, "old-")
    store.set_epoch("live", 1)
    store.add_run("live", 1, 1, _run("live", ["x"]))  # buffered, not committed yet
    assert store.prune(time.time() - DAY, limit=5) == 5
    assert store.prune_more is True
    assert store.prune(time.time() - DAY, budget_s=0.0) == 1
    assert store.prune_more is True
    assert store.commit() == 1  # the buffered run is still there, and lands
    assert store.events_after("live") == _run("live", ["x"])
    assert prune_transcript(str(path), time.time() - DAY, batch=2) == 6
    assert _sql(path, "SELECT call_id FROM calls") == [("live",)]
    store.close()


def test_sink_state_prunes_its_own_file_a_grace_after_the_journal(tmp_path: Path) -> None:
    path = tmp_path / "transcript.db"
    store = _transcript(path, done=["old-done", "edge-done", "new-done"], open_=["old-open"])
    _age_transcript(path, 2 * DAY, "old-")
    # Past the retention, but not past the retention and the grace: kept for now.
    _age_transcript(path, DAY + prune_grace_s(DAY) / 2, "edge-")
    assert SinkState(store, Nobody(), Nobody()).retention.due is None  # 0: keep forever
    before = time.monotonic()
    state = SinkState(store, Nobody(), Nobody(), retention_days=1.0)
    assert state.retention.due is not None and state.retention.due >= before + PRUNE_FIRST_S
    assert state.retention.prune() == 1
    assert state.retention.due > time.monotonic()
    assert state.stats()["calls_pruned"] == 1
    assert store.call_row("old-done") is None
    assert store.call_row("edge-done") is not None
    assert store.call_row("new-done") is not None
    assert store.call_row("old-open") is not None
    store.close()


# ---- streamfence prune --------------------------------------------------------------

def test_parse_age() -> None:
    assert parse_age("3d") == 3 * DAY
    assert parse_age("1.5h") == 5400.0
    assert parse_age("30m") == 1800.0
    assert parse_age("90s") == 90.0
    assert parse_age(" 0S ") == 0.0
    for bad in ("3", "3w", "", "-1d", "d", "1.2.3h"):
        with pytest.raises(ValueError, match="not an age"):
            parse_age(bad)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMFENCE_")}
    return subprocess.run([sys.executable, "-m", "streamfence.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (tmp_path / "streamfence.toml").write_text(f'[daemon]\nstate_dir = "{state}"\n')
    yield state


def test_prune_command_without_a_daemon(tmp_path: Path, state_dir: Path) -> None:
    j = _journal(state_dir / "journal.db", done=["old-1", "old-2", "new"], running=["old-run"])
    j.close()
    s = _transcript(state_dir / "transcript.db", done=["old-1", "old-2", "new"],
                    open_=["old-run"])
    s.close()
    _age_journal(state_dir / "journal.db", 3 * 3600, "old-")
    _age_transcript(state_dir / "transcript.db", 3 * 3600, "old-")
    config = str(tmp_path / "streamfence.toml")

    proc = _cli("prune", "--config", config, "--older-than", "2h")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["journal.db: removed 2 finished calls",
                                        "transcript.db: removed 2 finished calls"]
    assert _sql(state_dir / "journal.db", "SELECT call_id FROM calls ORDER BY call_id") == [
        ("new",), ("old-run",)]
    assert _sql(state_dir / "transcript.db", "SELECT DISTINCT call_id FROM events "
                                             "ORDER BY call_id") == [("new",), ("old-run",)]

    proc = _cli("prune", "--config", config, "--older-than", "4h")
    assert proc.returncode == 0, proc.stderr
    assert "journal.db: removed 0 finished calls" in proc.stdout

    proc = _cli("prune", "--config", config, "--older-than", "3")
    assert proc.returncode == 2
    assert "not an age" in proc.stderr


def test_prune_command_on_a_missing_state_dir(tmp_path: Path) -> None:
    config = tmp_path / "streamfence.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "nowhere"}"\n')
    proc = _cli("prune", "--config", str(config), "--older-than", "1d")
    assert proc.returncode == 1
    assert "no state dir" in proc.stderr


# ---- the real daemon ------------------------------------------------------------------

def _unknown(daemon: DaemonProcess, call_id: str) -> None:
    """`result`, `subscribe` and `cancel` of `call_id` answer unknown_call."""
    with daemon.client(timeout_s=10.0) as client:
        with pytest.raises(ClientError) as info:
            client.result(call_id)
        assert info.value.code == "unknown_call"
        client.subscribe(call_id)
        with pytest.raises(ClientError) as info:
            next(client.events(call_id, timeout_s=10.0))
        assert info.value.code == "unknown_call"
        with pytest.raises(ClientError) as info:
            client.cancel(call_id)
        assert info.value.code == "unknown_call"


def _in_files(daemon: DaemonProcess, call_id: str) -> tuple[bool, bool]:
    return (bool(daemon.journal_rows("SELECT 1 FROM calls WHERE call_id = ?", call_id)),
            bool(daemon.transcript_rows("SELECT 1 FROM calls WHERE call_id = ?", call_id)))


@pytest.mark.slow
def test_daemon_prunes_finished_calls_after_the_retention(make_daemon: Any,
                                                          emu: EmulatorClient) -> None:
    retention_s = 4.0
    daemon = make_daemon(daemon={"retention_days": retention_s / DAY})
    emu.script("stalled", [{"fault": "stall", "after": 2, "stall_s": 120}])
    with daemon.client(timeout_s=10.0) as client:
        running = client.submit("emu", request_for("openai", "stalled"), subscribe=False,
                                options={"stale_timeout_s": 120})
        done = client.run("emu", request_for("openai", "quick"))
    assert done["status"] == "completed"
    finished = done["call_id"]
    wait_until(lambda: daemon.transcript_rows(
        "SELECT 1 FROM events WHERE call_id = ?", running), 30, "the stalled call's deltas")
    assert _in_files(daemon, finished) == (True, True)

    # Gone from both files once the retention (and the sink's grace) has passed.
    wait_until(lambda: _in_files(daemon, finished) == (False, False), 60,
               "the finished call to leave the journal and the transcript")
    assert daemon.journal_rows("SELECT count(*) FROM attempts WHERE call_id = ?",
                               finished) == [(0,)]
    assert daemon.transcript_rows("SELECT count(*) FROM events WHERE call_id = ?",
                                  finished) == [(0,)]
    _unknown(daemon, finished)
    # The unfinished call, older than the retention by now, keeps everything.
    assert daemon.journal_rows("SELECT state FROM calls WHERE call_id = ?", running) == [
        ("running",)]
    assert daemon.transcript_rows("SELECT status FROM calls WHERE call_id = ?", running) == [
        (None,)]
    assert daemon.transcript_rows("SELECT count(*) FROM events WHERE call_id = ?",
                                  running)[0][0] >= 1
    with daemon.client(timeout_s=10.0) as client:
        assert client.status()["counters"]["journal_pruned"] >= 1
        # The sink's counters reach `status` within a second or so.
        wait_until(lambda: client.status()["sink"].get("calls_pruned", 0) >= 1, 10,
                   "the sink's calls_pruned counter in status")
        client.cancel(running)
        assert (client.result(running, wait_s=20.0) or {}).get("status") == "cancelled"


@pytest.mark.slow
def test_prune_command_with_a_running_daemon(make_daemon: Any) -> None:
    daemon = make_daemon()  # retention off: only the command prunes
    with daemon.client(timeout_s=10.0) as client:
        first = client.run("emu", request_for("openai", "first"))["call_id"]
    proc = _cli("prune", "--config", str(daemon.config_path), "--older-than", "0s")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["journal.db: removed 1 finished call",
                                        "transcript.db: removed 1 finished call"]
    assert _in_files(daemon, first) == (False, False)
    _unknown(daemon, first)
    with daemon.client(timeout_s=10.0) as client:  # and the daemon goes on
        assert client.run("emu", request_for("openai", "second"))["status"] == "completed"
