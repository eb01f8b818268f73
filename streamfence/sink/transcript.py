"""The transcript's format, and the one way to read it: transcript.db (SQLite,
WAL), written only by the sink (`sink.store.TranscriptStore`), read by the
sink and by other processes through this module alone.

Schema (`SCHEMA_VERSION` 2):

    events(id, call_id, seq, last_seq, attempt, op, n, body)
        An ordinary rowid table (`id`), so a group commit appends its rows at
        the end of the table whatever calls they belong to; the unique index
        `events_by_call` (call_id, seq) serves every read. (Version 1 keyed
        the table itself by (call_id, seq): with many calls running, each
        commit touched a page per call. Measured at 8 producers x 32 calls:
        see docs/PERFORMANCE.md, section 2.) A version 1 file is converted
        in one transaction when the sink opens it.
        One row is a run of consecutive public events of one call and one
        attempt that were committed together: `body` is their encoded bytes
        (the exact msgpack maps subscribers receive) concatenated in seq order,
        `seq`..`last_seq` their public seqs, `n` their count. `op` is
        'delta' (a run of deltas), 'reset' or 'done' (one event each).
    calls(call_id, max_epoch, status, done_seq, updated_at)
        The highest epoch seen per call (durable before the sink acks an
        authorize) and, once the call is done, its status and done seq.
        Index `calls_finished` (updated_at) WHERE status IS NOT NULL: the
        finished calls by age, for retention.
    meta(key, value)
        schema_version, and the store pair's store_id and generation
        (written by the supervisor before it starts the sink:
        supervisor/storepair.py).

Why runs instead of a row per event: on this class of machine one row per
delta costs ~4-5 us in sqlite3 (binding a blob dominates), which alone caps
the sink below 200k deltas/s; a row per call per group commit costs the same
once per run. Replay stays a straight read: split each body at msgpack object
boundaries (`Unpacker.skip` + `tell`, no decoding).

The answer so far (`answer_so_far`): the deltas after the call's last reset
event, of the attempts that wrote that answer. The sink reloads it after a
restart or for a rebind; the supervisor counts it when the sink cannot say
(`visible_stats`).

Readers: the queries below take a connection (the sink's writer, or a
`TranscriptReader`'s read-only one). Other processes use `TranscriptReader`
or the one-shot functions; `calls_sql` lets the supervisor join the calls
table with the journal's; `prune_transcript` is `streamfence prune`'s delete
(the sink prunes its own file through the store), made of this module's
statements.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sqlite3
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgpack

from streamfence.protocol import retention
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.internal.control import AttemptStats
from streamfence.protocol.sqlite_faults import is_damage, is_storage_fault
from streamfence.sink.content import Content

SCHEMA_VERSION = 2

EVENTS_TABLE = """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY,
        call_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        op TEXT NOT NULL,
        n INTEGER NOT NULL,
        body BLOB NOT NULL
    )"""
EVENT_COLUMNS = "call_id, seq, last_seq, attempt, op, n, body"
META_TABLE = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID"
FINISHED_INDEX = ("CREATE INDEX IF NOT EXISTS calls_finished ON calls (updated_at) "
                  "WHERE status IS NOT NULL")
SCHEMA = (
    EVENTS_TABLE,
    "CREATE UNIQUE INDEX IF NOT EXISTS events_by_call ON events (call_id, seq)",
    """CREATE TABLE IF NOT EXISTS calls (
        call_id TEXT PRIMARY KEY,
        max_epoch INTEGER NOT NULL,
        status TEXT,
        done_seq INTEGER,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID""",
    META_TABLE,
    FINISHED_INDEX,
)

# Retention (protocol/retention.py): the finished calls oldest first, and a call's rows.
OLDEST_FINISHED = ("SELECT call_id FROM calls WHERE status IS NOT NULL AND updated_at < ? "
                   "ORDER BY updated_at LIMIT ?")
PRUNE_DELETES = ("DELETE FROM events WHERE call_id = ?", "DELETE FROM calls WHERE call_id = ?")
PRUNE_BATCH = retention.BATCH  # finished calls deleted per transaction, at most

Row = tuple[str, int, int, int, str, int, bytes]  # an events row: EVENT_COLUMNS

log = logging.getLogger("streamfence.transcript")
_DAMAGE_LOGGED: set[str] = set()  # files whose damage `stored_done` logged (once each)


class CallRow(NamedTuple):
    call_id: str
    max_epoch: int
    status: str | None  # None while the call runs
    last_seq: int  # last public seq stored for the call (0: none)


def split_events(body: bytes) -> list[bytes]:
    """The encoded events of one `events.body`, each as its own bytes."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(body), 1))
    unpacker.feed(body)
    out: list[bytes] = []
    start = 0
    while start < len(body):
        unpacker.skip()
        end = unpacker.tell()
        out.append(body[start:end])
        start = end
    return out


def answer_so_far(events: Iterable[bytes], first: int | None, last: int) -> Content:
    """The content of a call's answer so far, from its stored `events` in seq
    order (pure): the deltas after the last reset of attempts `first`..`last`
    (the attempts that wrote it together: a rebound answer's events all carry
    the attempt that began it). `first` None: of the newest attempt number
    among those deltas, whatever `last` (after a restart, where the store's
    epoch alone would find none of a rebound answer)."""
    deltas: list[tuple[dict[str, Any], bytes]] = []
    for body in events:
        event = msgpack.unpackb(body)
        if event.get("op") == "reset":
            deltas.clear()
        elif event.get("op") == "delta":
            deltas.append((event, body))
    if first is None:
        first = last = max((e["attempt"] for e, _ in deltas), default=0)
    content = Content()
    add = content.add
    for event, body in deltas:
        if first <= event["attempt"] <= last:
            add[event["kind"]](event["data"])
            content.stored([body])  # the answer held in memory is bounded
    return content


# ---- queries on any connection to the file ---------------------------------------

def events_after(conn: sqlite3.Connection, call_id: str, from_seq: int = 0,
                 max_rows: int = -1) -> list[bytes]:
    """Stored events of `call_id` after `from_seq`, in seq order, from at most
    `max_rows` rows (-1: all), each exactly as a subscriber receives it."""
    # From the row holding from_seq + 1 (found by the index, not by a scan of the
    # call's earlier rows): a replay in slices reads each row once.
    rows = conn.execute(
        "SELECT seq, body FROM events WHERE call_id = ?1 AND last_seq > ?2 AND seq >= "
        "(SELECT coalesce(max(seq), 0) FROM events WHERE call_id = ?1 AND seq <= ?2 + 1) "
        "ORDER BY seq LIMIT ?3",
        (call_id, from_seq, max_rows),
    ).fetchall()
    out: list[bytes] = []
    for seq, body in rows:
        events = split_events(body)
        skip = from_seq - seq + 1  # events of this row at or before from_seq
        out.extend(events[skip:] if skip > 0 else events)
    return out


def done_event(conn: sqlite3.Connection, call_id: str) -> bytes | None:
    """The encoded `done` event of a finished call, or None."""
    row = conn.execute(
        "SELECT body FROM events WHERE call_id = ? AND op = 'done' ORDER BY seq DESC LIMIT 1",
        (call_id,),
    ).fetchone()
    return None if row is None else bytes(row[0])


def _last_seq(conn: sqlite3.Connection, call_id: str) -> int:
    row = conn.execute(
        "SELECT last_seq FROM events WHERE call_id = ? ORDER BY seq DESC LIMIT 1", (call_id,)
    ).fetchone()
    return 0 if row is None else int(row[0])


def call_row(conn: sqlite3.Connection, call_id: str) -> CallRow | None:
    row = conn.execute(
        "SELECT max_epoch, status FROM calls WHERE call_id = ?", (call_id,)
    ).fetchone()
    if row is None:
        return None
    return CallRow(call_id, int(row[0]), row[1], _last_seq(conn, call_id))


def unfinished_calls(conn: sqlite3.Connection) -> list[CallRow]:
    """Calls without a done event: the fence table and seqs to rebuild at start."""
    rows = conn.execute("SELECT call_id, max_epoch FROM calls WHERE status IS NULL").fetchall()
    return [CallRow(c, int(e), None, _last_seq(conn, c)) for c, e in rows]


def calls_sql(schema: str) -> str:
    """A SELECT of every call of the transcript attached as `schema`, as
    (call_id, epoch, finished, updated_at): for a query that joins them with
    another file's (supervisor/storepair.py)."""
    return f"SELECT call_id, max_epoch, status IS NOT NULL, updated_at FROM {schema}.calls"


# ---- other processes ---------------------------------------------------------------

class TranscriptReader:
    """Read-only access for other processes (replay, results, epochs)."""

    def __init__(self, path: str) -> None:
        # mode=ro: this connection can never write, whatever the caller does.
        uri = pathlib.Path(path).absolute().as_uri() + "?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)

    def made(self) -> bool:
        """Whether the sink has made its tables here: a first start stamps the
        file (supervisor/storepair.py) before its sink starts."""
        return self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                  "AND name = 'events'").fetchone() is not None

    def events_after(self, call_id: str, from_seq: int = 0) -> list[bytes]:
        """The stored public events of `call_id` with seq > from_seq, in seq order,
        each exactly as a subscriber receives it."""
        return events_after(self._conn, call_id, from_seq)

    def done_event(self, call_id: str) -> bytes | None:
        """The encoded `done` event of a finished call, or None."""
        return done_event(self._conn, call_id)

    def max_epochs(self) -> dict[str, int]:
        """call_id -> highest attempt epoch the sink has recorded."""
        rows = self._conn.execute("SELECT call_id, max_epoch FROM calls").fetchall()
        return {str(c): int(e) for c, e in rows}

    def calls(self, call_ids: Iterable[str] | None = None) -> list[CallRow]:
        """Per-call rows (all calls when `call_ids` is None)."""
        if call_ids is None:
            ids = [str(r[0]) for r in self._conn.execute("SELECT call_id FROM calls")]
        else:
            ids = list(call_ids)
        return [row for c in ids if (row := call_row(self._conn, c)) is not None]

    def close(self) -> None:
        self._conn.close()


