"""The durable call journal (SQLite, WAL).

Writes are grouped in a unit until `commit`; the unit's durability (a
callback of `commit(then=...)` runs once the WAL is synced) and its storage
faults are streamfence.supervisor.journal_unit's.

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

Attempt epochs are journaled before a worker may send (a first attempt's
before the sink is asked to authorize it, a retry's while the sink stores
it: supervisor/epoch_join.py); with the transcript's epochs, which recovery
also reads, an attempt number is never reused across restarts (Kafka-style
producer epochs). The journal never holds a credential: requests carry none, and
profiles name environment variables only.

Retention (`[daemon] retention_days`, 0: keep forever): finished calls
older than the retention are deleted with their rows, never an unfinished
call (streamfence.supervisor.journal_file says how). The loop calls
`prune_tick` every turn and wakes at `prune_due`; it does one small
transaction every `PRUNE_EVERY_S`, or every `PRUNE_BACKLOG_S` while a backlog
remains, that deletes at most `PRUNE_BATCH` calls and stops deleting after
`PRUNE_BUDGET_S`, so no turn is held for more than a few milliseconds
(measured: 0.1-0.2 ms per call). A prune asks for no sync: one lost to a
power cut is done again, and the next sync covers its frames anyway.

A write waits `BUSY_WAIT_S` for a lock another process holds before it is
a storage fault (journal_unit).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from streamfence.protocol import retention
from streamfence.protocol.errors import ProtocolError
from streamfence.protocol.internal.outcome import AttemptOutcome
from streamfence.protocol.logs import request_model
from streamfence.protocol.messages import submitted_request
from streamfence.supervisor.journal_file import (
    ADD_OWNERS,
    ADDED_COLUMNS,
    OLDEST_DONE,
    PRUNE_DELETES,
    SCHEMA,
    JournaledCall,
)
from streamfence.supervisor.journal_unit import StorageFault, WriteUnit
from streamfence.supervisor.request_files import RequestFiles
from streamfence.supervisor.usage import UsageBook

log = logging.getLogger("streamfence.journal")

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


class Journal:
    """Owns journal.db (every accepted call, each attempt's epoch and end, each
    finished call's status) and, through `files`, the large requests' files;
    `usage` (UsageBook) adds each finished call's usage to the same unit.
    Writes are grouped until `commit`."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                   timeout=BUSY_WAIT_S)
        self.files = RequestFiles(Path(path).parent / "requests")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # the WAL is synced by the WalSyncer
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(calls)")}
        if columns and "owner" not in columns:
            self._db.executescript("BEGIN;" + ADD_OWNERS.format(schema=SCHEMA) + "COMMIT;")
        for table, column, kind in ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if have and column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._db.executescript(SCHEMA)
        self._sweep()
        self._unit = WriteUnit(path, self._db, self.files)
        self.usage = UsageBook(self._db, self._unit)  # the usage sums (supervisor/usage.py)
        self._prune_due = 0.0  # monotonic time of the next prune transaction
        self.prune_more = False  # the last prune left finished calls that were due

    # ---- the unit of writes (streamfence.supervisor.journal_unit) -------------------
    @property
    def fault(self) -> StorageFault | None:
        """The storage fault the unit waits out, or the damage it met (None:
        none); submits are refused meanwhile."""
        return self._unit.fault or self._unit.damage

    @property
    def retry_due(self) -> float | None:
        """When a faulted journal next tries its kept writes (monotonic)."""
        return self._unit.retry_due

    def commit(self, then: Callable[[], object] | None = None, retry_now: bool = False) -> None:
        """Commit the writes so far; `then` runs once they are durable (WriteUnit.commit)."""
        self._unit.commit(then, retry_now)

    def on_synced(self) -> None:
        """Run the callbacks whose commits are durable now (the loop's turn)."""
        self._unit.on_synced()

    def sync_fileno(self) -> int:
        """Readable when the sync thread has made more commits durable."""
        return self._unit.sync_fileno()

    def take_refused(self) -> list[str]:
        """The calls a failed unit added, never accepted: for the front to refuse (once)."""
        return self._unit.take_refused()

    def fsyncs(self) -> int:
        """How many times the journal's WAL was fsynced (`status`)."""
        return self._unit.fsyncs()

    def fault_view(self) -> dict[str, Any] | None:
        """The fault for `status` (nil: none)."""
        return self._unit.fault_view()

    # ---- the calls ----------------------------------------------------------------
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
        if not self._unit.adds(call_id, in_file):
            return in_file
        self._unit.write(call_id,
                    "INSERT INTO calls (call_id, owner, idempotency_key, session_id, provider, "
                    "request, options, state, created, model) "
                    "VALUES (?, ?, ?, ?, ?, x'', x'', ?, ?, ?)",
                    (call_id, owner, idempotency_key, session_id, provider,
                     "staging" if in_file else "pending", time.time(), request_model(request)))
        self._unit.write(call_id, "INSERT INTO requests (call_id, request, options, in_file) "
                    "VALUES (?, ?, ?, ?)", (call_id, body, msgpack.packb(options), in_file))
        if self._unit.is_refused(call_id):
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
            if self._unit.drop_refused_file(call_id):  # its row was never committed: refused
                self.files.remove(call_id)
                continue
            written.append((call_id, error))
            if error is None:
                self._unit.write(call_id, "UPDATE calls SET state = 'pending' WHERE call_id = ? AND "
                            "state = 'staging'", (call_id,))
            else:
                self._unit.write(call_id, "DELETE FROM requests WHERE call_id = ?", (call_id,))
                self._unit.write(call_id, "DELETE FROM calls WHERE call_id = ?", (call_id,))
        return written

    def _row(self, sql: str, params: tuple[Any, ...]) -> Any:
        """One row of a read, or None. A storage fault or damage met here is
        raised as a ProtocolError with its code (the request is refused with
        it; journal_unit: `read_failed`)."""
        try:
            return self._db.execute(sql, params).fetchone()
        except sqlite3.DatabaseError as exc:
            raise self._unit.read_failed(exc) from None

    def call_by_idempotency_key(self, owner: str, key: str) -> str | None:
        """Idempotency keys are scoped to their owner: another identity's key is
        another key."""
        row = self._row("SELECT call_id FROM calls WHERE owner = ? AND idempotency_key = ?",
                        (owner, key))
        return None if row is None else str(row[0])

    def owner_of(self, call_id: str) -> str | None:
        """The identity that submitted `call_id`, or None if there is no such call."""
        row = self._row("SELECT owner FROM calls WHERE call_id = ?", (call_id,))
        return None if row is None else str(row[0])

    def created_of(self, call_id: str) -> float | None:
        """When `call_id` was accepted (wall clock), or None if it cannot be read."""
        try:
            row = self._row("SELECT created FROM calls WHERE call_id = ?", (call_id,))
        except ProtocolError:
            return None  # a storage fault: the trace starts at the first attempt
        return None if row is None else float(row[0])

    def start_attempt(self, call_id: str, attempt: int, profile: str, model: str | None) -> None:
        """`profile` and `model`: the attempt's deployment (a result names it)."""
        self._unit.write(call_id, "UPDATE calls SET epoch = ?, attempts = attempts + 1, "
                    "state = 'running' WHERE call_id = ?", (attempt, call_id))
        self._unit.write(call_id, "INSERT OR REPLACE INTO attempts (call_id, attempt, started, "
                    "profile, model) VALUES (?, ?, ?, ?, ?)",
                    (call_id, attempt, time.time(), profile, model))

    def rebind_attempt(self, call_id: str, attempt: int, new_attempt: int) -> None:
        """After a sink restart the running `attempt` goes on as `new_attempt`:
        a new epoch, not a new provider attempt (`attempts` stays)."""
        self.end_attempt(call_id, attempt, "rebound", None)
        self._unit.write(call_id, "UPDATE calls SET epoch = ? WHERE call_id = ?",
                    (new_attempt, call_id))
        self._unit.write(call_id, "INSERT OR REPLACE INTO attempts (call_id, attempt, started, "
                    "profile, model) SELECT call_id, ?, ?, profile, model FROM attempts "
                    "WHERE call_id = ? AND attempt = ?",
                    (new_attempt, time.time(), call_id, attempt))

    def set_attempt_pid(self, call_id: str, attempt: int, pid: int) -> None:
        self._unit.write(call_id, "UPDATE attempts SET worker_pid = ? WHERE call_id = ? AND "
                    "attempt = ?", (pid, call_id, attempt))

    def end_attempt(self, call_id: str, attempt: int, how: str,
                    outcome: AttemptOutcome | None, chars: int | None = None,
                    accepted: int | None = None) -> None:
        """`how`: "ended" (its final was accepted) or why it was fenced;
        `chars`, `accepted`: the visible characters and the deltas the sink
        accepted of it (a fenced attempt's deltas, which no outcome gives)."""
        finish_reason = error_class = error_code = None
        diag: tuple[float | None, int | None, int | None, int | None] = (None, None, None, accepted)
        if outcome is not None:
            finish_reason = outcome.finish_reason
            if outcome.error is not None:
                error_class, error_code = outcome.error.error_class.value, outcome.error.code
            d = outcome.diag
            diag = (d.first_chunk_ms, d.chunks, d.bytes, d.deltas)
        self._unit.write(
            call_id, "UPDATE attempts SET ended = ?, how = ?, finish_reason = ?, "
            "error_class = ?, error_code = ?, first_chunk_ms = ?, chunks = ?, bytes = ?, "
            "deltas = ?, chars = ? WHERE call_id = ? AND attempt = ?",
            (time.time(), how, finish_reason, error_class, error_code, *diag, chars, call_id,
             attempt))

    def refused_deltas(self, call_id: str, refused: dict[int, int]) -> None:
        """The deltas the sink's fence refused of each attempt (when the call ended)."""
        for attempt, count in refused.items():
            self._unit.write(call_id, "UPDATE attempts SET refused = ? WHERE call_id = ? AND "
                             "attempt = ?", (count, call_id, attempt))

    def finish_call(self, call_id: str, status: str) -> None:
        """The call is done. Its done event is already in the transcript, which
        recovery reads first, so this joins the turn's transaction instead of
        syncing on its own; its request file goes once that has committed."""
        self._unit.write(call_id, "UPDATE calls SET state = 'done', status = ?, finished = ?, "
                    "done = NULL WHERE call_id = ?", (status, time.time(), call_id))
        self._unit.finishing.append(call_id)

    def is_moved(self, call_id: str) -> bool:
        """Cluster mode: another host owns the call now (calls.MOVED)."""
        row = self._row("SELECT status FROM calls WHERE call_id = ?", (call_id,))
        return row is not None and row[0] == "moved"

    def take_back(self, call_id: str) -> None:
        """Cluster mode: a call this host had moved away is its own again (won
        back from a host that lost its lease): its old rows go, so that it is
        journaled anew (its attempts' rows stay: later epochs are new rows)."""
        if self.is_moved(call_id):
            self._unit.write(call_id, "DELETE FROM requests WHERE call_id = ?", (call_id,))
            self._unit.write(call_id, "DELETE FROM calls WHERE call_id = ?", (call_id,))

    def taken_over(self, call_id: str, taken_from: str, epoch: int) -> None:
        """Cluster mode: the call just journaled was taken over at `epoch` from
        `taken_from` (its attempts before that epoch ran there: the console's
        timeline says so)."""
        self._unit.write(call_id, "UPDATE calls SET taken_from = ?, taken_epoch = ? "
                         "WHERE call_id = ?", (taken_from, epoch, call_id))

    def is_finished(self, call_id: str) -> bool:
        if call_id in self._unit.finishing:  # finished in the unit not yet committed
            return True
        row = self._row("SELECT state FROM calls WHERE call_id = ?", (call_id,))
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
        """The call's attempts (a result's diagnostics); none if they cannot be
        read (a storage fault or damage: noted, and the result goes out without)."""
        try:
            cur = self._db.execute("SELECT * FROM attempts WHERE call_id = ? ORDER BY attempt",
                                   (call_id,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
        except sqlite3.DatabaseError as exc:
            if self._unit.read_failed(exc) is exc:
                raise  # neither a storage fault nor damage: a bug
            return []

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
            self._db, "BEGIN", OLDEST_DONE, PRUNE_DELETES, older_than, limit, budget_s)
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
        except sqlite3.DatabaseError as exc:
            if self._unit.read_failed(exc) is exc and \
                    not isinstance(exc, sqlite3.OperationalError):
                raise  # neither a storage fault nor damage: a bug
            if self._unit.damage is None:  # damage is logged once, and stops the prunes
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
        self._unit.close()
        self._db.close()
        self.files.close()
