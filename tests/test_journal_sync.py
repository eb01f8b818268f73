"""The journal's group commit (streamfence.supervisor.journal_sync): a commit
returns without waiting for the disk, and what must be durable first (an
`accepted` reply, an epoch before the sink hears of it) runs only once the
sync thread has fsynced the WAL."""

from __future__ import annotations

import select
from pathlib import Path

from streamfence.supervisor.journal import Journal


def _add(journal: Journal, call_id: str) -> None:
    journal.add_call(call_id, "local", None, None, "emu", {"model": "m"}, {})


def _wait_synced(journal: Journal, timeout_s: float = 10.0) -> None:
    readable, _, _ = select.select([journal.sync_fileno()], [], [], timeout_s)
    assert readable, f"the sync thread did not report within {timeout_s} s"
    journal.on_synced()


def test_what_waits_for_a_commit_runs_only_once_it_is_synced(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "journal.db"))
    ran: list[str] = []
    _add(journal, "a")
    journal.commit(then=lambda: ran.append("accepted a"))
    assert ran == []  # committed, not yet on disk: no reply yet
    _wait_synced(journal)
    assert ran == ["accepted a"]
    journal.commit(then=lambda: ran.append("nothing new"))  # nothing to sync: at once
    assert ran == ["accepted a", "nothing new"]
    journal.close()


def test_callbacks_run_in_commit_order(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "journal.db"))
    ran: list[str] = []
    for name in ("a", "b", "c"):
        _add(journal, name)
        journal.commit(then=lambda name=name: ran.append(name))  # type: ignore[misc]
    while len(ran) < 3:
        _wait_synced(journal)
    assert ran == ["a", "b", "c"]
    journal.close()


def test_close_syncs_and_runs_what_waited(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    ran: list[str] = []
    _add(journal, "last")
    journal.commit(then=lambda: ran.append("accepted last"))
    journal.close()
    assert ran == ["accepted last"]
    again = Journal(str(path))
    assert [c.call_id for c in again.unfinished()] == ["last"]
    again.close()