def read_events_after(db_path: str, call_id: str, from_seq: int = 0) -> list[bytes]:
    """One-shot replay read (opens and closes a read-only connection)."""
    reader = TranscriptReader(db_path)
    try:
        return reader.events_after(call_id, from_seq)
    finally:
        reader.close()


def visible_stats(db_path: str, call_id: str, first: int, epoch: int) -> AttemptStats:
    """Attempt `epoch`'s stats as the file holds them, for a supervisor whose
    sink could not say: events are sent only after their commit, so this is
    what subscribers could see. `first`: the attempt whose authorize began the
    answer (a rebound attempt's began earlier; `answer_so_far`)."""
    stored = read_events_after(db_path, call_id) \
        if os.path.exists(db_path) else []  # no sink ever started
    answer = answer_so_far(stored, first, epoch)
    return AttemptStats(epoch, accepted=answer.deltas(), visible_chars=answer.visible_chars(),
                        tool_fragments=answer.tool_fragments())


def stored_done(db_path: str, call_id: str) -> dict[str, Any] | None:
    """One-shot read of a finished call's done event, decoded (None: none
    stored). A file that cannot be read (damage, a storage fault) raises a
    ProtocolError with `storage_error` naming it: the request that asked is
    refused with it; damage is logged once per file."""
    try:
        reader = TranscriptReader(db_path)
        try:
            frame = reader.done_event(call_id)
        finally:
            reader.close()
    except sqlite3.DatabaseError as exc:
        if is_storage_fault(exc):
            raise ProtocolError(ErrorCode.STORAGE_ERROR, f"{db_path} cannot be read "
                                f"({exc}); retry later") from None
        if not is_damage(exc):
            raise  # a bug
        message = (f"{db_path} is damaged ({exc}): the done event of call {call_id} cannot "
                   f"be read; stop the daemon, run `streamfence check`, then restore the "
                   f"file from a backup")
        if db_path not in _DAMAGE_LOGGED:
            _DAMAGE_LOGGED.add(db_path)
            log.error("%s", message)
        raise ProtocolError(ErrorCode.STORAGE_ERROR, message) from None
    if frame is None:
        return None
    done: dict[str, Any] = msgpack.unpackb(frame, raw=False)
    return done


def max_epochs(db_path: str) -> dict[str, int]:
    """One-shot read of the max epoch per call."""
    reader = TranscriptReader(db_path)
    try:
        return reader.max_epochs()
    finally:
        reader.close()


def prune_transcript(db_path: str, older_than: float, batch: int = PRUNE_BATCH,
                     budget_s: float = 0.01, pause_s: float = 0.01) -> int:
    """Delete every finished call of the transcript at `db_path` updated before
    `older_than` (wall clock), with its events, in transactions of at most
    `batch` calls and about `budget_s`, with a pause between them (a running
    sink commits in between). For `streamfence prune`; returns the calls
    deleted."""
    return retention.prune_file(db_path, FINISHED_INDEX, OLDEST_FINISHED, PRUNE_DELETES,
                                older_than, batch, budget_s, pause_s)
