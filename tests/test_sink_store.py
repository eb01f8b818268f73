"""The transcript store: runs of events, replay from any seq, read-only reader, epochs."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from streamfence.protocol.codec import encode
from streamfence.protocol.messages import CallStatus, delta_event, done_event, reset_event
from streamfence.sink.store import TranscriptStore
from streamfence.sink.transcript import (
    TranscriptReader,
    answer_so_far,
    max_epochs,
    read_events_after,
    split_events,
)


def deltas(call: str, attempt: int, first_seq: int, texts: list[str]) -> list[bytes]:
    return [encode(delta_event(call, attempt, first_seq + i, "text", t))
            for i, t in enumerate(texts)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TranscriptStore]:
    s = TranscriptStore(str(tmp_path / "t.db"))
    yield s
    s.close()


def test_wal_mode_and_schema(store: TranscriptStore) -> None:
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"events", "calls", "meta"} <= tables
    conn.close()


def test_split_events_returns_each_encoded_event() -> None:
    events = [*deltas("c", 1, 1, ["a", "b" * 300, ""]), encode({"k": [1, {"x": b"\x00"}]})]
    assert split_events(b"".join(events)) == events


def test_the_answer_so_far_is_after_the_last_reset_of_the_attempts_that_wrote_it() -> None:
    """One definition for the sink (a reload) and the supervisor (its stats)."""
    tool = encode(delta_event("c", 2, 7, "tool_call", {"index": 0, "name": "f"}))
    events = [*deltas("c", 1, 1, ["void"]), encode(reset_event("c", 2, 2)),
              *deltas("c", 2, 3, ["ab ", " c"]), *deltas("c", 3, 5, ["d"]),
              *deltas("c", 4, 6, ["later"]), tool]
    both = answer_so_far(events, 2, 3)  # a rebound answer: attempts 2 and 3 wrote it
    assert both.text == ["ab ", " c", "d"] and both.tools == [tool_data(tool)]
    assert (both.deltas(), both.visible_chars(), both.tool_fragments()) == (4, 4, 1)
    newest = answer_so_far(events, None, 99)  # after a restart: the newest attempt's
    assert newest.text == ["later"] and newest.deltas() == 1
    assert answer_so_far([*events, encode(reset_event("c", 5, 8))], 1, 5).deltas() == 0


def tool_data(event: bytes) -> object:
    return msgpack.unpackb(event)["data"]


def test_replay_across_runs_from_any_seq(store: TranscriptStore) -> None:
    run1 = deltas("c", 1, 1, ["a", "b", "c"])
    reset = encode(reset_event("c", 2, 4))
    run2 = deltas("c", 2, 5, ["x", "y"])
    store.add_run("c", 1, 1, run1)
    store.set_epoch("c", 1)
    store.commit()
    store.add("c", 4, 4, 2, "reset", reset)
    store.add_run("c", 5, 2, run2)
    store.set_epoch("c", 2)
    assert store.commit() == 2
    everything = [*run1, reset, *run2]
    for from_seq in range(0, 8):
        got = read_events_after(store.path, "c", from_seq)
        assert got == everything[from_seq:], from_seq
        assert [msgpack.unpackb(e)["seq"] for e in got] == list(range(from_seq + 1, 7))


def test_uncommitted_rows_are_invisible_to_readers(store: TranscriptStore) -> None:
    store.add_run("c", 1, 1, deltas("c", 1, 1, ["a"]))
    assert read_events_after(store.path, "c", 0) == []
    store.commit()
    assert len(read_events_after(store.path, "c", 0)) == 1


def test_a_commit_of_one_run_is_its_own_transaction(store: TranscriptStore) -> None:
    """At a model's pace a commit holds one run: one INSERT in autocommit, no
    BEGIN/COMMIT. Nothing is left open, and the next commit works as any."""
    store.add_run("c", 1, 1, deltas("c", 1, 1, ["a"]))
    assert store.commit() == 1
    assert not store._conn.in_transaction
    assert len(read_events_after(store.path, "c", 0)) == 1
    store.add_run("c", 2, 1, deltas("c", 1, 2, ["b", "c"]))
    store.set_epoch("c", 1)
    assert store.commit() == 1
    assert len(read_events_after(store.path, "c", 0)) == 3
    assert max_epochs(store.path) == {"c": 1}


def test_epochs_only_grow_and_done_is_recorded(store: TranscriptStore) -> None:
    store.set_epoch("c", 3)
    store.set_epoch("c", 2)
    store.set_epoch("d", 1)
    store.commit()
    assert max_epochs(store.path) == {"c": 3, "d": 1}
    assert {r.call_id for r in store.unfinished_calls()} == {"c", "d"}
    body = encode(done_event("c", 1, CallStatus.COMPLETED, None, None, 3))
    store.add("c", 1, 1, 3, "done", body)
    store.set_done("c", 3, "completed", 1)
    store.commit()
    assert [r.call_id for r in store.unfinished_calls()] == ["d"]
    row = store.call_row("c")
    assert row is not None and row.status == "completed" and row.last_seq == 1
    reader = TranscriptReader(store.path)
    try:
        assert reader.done_event("c") == body
        assert reader.done_event("d") is None
        assert [r.max_epoch for r in reader.calls(["c"])] == [3]
    finally:
        reader.close()


def test_reader_cannot_write(store: TranscriptStore) -> None:
    store.set_epoch("c", 1)
    store.commit()
    reader = TranscriptReader(store.path)
    try:
        with pytest.raises(sqlite3.OperationalError):
            reader._conn.execute("DELETE FROM calls")
    finally:
        reader.close()


def test_a_duplicate_seq_rolls_the_batch_back(store: TranscriptStore) -> None:
    store.add_run("c", 1, 1, deltas("c", 1, 1, ["a"]))
    store.commit()
    store.add_run("c", 1, 1, deltas("c", 1, 1, ["again"]))
    with pytest.raises(sqlite3.IntegrityError):
        store.commit()
    assert len(store.events_after("c", 0)) == 1


def test_a_version_1_transcript_is_converted_with_every_event(tmp_path: Path) -> None:
    path = str(tmp_path / "v1.db")
    events = deltas("c", 1, 1, ["a", "b", "c"])
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE events (call_id TEXT NOT NULL, seq INTEGER NOT NULL,
            last_seq INTEGER NOT NULL, attempt INTEGER NOT NULL, op TEXT NOT NULL,
            n INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (call_id, seq)) WITHOUT ROWID;
        CREATE TABLE calls (call_id TEXT PRIMARY KEY, max_epoch INTEGER NOT NULL, status TEXT,
            done_seq INTEGER, updated_at REAL NOT NULL) WITHOUT ROWID;
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO calls VALUES ('c', 1, NULL, NULL, 0);
    """)
    conn.execute("INSERT INTO events VALUES ('c', 1, 2, 1, 'delta', 2, ?)",
                 (events[0] + events[1],))
    conn.execute("INSERT INTO events VALUES ('c', 3, 3, 1, 'delta', 1, ?)", (events[2],))
    conn.commit()
    conn.close()
    store = TranscriptStore(path)
    try:
        assert store.events_after("c", 0) == events and store.events_after("c", 2) == events[2:]
        store.add_run("c", 4, 1, deltas("c", 1, 4, ["d"]))
        store.commit()
        assert len(store.events_after("c", 0)) == 4
    finally:
        store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta").fetchall() == [("2",)]
    assert "events_v1" not in {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()


def test_a_newer_transcript_is_refused_untouched(tmp_path: Path) -> None:
    path = str(tmp_path / "v9.db")
    TranscriptStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="schema version 9 is newer"):
        TranscriptStore(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta").fetchall() == [("9",)]
    conn.close()


def test_the_wal_is_rewound_while_the_writer_never_stops(tmp_path: Path) -> None:
    """A PASSIVE checkpoint never rewinds the WAL while commits keep coming
    (each one lands during the checkpoint's fsyncs), so under steady load the
    -wal file grew without end (888 MB after 20 s at 20k deltas/s). The store
    rewinds it itself, right after a checkpoint found it past its limit."""
    limit = 1 << 20
    store = TranscriptStore(str(tmp_path / "t.db"), wal_limit_bytes=limit, checkpoint_every_s=0.01)
    wal = Path(store.path + "-wal")
    try:
        seq = 0
        while store.wal_rewinds < 3:  # the checkpointer runs every 10 ms meanwhile
            seq += 1
            store.add_run("c", seq, 1, deltas("c", 1, seq, ["x" * 60]))
            store.commit()
            # Without the rewind the file is all the WAL ever written (some 4 KiB a commit).
            assert wal.stat().st_size < 32 * limit, \
                f"the WAL never rewound: {wal.stat().st_size >> 20} MiB after {seq} commits"
        assert len(read_events_after(store.path, "c", 0)) == seq
    finally:
        store.close()
