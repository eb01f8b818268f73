"""The durable call journal (SQLite, WAL).

A call is acknowledged (`accepted`) only after its row is committed and the
WAL synced, so the ack survives a power cut, not just a crash. The loop
commits without waiting for the disk (synchronous=NORMAL); what must be
durable first (the `accepted` replies, an attempt's epoch before the sink
hears of it) is a callback of `commit(then=...)`, run by `on_synced` once
the sync thread (streamfence.supervisor.journal_sync) has fsynced the WAL:
one fsync for all the commits before it, never in the loop.

A finished call keeps its status here; its `done` event (the whole answer)
is stored once, in the sink's transcript, where `result` and `cancel` read it
(the `done` column is left from earlier versions and no longer written).

A call's request and options are in `requests`, written once, not in its
row of `calls`: SQLite rewrites a whole row on every UPDATE, and a call's row
is updated at each attempt and at its end, so a 12 MB request stored there
was rewritten three times. Journals of earlier versions keep theirs in
`calls` (read where `requests` has none).

A request of `FILE_BYTES` or more is stored as a file instead: the submit
frame as the client sent it (never encoded again: the loop would spend tens
of ms on 12 MB), written and synced by a thread
(streamfence.supervisor.request_files), and read back by the worker and by
recovery (`messages.submitted_request`, with the fields the daemon set on
admission, kept in `requests.request`). Its call's row is
`staging` until then, and the front sends `accepted` only after `stored()`
has said so and the row (now `pending`) is committed. At start, a `staging`
row (never accepted) is deleted with its file, and files of calls that are
done or unknown are removed; a done call's file is removed once its finish is
synced.

Attempt epochs are journaled before the sink is asked to authorize them, so
an attempt number is never reused across restarts (Kafka-style producer
epochs). The journal never holds a credential: requests carry none, and
profiles name environment variables only.

Retention (`[daemon] retention_days`, 0: keep forever): finished calls
(`state = 'done'`) whose `finished` is older than the retention are deleted
with their `attempts` rows, never an unfinished call. The supervisor's loop
calls `prune_tick` every turn and wakes at `prune_due`; it does one small transaction every
`PRUNE_EVERY_S`, or every `PRUNE_BACKLOG_S` while a backlog remains, that
deletes at most `PRUNE_BATCH` calls and stops deleting after
`PRUNE_BUDGET_S`, so no turn is held for more than a few milliseconds
(measured: 0.1-0.2 ms per call). A prune asks for no sync: one lost to a
power cut is done again, and the next sync covers its frames anyway.
SQLite reuses the freed pages, so under steady load the file stops growing.
A prune also moves `meta.pruned_through` to the newest `finished` it removed:
the start's pairing check (supervisor/storepair.py) takes a finished call
that the transcript holds and the journal does not for pruned, not lost,
only up to there. `prune_journal` is the same delete for `streamfence prune`, from another
process, with or without a running daemon (a busy timeout rides out the
daemon's transactions).

Storage faults (docs/ARCHITECTURE.md §4.15): a full disk, an I/O error, or a
lock another process holds past `BUSY_WAIT_S` never raises out of here and
never loses a write. Every write of the unit since the last commit is also
kept as (call, sql, parameters); when one fails, the unit is rolled back
(only if SQLite still has it open: after SQLITE_FULL it may not) and the
journal is `fault`ed: writes are only kept, the callbacks of `commit(then=)`
wait for the commit that writes them, and each `commit` after `retry_due`
writes the kept unit again in one transaction (back-off from `RETRY_FIRST_S`
to `RETRY_MAX_S`) until it commits. The calls the failed unit added were
never accepted: their writes are dropped, and `take_refused` names them for
the front to refuse (with the fault's code), as it refuses every submit while
the fault lasts. Damage (SQLITE_CORRUPT, "not a database") is no such fault:
it raises, and the daemon exits with the error.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from streamfence.protocol import retention
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.internal.outcome import AttemptOutcome
from streamfence.protocol.messages import submitted_request
from streamfence.protocol.sqlite_faults import is_storage_fault
from streamfence.supervisor.journal_sync import WalSyncer
from streamfence.supervisor.request_files import RequestFiles

log = logging.getLogger("streamfence.journal")

# The store pair's rows (supervisor/storepair.py): store_id, generation, and
# pruned_through, which a prune moves in the transaction that deletes the call.
META_TABLE = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID"

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
CREATE INDEX IF NOT EXISTS calls_finished ON calls (finished) WHERE state = 'done';
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
    PRIMARY KEY (call_id, attempt)
);
""" + META_TABLE + ";\n"

