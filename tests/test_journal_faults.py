"""Issue 13, items 1 and 2 (the journal side): a lock held by another process,
a full disk. The journal never raises for them and never loses a write: it
keeps the unit, refuses the unit's new calls, holds every `then` until the
commit that writes the kept unit, and resumes by itself (journal.py,
"Storage faults"). Real SQLite files, a real lock from another connection,
a real full tmpfs."""

from __future__ import annotations

import contextlib
import logging
import select
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamfence.devtools import disks
from streamfence.protocol.errors import ErrorCode
from streamfence.supervisor.journal import Journal
from tests.harness import wait_until


def _add(journal: Journal, call_id: str, body: str = "x") -> bool:
    return journal.add_call(call_id, "local", None, None, "emu", {"messages": body}, {})


def _commits(journal: Journal) -> bool:
    """Commit what is buffered; whether the journal is free of faults after."""
    journal.commit()
    return journal.fault is None


def _wait_synced(journal: Journal, ran: list[str], what: str) -> None:
    """Drive the journal as the loop does (commit retries, sync wake-ups)."""
    def done() -> bool:
        journal.commit()
        if select.select([journal.sync_fileno()], [], [], 0.02)[0]:
            journal.on_synced()
        return what in ran
    wait_until(done, 10.0, f"{what!r} to run after the journal commits again")


def _rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Another process's write transaction (what a backup tool or a `sqlite3`
    shell's BEGIN IMMEDIATE holds)."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_a_lock_keeps_the_writes_refuses_the_new_calls_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    ran: list[str] = []
    try:
        _add(journal, "old")
        journal.commit()
        with _locked(path):
            journal.start_attempt("old", 1, "p", None)  # the lock is met here: the unit is kept
            _add(journal, "new")  # a submit while faulted never reaches here (front)
            assert journal.fault is not None
            assert journal.fault.code is ErrorCode.STORAGE_BUSY
            assert "journal.db is locked" in journal.fault.message
            assert journal.take_refused() == ["new"]
            journal.commit(then=lambda: ran.append("epoch durable"))
            assert ran == []  # the epoch is not durable: the sink must not hear of it
            journal.end_attempt("old", 1, "ended", None)
            journal.finish_call("old", "completed")
            assert journal.is_finished("old")  # kept, and said so before it is written
            view = journal.fault_view()
            assert view is not None and view["writes_kept"] == 4, view
        _wait_synced(journal, ran, "epoch durable")
        assert journal.fault is None
        assert _rows(path, "SELECT call_id, state, epoch FROM calls") == [("old", "done", 1)]
        assert _rows(path, "SELECT attempt, how FROM attempts") == [(1, "ended")]
        _add(journal, "next")  # accepted again, no restart
        journal.commit()
        assert journal.fault is None
    finally:
        journal.close()
    assert [r[0] for r in _rows(path, "SELECT call_id FROM calls ORDER BY call_id")] == \
        ["next", "old"]


def test_a_new_call_refused_in_a_failed_unit_is_never_written(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    try:
        _add(journal, "first")
        journal.commit()
        with _locked(path):
            _add(journal, "a")
            assert journal.take_refused() == ["a"]
            journal.commit()
        wait_until(lambda: _commits(journal), 10.0,
                   "the journal to commit again")
    finally:
        journal.close()
    assert _rows(path, "SELECT call_id FROM calls") == [("first",)]
    assert _rows(path, "SELECT call_id FROM requests") == [("first",)]


def test_a_fault_met_at_commit_refuses_every_new_call_of_the_unit(
        small_disk: Callable[[int], Path]) -> None:
    """The turn's writes went in, the COMMIT is what fails (a full disk fails
    there): every call the unit added is refused, the rest is kept."""
    state = small_disk(1)
    path = state / "journal.db"
    journal = Journal(str(path))
    ran: list[str] = []
    try:
        _add(journal, "old")
        journal.commit()
        journal.start_attempt("old", 1, "p", None)
        for i in range(3):
            _add(journal, f"new{i}", body="y" * (200 << 10))  # 600 KiB with the above
        filler = disks.fill(state)
        journal.commit(then=lambda: ran.append("durable"))
        assert journal.fault is not None
        assert journal.fault.code is ErrorCode.STORAGE_FULL, journal.fault
        assert sorted(journal.take_refused()) == ["new0", "new1", "new2"]
        filler.unlink()
        _wait_synced(journal, ran, "durable")
    finally:
        journal.close()
    assert _rows(path, "SELECT call_id, epoch FROM calls") == [("old", 1)]


def test_no_rollback_error_masks_a_full_disk(small_disk: Callable[[int], Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    state = small_disk(1)
    caplog.set_level(logging.INFO, logger="streamfence")
    journal = Journal(str(state / "journal.db"))
    try:
        filler = disks.fill(state)
        for i in range(20):  # until a write or a commit meets the full disk
            _add(journal, f"c{i}", body="z" * (64 << 10))
            journal.commit()
            if journal.fault is not None:
                break
        assert journal.fault is not None and journal.fault.code is ErrorCode.STORAGE_FULL
        journal.take_refused()
        filler.unlink()
        wait_until(lambda: _commits(journal), 10.0,
                   "the journal to commit again once space is back")
    finally:
        journal.close()
    text = caplog.text
    assert "is full" in text and "writable again" in text, text
    assert "no transaction is active" not in text
