"""Large requests are journaled as files written off the loop
(streamfence.supervisor.request_files): the submit frame as sent, with the
fields the daemon set kept beside it; the call stays `staging` until its
file is durable, a start forgets calls that never got there, a done call's
file goes, and a file that cannot be written refuses the call; a call
without one asks nothing of the disk when it ends."""

from __future__ import annotations

import select
import sqlite3
from pathlib import Path
from typing import Any

import msgpack

from streamfence.protocol.codec import encode
from streamfence.supervisor.journal import FILE_BYTES, Journal
from tests.wires import request_for


def _request(size: int) -> dict[str, Any]:
    return request_for("openai", "big", "x" * size)


def _stored(journal: Journal, timeout_s: float = 10.0) -> list[tuple[str, OSError | None]]:
    """What `stored()` says once the writer has woken the loop's descriptor."""
    readable, _, _ = select.select([journal.files.fileno()], [], [], timeout_s)
    assert readable, f"the request file was not written within {timeout_s} s"
    return journal.stored()


def _synced(journal: Journal, timeout_s: float = 10.0) -> None:
    """Wait for the sync thread to wake the loop's descriptor, and let it run."""
    readable, _, _ = select.select([journal.sync_fileno()], [], [], timeout_s)
    assert readable, f"the journal was not synced within {timeout_s} s"
    journal.on_synced()


def _state(path: Path, call_id: str) -> Any:
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT state FROM calls WHERE call_id = ?", (call_id,)).fetchone()
    return None if row is None else row[0]


def _frame(size: int) -> bytes:
    return encode({"v": 1, "op": "submit", "ref": "r",
                   "call": {"provider": "emu", "request": _request(size)}})


def _add(journal: Journal, call_id: str, size: int,
         overrides: dict[str, Any] | None = None) -> bool:
    request = {**_request(size), **(overrides or {})}
    return journal.add_call(call_id, "local", None, None, "emu", request, {},
                            memoryview(_frame(size)), overrides or {})


def test_a_small_request_stays_in_the_journal(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "journal.db"))
    assert _add(journal, "small", 1000) is False
    journal.commit()
    assert _state(tmp_path / "journal.db", "small") == "pending"
    assert list((tmp_path / "requests").iterdir()) == []
    [call] = journal.unfinished()
    assert call.request == _request(1000)
    journal.close()


def test_a_large_request_is_staging_until_its_file_is_durable(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    assert _add(journal, "big", FILE_BYTES) is True
    journal.commit()
    assert _state(path, "big") == "staging"
    assert journal.unfinished() == []  # not accepted yet: recovery would not run it
    assert _stored(journal) == [("big", None)]
    journal.commit()
    assert _state(path, "big") == "pending"
    assert (tmp_path / "requests" / "big").read_bytes() == _frame(FILE_BYTES)  # as sent
    [call] = journal.unfinished()
    assert call.request == _request(FILE_BYTES)
    journal.finish_call("big", "completed")
    journal.commit()
    assert (tmp_path / "requests" / "big").exists()  # until the finish is on disk
    _synced(journal)
    assert not (tmp_path / "requests" / "big").exists()
    journal.close()


def test_a_start_forgets_calls_whose_file_was_not_durable(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    _add(journal, "never", FILE_BYTES)
    journal.commit()  # the row is durable, `stored()` never asked: the daemon died here
    journal.close()
    again = Journal(str(path))
    assert _state(path, "never") is None
    assert list((tmp_path / "requests").iterdir()) == []
    assert again.unfinished() == []
    again.close()


def test_a_start_removes_files_of_done_calls(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    _add(journal, "done", FILE_BYTES)
    _stored(journal)
    journal.commit()
    with sqlite3.connect(path) as db:  # done, but its file left (a crash between the two)
        db.execute("UPDATE calls SET state = 'done' WHERE call_id = 'done'")
    journal.close()
    assert (tmp_path / "requests" / "done").exists()
    Journal(str(path)).close()
    assert not (tmp_path / "requests" / "done").exists()


def test_a_file_that_cannot_be_written_refuses_the_call(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(str(path))
    (tmp_path / "requests" / "doomed.part").mkdir()  # open() for writing fails: EISDIR
    _add(journal, "doomed", FILE_BYTES)
    [(call_id, error)] = _stored(journal)
    journal.commit()
    assert call_id == "doomed" and isinstance(error, OSError)
    assert _state(path, "doomed") is None
    assert journal.unfinished() == []
    journal.close()


def test_a_journal_of_an_earlier_version_keeps_its_requests_in_calls(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    Journal(str(path)).close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO calls (call_id, owner, provider, request, options, state, "
                   "created) VALUES ('old', 'local', 'emu', ?, ?, 'pending', 0)",
                   (msgpack.packb(_request(10)), msgpack.packb({})))
    journal = Journal(str(path))
    [call] = journal.unfinished()
    assert call.call_id == "old" and call.request == _request(10)
    journal.close()


def test_the_fields_the_daemon_set_are_kept_beside_the_frame(tmp_path: Path) -> None:
    """A cap filled in on admission (`max_tokens`) is not in the frame the
    client sent: recovery (and the worker) get the request with it."""
    journal = Journal(str(tmp_path / "journal.db"))
    _add(journal, "capped", FILE_BYTES, {"max_tokens": 5})
    _stored(journal)
    journal.commit()
    [call] = journal.unfinished()
    assert call.request == {**_request(FILE_BYTES), "max_tokens": 5}
    assert call.request_file == str(tmp_path / "requests" / "capped")
    assert call.request_overrides == {"max_tokens": 5}
    journal.close()


def test_the_end_of_a_call_without_a_file_asks_nothing_of_the_disk(tmp_path: Path) -> None:
    """Its done is in the transcript (which recovery reads first) and it has
    no file to remove: its end joins the next sync, never asks for one. A
    call with a file asks, and its file goes once the end is durable."""
    journal = Journal(str(tmp_path / "journal.db"))
    assert not _add(journal, "small", 100)
    assert _add(journal, "large", FILE_BYTES)
    assert _stored(journal) == [("large", None)]
    accepted: list[str] = []
    journal.commit(then=lambda: accepted.append("both"))
    _synced(journal)
    assert accepted == ["both"]
    fsyncs = journal.fsyncs()
    journal.finish_call("small", "completed")
    journal.commit()
    readable, _, _ = select.select([journal.sync_fileno()], [], [], 0.5)
    assert not readable and journal.fsyncs() == fsyncs, "the journal synced for a fileless end"
    journal.finish_call("large", "completed")
    journal.commit()
    _synced(journal)
    assert journal.fsyncs() == fsyncs + 1
    assert not (journal.files.dir / "large").exists()
    journal.close()
