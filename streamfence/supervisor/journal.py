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
    idempotency_key TEXT UNIQUE,
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
    done BLOB
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


@dataclass(frozen=True, slots=True)
class JournaledCall:
    call_id: str
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

    def add_call(self, call_id: str, idempotency_key: str | None, session_id: str | None,
                 provider: str, request: dict[str, Any], options: dict[str, Any]) -> None:
        self._begin()
        self._db.execute(
            "INSERT INTO calls (call_id, idempotency_key, session_id, provider, request, "
            "options, state, created) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
            (call_id, idempotency_key, session_id, provider,
             msgpack.packb(request), msgpack.packb(options), time.time()))

    def call_by_idempotency_key(self, key: str) -> str | None:
        row = self._db.execute("SELECT call_id FROM calls WHERE idempotency_key = ?",
                               (key,)).fetchone()
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

    def exists(self, call_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM calls WHERE call_id = ?",
                                (call_id,)).fetchone() is not None

    def unfinished(self) -> list[JournaledCall]:
        rows = self._db.execute(
            "SELECT call_id, idempotency_key, session_id, provider, request, options, state, "
            "epoch, attempts, created FROM calls WHERE state != 'done' ORDER BY created"
        ).fetchall()
        return [JournaledCall(r[0], r[1], r[2], r[3], msgpack.unpackb(r[4], raw=False),
                              msgpack.unpackb(r[5], raw=False), r[6], r[7], r[8], r[9])
                for r in rows]

    def attempts_of(self, call_id: str) -> list[dict[str, Any]]:
        cur = self._db.execute("SELECT * FROM attempts WHERE call_id = ? ORDER BY attempt",
                               (call_id,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def close(self) -> None:
        self.commit()
        self._db.close()