FILE_BYTES = 256 << 10  # a request this large (encoded) is stored as a file, off the loop
PRUNE_BATCH = retention.BATCH  # finished calls deleted per transaction, at most ...
PRUNE_BUDGET_S = 0.003  # ... and none after this much time spent deleting (in the loop)
PRUNE_EVERY_S = 5.0  # between prune transactions of the loop ...
PRUNE_BACKLOG_S = 0.05  # ... or this, while finished calls are still due
# A write waits this long for a lock another process holds (`streamfence
# prune` holds one for ~10 ms at a time) before it is a storage fault: the
# loop that waits serves every client, so the wait is short and the fault
# path (keep the writes, retry, refuse new calls) does the rest.
BUSY_WAIT_S = 0.05
RETRY_FIRST_S = 0.05  # a faulted journal tries its kept writes again after this ...
RETRY_MAX_S = 1.0  # ... doubling up to this
REMIND_EVERY_S = 30.0  # a lasting fault is logged again this often

_FINISHED_INDEX = ("CREATE INDEX IF NOT EXISTS calls_finished ON calls (finished) "
                   "WHERE state = 'done'")
_OLDEST_DONE = ("SELECT call_id FROM calls WHERE state = 'done' AND finished < ? "
                "ORDER BY finished LIMIT ?")
_PRUNE_DELETES = ("DELETE FROM attempts WHERE call_id = ?", "DELETE FROM requests WHERE call_id = ?",
                  "INSERT INTO meta (key, value) SELECT 'pruned_through', finished FROM calls "
                  "WHERE call_id = ? ON CONFLICT (key) DO UPDATE SET "
                  "value = max(value, excluded.value)",
                  "DELETE FROM calls WHERE call_id = ?")

# What a faulted journal with no kept writes writes to learn that it can again.
_PROBE = ("INSERT INTO meta (key, value) VALUES ('written', ?) "
          "ON CONFLICT (key) DO UPDATE SET value = excluded.value")

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
class StorageFault:
    """Why the journal cannot commit now: the code refused submits get, and
    the message they read (the file and SQLite's error, never a request)."""

    code: ErrorCode
    message: str
    since: float  # monotonic


def storage_fault(path: str, exc: sqlite3.Error) -> StorageFault | None:
    """The fault `exc` is (protocol/sqlite_faults.py: `is_storage_fault`), or None if it
    is no storage fault (damage, a bug)."""
    if not is_storage_fault(exc):
        return None
    name = exc.sqlite_errorname or ""
    if name == "SQLITE_FULL":
        return StorageFault(ErrorCode.STORAGE_FULL, f"the disk holding {path} is full ({exc}); "
                            f"no new calls until space is freed", time.monotonic())
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return StorageFault(ErrorCode.STORAGE_BUSY, f"{path} is locked by another process "
                            f"({exc}); retry later", time.monotonic())
    return StorageFault(ErrorCode.STORAGE_ERROR, f"{path} cannot be written ({exc}); "
                        f"retry later", time.monotonic())


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


