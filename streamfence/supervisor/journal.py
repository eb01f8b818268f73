"""The durable call journal (SQLite, WAL).

A call is acknowledged (`accepted`) only after its row is committed
(synchronous=FULL: the ack survives a power cut, not just a crash). The
supervisor groups the submits of one loop turn into one transaction, so the
cost is one fsync per turn, not per call.

Attempt epochs are journaled before the sink is asked to authorize them, so
an attempt number is never reused across restarts (Kafka-style producer
epochs). The journal never holds a credential: requests carry none, and
profiles name environment variables only.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from streamfence.protocol.internal.outcome import AttemptOutcome

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    call_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    idempotency_key TEXT,
    session_id TEXT,
    provider TEXT NOT NULL,
    request BLOB NOT NULL,
    options BLOB NOT NULL,
    state TEXT NOT NULL,
    status TEXT,
    epoch INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    finished REAL,
    done BLOB,
    UNIQUE (owner, idempotency_key)
);
CREATE TABLE IF NOT EXISTS attempts (
    call_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    started REAL NOT NULL,
    ended REAL,
    worker_pid INTEGER,
    how TEXT,
    finish_reason TEXT,
    error_class TEXT,
    error_code TEXT,
    first_chunk_ms REAL,
    chunks INTEGER,
    bytes INTEGER,
    deltas INTEGER,
    PRIMARY KEY (call_id, attempt)
);
"""


# Journals written before calls had owners: their calls belong to `local`.
_ADD_OWNERS = """
ALTER TABLE calls RENAME TO calls_v0;
{schema}
INSERT INTO calls (call_id, owner, idempotency_key, session_id, provider, request, options,
                   state, status, epoch, attempts, created, finished, done)
    SELECT call_id, 'local', idempotency_key, session_id, provider, request, options, state,
           status, epoch, attempts, created, finished, done FROM calls_v0;
DROP TABLE calls_v0;
"""


@dataclass(frozen=True, slots=True)
class JournaledCall:
    call_id: str
    owner: str
    idempotency_key: str | None
    session_id: str | None
    provider: str
    request: dict[str, Any]
    options: dict[str, Any]
    state: str
    epoch: int
    attempts: int
    created: float  # wall-clock seconds


class Journal:
    """Owns journal.db: every accepted call, each attempt's epoch and end, each
    finished call's done event. Writes are grouped until `commit`."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(calls)")}
        if columns and "owner" not in columns:
            self._db.executescript("BEGIN;" + _ADD_OWNERS.format(schema=_SCHEMA) + "COMMIT;")
        self._db.executescript(_SCHEMA)
        self._in_tx = False

    def _begin(self) -> None:
        if not self._in_tx:
            self._db.execute("BEGIN")
            self._in_tx = True

    def commit(self) -> None:
        if self._in_tx:
            self._db.execute("COMMIT")
            self._in_tx = False

    def add_call(self, call_id: str, owner: str, idempotency_key: str | None,
                 session_id: str | None, provider: str, request: dict[str, Any],
                 options: dict[str, Any]) -> None:
        self._begin()
        self._db.execute(
            "INSERT INTO calls (call_id, owner, idempotency_key, session_id, provider, request, "
            "options, state, created) VALUES (?, ?, ?, ?, ?, ?, ?, 'pending', ?)",
            (call_id, owner, idempotency_key, session_id, provider,
             msgpack.packb(request), msgpack.packb(options), time.time()))

    def call_by_idempotency_key(self, owner: str, key: str) -> str | None:
        """Idempotency keys are scoped to their owner: another identity's key is
        another key."""
        row = self._db.execute("SELECT call_id FROM calls WHERE owner = ? AND "
                               "idempotency_key = ?", (owner, key)).fetchone()
        return None if row is None else str(row[0])

    def owner_of(self, call_id: str) -> str | None:
        """The identity that submitted `call_id`, or None if there is no such call."""
        row = self._db.execute("SELECT owner FROM calls WHERE call_id = ?",
                               (call_id,)).fetchone()
        return None if row is None else str(row[0])

    def start_attempt(self, call_id: str, attempt: int) -> None:
        self._begin()
        self._db.execute("UPDATE calls SET epoch = ?, attempts = attempts + 1, state = 'running' "
                         "WHERE call_id = ?", (attempt, call_id))
        self._db.execute("INSERT OR REPLACE INTO attempts (call_id, attempt, started) "
                         "VALUES (?, ?, ?)", (call_id, attempt, time.time()))

    def set_attempt_pid(self, call_id: str, attempt: int, pid: int) -> None:
        self._begin()
        self._db.execute("UPDATE attempts SET worker_pid = ? WHERE call_id = ? AND attempt = ?",
                         (pid, call_id, attempt))

    def end_attempt(self, call_id: str, attempt: int, how: str,
                    outcome: AttemptOutcome | None) -> None:
        """`how`: "ended" (its final was accepted) or why it was fenced."""
        finish_reason = error_class = error_code = None
        diag: tuple[float | None, int | None, int | None, int | None] = (None, None, None, None)
        if outcome is not None:
            finish_reason = outcome.finish_reason
            if outcome.error is not None:
                error_class, error_code = outcome.error.error_class.value, outcome.error.code
            d = outcome.diag
            diag = (d.first_chunk_ms, d.chunks, d.bytes, d.deltas)
        self._begin()
        self._db.execute(
            "UPDATE attempts SET ended = ?, how = ?, finish_reason = ?, error_class = ?, "
            "error_code = ?, first_chunk_ms = ?, chunks = ?, bytes = ?, deltas = ? "
            "WHERE call_id = ? AND attempt = ?",
            (time.time(), how, finish_reason, error_class, error_code, *diag, call_id, attempt))

    def finish_call(self, call_id: str, status: str, done: dict[str, Any]) -> None:
        self._begin()
        self._db.execute("UPDATE calls SET state = 'done', status = ?, finished = ?, done = ? "
                         "WHERE call_id = ?",
                         (status, time.time(), msgpack.packb(done), call_id))
        self.commit()

    def done_event(self, call_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT done FROM calls WHERE call_id = ?", (call_id,)).fetchone()
        if row is None or row[0] is None:
            return None
        done: dict[str, Any] = msgpack.unpackb(row[0], raw=False)
        return done

    def unfinished(self) -> list[JournaledCall]:
        rows = self._db.execute(
            "SELECT call_id, owner, idempotency_key, session_id, provider, request, options, "
            "state, epoch, attempts, created FROM calls WHERE state != 'done' ORDER BY created"
        ).fetchall()
        return [JournaledCall(r[0], r[1], r[2], r[3], r[4], msgpack.unpackb(r[5], raw=False),
                              msgpack.unpackb(r[6], raw=False), r[7], r[8], r[9], r[10])
                for r in rows]

    def attempts_of(self, call_id: str) -> list[dict[str, Any]]:
        cur = self._db.execute("SELECT * FROM attempts WHERE call_id = ? ORDER BY attempt",
                               (call_id,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def close(self) -> None:
        self.commit()
        self._db.close()
