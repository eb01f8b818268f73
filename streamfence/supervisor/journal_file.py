"""journal.db as a file: its tables, the migrations of journals written
before calls had owners and before attempts named their deployment, the statements a prune runs (the daemon's, in
`Journal.prune`, and `prune_journal`'s, for `streamfence prune` from another
process), and the record an unfinished call is read back as
(`JournaledCall`).

A prune deletes finished calls (`state = 'done'`) whose `finished` is older
than the retention, with their `attempts` and `requests` rows, and moves
`meta.pruned_through` to the newest `finished` it removed: the start's
pairing check (supervisor/storepair.py) takes a finished call that the
transcript holds and the journal does not for pruned, not lost, only up to
there. SQLite reuses the freed pages, so under steady load the file stops
growing. `prune_journal` runs with or without a running daemon (a busy
timeout rides out the daemon's transactions).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from streamfence.protocol import retention

# The store pair's rows (supervisor/storepair.py): store_id, generation, and
# pruned_through, which a prune moves in the transaction that deletes the call.
META_TABLE = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID"

SCHEMA = """
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
    model TEXT,  -- the request's, for the `calls` list (nil in journals of earlier versions)
    taken_from TEXT,  -- cluster mode, a call taken over: the host that owned it before ...
    taken_epoch INTEGER,  -- ... and the epoch this host took it at (nil: accepted here)
    UNIQUE (owner, idempotency_key)
);
CREATE INDEX IF NOT EXISTS calls_finished ON calls (finished) WHERE state = 'done';
-- The `calls` list, newest first: all of them, or one owner's (supervisor/calls_view.py).
CREATE INDEX IF NOT EXISTS calls_created ON calls (created);
CREATE INDEX IF NOT EXISTS calls_owner_created ON calls (owner, created);
CREATE TABLE IF NOT EXISTS requests (
    call_id TEXT PRIMARY KEY,
    request BLOB NOT NULL,  -- in_file: only the fields the daemon set (`overrides`)
    options BLOB NOT NULL,
    in_file INTEGER NOT NULL DEFAULT 0  -- the request is the submit frame in requests/<call_id>
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
    profile TEXT,  -- the attempt's deployment: its provider profile ...
    model TEXT,  -- ... and the model it asked for
    chars INTEGER,  -- the visible characters the sink accepted of it (nil: earlier versions)
    refused INTEGER,  -- the deltas the sink's fence refused of it (nil: none, or unknown)
    PRIMARY KEY (call_id, attempt)
);
""" + META_TABLE + ";\n"

FINISHED_INDEX = ("CREATE INDEX IF NOT EXISTS calls_finished ON calls (finished) "
                   "WHERE state = 'done'")
OLDEST_DONE = ("SELECT call_id FROM calls WHERE state = 'done' AND finished < ? "
                "ORDER BY finished LIMIT ?")
PRUNE_DELETES = ("DELETE FROM attempts WHERE call_id = ?", "DELETE FROM requests WHERE call_id = ?",
                  "INSERT INTO meta (key, value) SELECT 'pruned_through', finished FROM calls "
                  "WHERE call_id = ? ON CONFLICT (key) DO UPDATE SET "
                  "value = max(value, excluded.value)",
                  "DELETE FROM calls WHERE call_id = ?")

# What a faulted journal with no kept writes writes to learn that it can again.
PROBE = ("INSERT INTO meta (key, value) VALUES ('written', ?) "
          "ON CONFLICT (key) DO UPDATE SET value = excluded.value")

# Columns added since (journals of earlier versions get them, nil, at open).
ADDED_COLUMNS = (("attempts", "profile", "TEXT"), ("attempts", "model", "TEXT"),
                 ("calls", "model", "TEXT"), ("attempts", "chars", "INTEGER"),
                 ("attempts", "refused", "INTEGER"), ("calls", "taken_from", "TEXT"),
                 ("calls", "taken_epoch", "INTEGER"))

# Journals written before calls had owners: their calls belong to `local`.
ADD_OWNERS = """
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
    request_file: str | None = None  # a large request's file (the worker reads it) ...
    request_overrides: dict[str, Any] | None = None  # ... and the fields the daemon set



def prune_journal(path: str, older_than: float, batch: int = retention.BATCH,
                  budget_s: float = 0.01, pause_s: float = 0.01) -> int:
    """Delete every finished call of the journal at `path` whose `finished` is
    before `older_than` (wall clock), and its attempts, in transactions of at
    most `batch` calls and about `budget_s`, with a pause between them (a
    running daemon gets its turns in between). For `streamfence prune`;
    returns the calls deleted."""
    db = sqlite3.connect(path, timeout=retention.BUSY_TIMEOUT_S)
    try:
        db.execute(META_TABLE)  # a journal no daemon of this version has opened lacks it
    finally:
        db.close()
    return retention.prune_file(path, FINISHED_INDEX, OLDEST_DONE, PRUNE_DELETES,
                                older_than, batch, budget_s, pause_s)