class Journal:
    """Owns journal.db (every accepted call, each attempt's epoch and end, each
    finished call's status) and, through `files`, the large requests' files.
    Writes are grouped until `commit`."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_WAIT_S)
        self.files = RequestFiles(Path(path).parent / "requests")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # the WAL is synced by the WalSyncer
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(calls)")}
        if columns and "owner" not in columns:
            self._db.executescript("BEGIN;" + _ADD_OWNERS.format(schema=_SCHEMA) + "COMMIT;")
        self._db.executescript(_SCHEMA)
        self._sweep()
        self._in_tx = False
        self._remove_after_commit: list[str] = []  # calls the unit finishes: their files go once it commits
        self._syncer = WalSyncer(path)
        self._commits = 0  # COMMITs so far ...
        self._synced = 0  # ... and how many of them are on disk
        self._waiting: deque[tuple[int, Callable[[], object]]] = deque()  # (commit, then)
        self._prune_due = 0.0  # monotonic time of the next prune transaction
        self.prune_more = False  # the last prune left finished calls that were due
        # The unit: every write since the last commit, kept until it commits.
        self._unit: list[tuple[str | None, str, tuple[Any, ...]]] = []  # (call, sql, params)
        self._unit_calls: dict[str, bool] = {}  # calls the unit adds: in a file?
        self.fault: StorageFault | None = None
        self._retry_due = 0.0
        self._retry_wait = RETRY_FIRST_S
        self._reminded = 0.0
        self._refused: list[str] = []  # calls of a failed unit, for `take_refused`
        self._refused_files: set[str] = set()  # ... whose request file is still being written

    def _write(self, call_id: str | None, sql: str, params: tuple[Any, ...]) -> None:
        """One write of the unit: executed now, or, while faulted, only kept."""
        if call_id is not None and call_id in self._refused:
            return  # a call of the failed unit (add_call's second write)
        self._unit.append((call_id, sql, params))
        if self.fault is not None:
            return
        try:
            if not self._in_tx:
                self._db.execute("BEGIN")
                self._in_tx = True
            self._db.execute(sql, params)
        except sqlite3.OperationalError as exc:
            self._failed(exc)

    def _failed(self, exc: sqlite3.OperationalError) -> None:
        """The unit could not be written: roll it back, keep it, refuse its new calls."""
        fault = storage_fault(self._path, exc)
        if fault is None:
            raise exc
        retention.rollback_if_open(self._db)  # after SQLITE_FULL SQLite may have done it
        self._in_tx = False
        if self._unit_calls:
            refused = self._unit_calls
            self._unit = [w for w in self._unit if w[0] not in refused]
            self._refused.extend(refused)
            # Their files are still being written: removed when `stored` hears of them.
            self._refused_files.update(c for c, in_file in refused.items() if in_file)
            self._unit_calls = {}
        if self.fault is None:
            self.fault = fault
            self._reminded = fault.since
            log.error("journal: %s; %d write(s) kept and retried, %d new call(s) refused",
                      fault.message, len(self._unit), len(self._refused))
        self._retry_due = time.monotonic() + self._retry_wait
        self._retry_wait = min(self._retry_wait * 2, RETRY_MAX_S)

    def take_refused(self) -> list[str]:
        """The calls a failed unit added: never accepted (their writes are
        gone); the front refuses them with `fault.code` (once)."""
        refused, self._refused = self._refused, []
        return refused

    def fault_view(self) -> dict[str, Any] | None:
        """The fault for `status` (nil: none): its code, message, how long so far
        and how many writes wait for it."""
        if self.fault is None:
            return None
        return {"code": self.fault.code.value, "message": self.fault.message,
                "for_s": round(time.monotonic() - self.fault.since, 1),
                "writes_kept": len(self._unit)}

    @property
    def retry_due(self) -> float | None:
        """When a faulted journal next tries its kept writes (monotonic)."""
        return self._retry_due if self.fault is not None else None

    def _write_kept(self) -> bool:
        """Write the kept unit again in one transaction; True once it committed.
        An empty unit (its writes were all refused calls') writes a probe row:
        an empty transaction succeeds on a full disk or under a lock."""
        try:
            retention.rollback_if_open(self._db)  # one a failed ROLLBACK left open
            self._db.execute("BEGIN IMMEDIATE")
            for _, sql, params in self._unit or [(None, _PROBE, (time.time(),))]:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            self._failed(exc)
            now = time.monotonic()
            if self.fault is not None and now - self._reminded >= REMIND_EVERY_S:
                self._reminded = now
                log.error("journal: still faulted after %.0fs: %s; %d write(s) kept",
                          now - self.fault.since, exc, len(self._unit))
            return False
        assert self.fault is not None
        log.warning("journal: %s writable again after %.1fs; %d kept write(s) committed",
                    self._path, time.monotonic() - self.fault.since, len(self._unit))
        self.fault = None
        self._retry_wait = RETRY_FIRST_S
        return True

    def commit(self, then: Callable[[], object] | None = None, retry_now: bool = False) -> None:
        """Commit the writes so far, without waiting for the disk; `then` runs
        (from `on_synced`) once they and every earlier commit are durable.
        Faulted: the kept writes are tried again once `retry_due` has come
        (or `retry_now`), and `then` waits for the commit that writes them."""
        committed = False
        if self.fault is not None:
            if retry_now or time.monotonic() >= self._retry_due:
                committed = self._write_kept()
        elif self._in_tx:
            try:
                self._db.execute("COMMIT")
                committed = True
            except sqlite3.OperationalError as exc:
                self._failed(exc)
            self._in_tx = False
        if committed:
            self._commits += 1
            self._unit.clear()
            self._unit_calls.clear()
            if self._waiting:  # what waited out a fault waits for this commit's sync
                self._syncer.request(self._commits)
        if self.fault is not None:
            if then is not None:
                # After every earlier commit: the one that writes the kept unit.
                self._waiting.append((self._commits + 1, then))
            return
        if self._remove_after_commit:
            done = list(self._remove_after_commit)
            self._remove_after_commit.clear()
            self._after_sync(functools.partial(self._remove_files, done))
        if then is not None:
            self._after_sync(then)

    def _remove_files(self, call_ids: list[str]) -> None:
        for call_id in call_ids:
            self.files.remove(call_id)

    def _after_sync(self, then: Callable[[], object]) -> None:
        if self._commits <= self._synced:
            then()
            return
        self._waiting.append((self._commits, then))
        self._syncer.request(self._commits)

    def sync_fileno(self) -> int:
        """Readable when the sync thread has made more commits durable."""
        return self._syncer.fileno()

    def on_synced(self) -> None:
        """Run the callbacks whose commits are durable now (the loop's turn)."""
        self._synced = self._syncer.synced()
        self._run_synced()

    def _run_synced(self) -> None:
        while self._waiting and self._waiting[0][0] <= self._synced:
            self._waiting.popleft()[1]()

    def _sweep(self) -> None:
        """At open: calls still `staging` were never accepted (their file was
        not durable when the daemon stopped): gone, with their rows. Files of
        calls not live (done, or never accepted) are removed."""
        staging = [r[0] for r in self._db.execute(
            "SELECT call_id FROM calls WHERE state = 'staging'")]
        for call_id in staging:
            self._db.execute("DELETE FROM requests WHERE call_id = ?", (call_id,))
            self._db.execute("DELETE FROM calls WHERE call_id = ?", (call_id,))
        if staging:
            log.info("journal: %d call(s) whose request was still being stored were never "
                     "accepted; removed", len(staging))
        live = {r[0] for r in self._db.execute(
            "SELECT call_id FROM calls WHERE state NOT IN ('done', 'staging')")}
        for call_id in self.files.names():
            if call_id not in live:
                self.files.remove(call_id)

    def add_call(self, call_id: str, owner: str, idempotency_key: str | None,
                 session_id: str | None, provider: str, request: dict[str, Any],
                 options: dict[str, Any], frame: bytes | memoryview | None = None,
                 overrides: dict[str, Any] | None = None) -> bool:
        """Journal a new call. `frame`: its submit frame, and `overrides` the
        request's fields the daemon set on admission. True: the frame goes to
        a file, and the call is accepted only once `stored()` names it; False:
        it is in this turn's transaction, accepted at its commit."""
        in_file = frame is not None and len(frame) >= FILE_BYTES
        body = msgpack.packb(overrides or {}) if in_file else msgpack.packb(request)
        if self.fault is not None:  # the front refuses submits meanwhile; so does this
            self._refused.append(call_id)
            return in_file
        self._unit_calls[call_id] = in_file
        self._write(call_id,
                    "INSERT INTO calls (call_id, owner, idempotency_key, session_id, provider, "
                    "request, options, state, created) VALUES (?, ?, ?, ?, ?, x'', x'', ?, ?)",
                    (call_id, owner, idempotency_key, session_id, provider,
                     "staging" if in_file else "pending", time.time()))
        self._write(call_id, "INSERT INTO requests (call_id, request, options, in_file) "
                    "VALUES (?, ?, ?, ?)", (call_id, body, msgpack.packb(options), in_file))
        if call_id in self._refused:
            return in_file  # the write failed: the front refuses the call (no file to write)
        if in_file:
            assert frame is not None
            self.files.write(call_id, frame)
        return in_file

    def request_file(self, call_id: str) -> str:
        """Where a call's request file is (for the worker that runs it)."""
        return str(self.files.dir / call_id)

    def stored(self) -> list[tuple[str, OSError | None]]:
        """The staging calls whose request file is now durable (their rows turn
        `pending` in this turn's transaction), or could not be written (their
        rows are deleted: never accepted); the loop asks when `files` wakes it."""
        written = []
        for call_id, error in self.files.written():
            if call_id in self._refused_files:  # its row was never committed: refused
                self._refused_files.discard(call_id)
                self.files.remove(call_id)
                continue
            written.append((call_id, error))
            if error is None:
                self._write(call_id, "UPDATE calls SET state = 'pending' WHERE call_id = ? AND "
                            "state = 'staging'", (call_id,))
            else:
                self._write(call_id, "DELETE FROM requests WHERE call_id = ?", (call_id,))
                self._write(call_id, "DELETE FROM calls WHERE call_id = ?", (call_id,))
        return written

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
        self._write(call_id, "UPDATE calls SET epoch = ?, attempts = attempts + 1, "
                    "state = 'running' WHERE call_id = ?", (attempt, call_id))
        self._write(call_id, "INSERT OR REPLACE INTO attempts (call_id, attempt, started) "
                    "VALUES (?, ?, ?)", (call_id, attempt, time.time()))

    def rebind_attempt(self, call_id: str, attempt: int, new_attempt: int) -> None:
        """After a sink restart the running `attempt` goes on as `new_attempt`:
        a new epoch, not a new provider attempt (`attempts` stays)."""
        self.end_attempt(call_id, attempt, "rebound", None)
        self._write(call_id, "UPDATE calls SET epoch = ? WHERE call_id = ?",
                    (new_attempt, call_id))
        self._write(call_id, "INSERT OR REPLACE INTO attempts (call_id, attempt, started) "
                    "VALUES (?, ?, ?)", (call_id, new_attempt, time.time()))

    def set_attempt_pid(self, call_id: str, attempt: int, pid: int) -> None:
        self._write(call_id, "UPDATE attempts SET worker_pid = ? WHERE call_id = ? AND "
                    "attempt = ?", (pid, call_id, attempt))

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
        self._write(
            call_id, "UPDATE attempts SET ended = ?, how = ?, finish_reason = ?, "
            "error_class = ?, error_code = ?, first_chunk_ms = ?, chunks = ?, bytes = ?, "
            "deltas = ? WHERE call_id = ? AND attempt = ?",
            (time.time(), how, finish_reason, error_class, error_code, *diag, call_id, attempt))

    def finish_call(self, call_id: str, status: str) -> None:
        """The call is done. Its done event is already in the transcript, which
        recovery reads first, so this joins the turn's transaction instead of
        syncing on its own; its request file goes once that has committed."""
        self._write(call_id, "UPDATE calls SET state = 'done', status = ?, finished = ?, "
                    "done = NULL WHERE call_id = ?", (status, time.time(), call_id))
        self._remove_after_commit.append(call_id)

    def is_moved(self, call_id: str) -> bool:
        """Cluster mode: another host owns the call now (calls.MOVED)."""
        row = self._db.execute("SELECT status FROM calls WHERE call_id = ?",
                               (call_id,)).fetchone()
        return row is not None and row[0] == "moved"

    def take_back(self, call_id: str) -> None:
        """Cluster mode: a call this host had moved away is its own again (won
        back from a host that lost its lease): its old rows go, so that it is
        journaled anew (its attempts' rows stay: later epochs are new rows)."""
        if self.is_moved(call_id):
            self._write(call_id, "DELETE FROM requests WHERE call_id = ?", (call_id,))
            self._write(call_id, "DELETE FROM calls WHERE call_id = ?", (call_id,))

    def is_finished(self, call_id: str) -> bool:
        if call_id in self._remove_after_commit:  # finished in the unit not yet committed
            return True
        row = self._db.execute("SELECT state FROM calls WHERE call_id = ?", (call_id,)).fetchone()
        return row is not None and row[0] == "done"

    def unfinished(self) -> list[JournaledCall]:
        rows = self._db.execute(
            "SELECT call_id, owner, idempotency_key, session_id, provider, "
            "COALESCE(q.request, c.request), COALESCE(q.options, c.options), state, epoch, "
            "attempts, created, COALESCE(q.in_file, 0) "
            "FROM calls c LEFT JOIN requests q USING (call_id) "
            "WHERE state NOT IN ('done', 'staging') ORDER BY created").fetchall()
        calls = []
        for r in rows:
            request = overrides = msgpack.unpackb(r[5], raw=False)
            if r[11]:
                try:
                    request = submitted_request(self.files.read(r[0]), overrides)
                except (OSError, ProtocolError, KeyError, TypeError) as exc:
                    log.error("journal: accepted call %s cannot run again: its request file "
                              "is unreadable (%s); left as is", r[0], exc)
                    continue
            calls.append(JournaledCall(r[0], r[1], r[2], r[3], r[4], request,
                                       msgpack.unpackb(r[6], raw=False), r[7], r[8], r[9],
                                       r[10], self.request_file(r[0]) if r[11] else None,
                                       overrides if r[11] else None))
        return calls

    def attempts_of(self, call_id: str) -> list[dict[str, Any]]:
        cur = self._db.execute("SELECT * FROM attempts WHERE call_id = ? ORDER BY attempt",
                               (call_id,))
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    # ---- retention ---------------------------------------------------------------

    def prune(self, older_than: float, limit: int = PRUNE_BATCH,
              budget_s: float | None = None) -> int:
        """Delete up to `limit` finished calls whose `finished` (wall clock) is
        before `older_than`, oldest first, and their attempts, in one
        transaction of its own; with `budget_s`, stop deleting once that much
        time is spent. Returns the calls deleted; `prune_more` tells whether
        some were left that are due too."""
        self.commit()  # the turn's writes are never mixed with (or rolled back with) a prune
        if self.fault is not None:
            return 0  # no deletes while the kept writes wait for the disk
        removed, self.prune_more = retention.in_transaction(
            self._db, "BEGIN", _OLDEST_DONE, _PRUNE_DELETES, older_than, limit, budget_s)
        return removed

    @property
    def prune_due(self) -> float:
        """When `prune_tick` next has work to try (monotonic seconds)."""
        return self._prune_due

    def prune_tick(self, retention_days: float) -> int:
        """The loop's incremental prune: nothing when `retention_days` is 0 or
        the next batch is not due yet; else one budgeted `prune`. Returns the
        calls deleted (for the `journal_pruned` counter). A failure (say, the
        file locked by a long `streamfence prune`) is logged and retried later."""
        if retention_days <= 0 or self.fault is not None:
            return 0
        now = time.monotonic()
        if now < self._prune_due:
            return 0
        self._prune_due = now + PRUNE_EVERY_S
        try:
            removed = self.prune(time.time() - retention_days * 86400.0,
                                 budget_s=PRUNE_BUDGET_S)
        except sqlite3.OperationalError as exc:
            log.warning("journal: pruning finished calls failed (will retry): %s", exc)
            return 0
        if self.prune_more:
            self._prune_due = now + PRUNE_BACKLOG_S
        return removed

    def close(self) -> None:
        """Commit, sync everything, run what waited for it, and close. Writes a
        lasting storage fault kept are lost with the process, and said so: no
        accepted call is (its row committed before `accepted` went out), and
        recovery finds what they said again (a finished call's done event is
        in the transcript; an unjournaled epoch never reached the sink)."""
        self.commit(retry_now=self.fault is not None)
        if self.fault is not None:
            log.error("journal: stopping with %d write(s) not committed (%s); the next start "
                      "recovers from the transcript", len(self._unit), self.fault.message)
        if self._commits > self._synced:
            self._syncer.request(self._commits)
        self._synced = self._syncer.close()
        self._run_synced()
        self._db.close()
        self.files.close()


def prune_journal(path: str, older_than: float, batch: int = PRUNE_BATCH,
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
    return retention.prune_file(path, _FINISHED_INDEX, _OLDEST_DONE, _PRUNE_DELETES,
                                older_than, batch, budget_s, pause_s)
