"""The transcript store: SQLite (WAL, synchronous=NORMAL), written only by the sink.

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

Why runs instead of a row per event: on this class of machine one row per
delta costs ~4-5 us in sqlite3 (binding a blob dominates), which alone caps
the sink below 200k deltas/s; a row per call per group commit costs the same
once per run. Replay stays a straight read: split each body at msgpack object
boundaries (`Unpacker.skip` + `tell`, no decoding).

Checkpoints: the writer connection has auto-checkpoint off; a `Checkpointer`
thread with its own connection runs PASSIVE checkpoints every 0.25 s. sqlite3
releases the GIL while it works, so the checkpoint's fsync never stalls the
sink loop (measured at 1k deltas/s: p99 latency 4.7 ms inline, 0.24 ms here).

Commit policy (driven by the sink loop): deltas are group-committed (1000
events, the input running dry, or 5 ms) and their events are published only
after that commit; authorize, accepted finals and `done` events commit
synchronously before they are acknowledged or published.

Retention: `prune` deletes, in one transaction, up to a batch of finished
calls (a status set) whose `updated_at` (wall clock of the done) is older
than a cutoff, oldest first, with their events, and may stop after a time
budget (measured: 0.1-0.2 ms per call of ~60 deltas); never a call that has
not finished. The sink runs it on its own schedule (sink/state.py);
`prune_transcript` is the same delete for `streamfence prune`, from another
process, with a busy timeout. Freed pages are reused, so under steady load
the file stops growing.

Storage faults (docs/ARCHITECTURE.md §4.15): a write that fails for the disk
or for another process's lock (`is_storage_fault`) is tried again, in the
same call, until it succeeds: `commit` keeps its buffers, rolls back only a
transaction SQLite still has open, logs one ERROR line (the file, SQLite's
error, the events it holds), a reminder every `REMIND_EVERY_S`, and a
WARNING when it commits again, and waits between tries through `pause`
(back-off from `RETRY_FIRST_S` doubling to `RETRY_MAX_S`). Why a loop inside
the commit rather than a sink that runs on with a faulted store: nothing is
acknowledged or published before its commit, so the sink's loop waiting here
is a frozen sink, which costs no answer (workers keep their deltas, the
watchdog does not blame the provider: §4.1), where running on would mean
holding back every ack, reply and event that needs a commit. `pause` is the
sink's (sink/process.py): it answers C_STATS meanwhile, so `status` shows
the fault (`fault`, `fault_since`, `retries`), and returns True when a stop
was asked: the write is then given up with `StoreStopped`. C_STATS's own
commit is `commit(wait=False)`: one try. Opening the file (schema created or
upgraded) retries the same way. Damage (SQLITE_CORRUPT, SQLITE_NOTADB) is no
storage fault: logged in one line and raised.

`TranscriptReader` opens the same file read-only from any process (the
supervisor uses it to replay finished calls to `subscribe`).
"""

from __future__ import annotations

import logging
import pathlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import msgpack

from streamfence.protocol import retention

SCHEMA_VERSION = 2
CHECKPOINT_EVERY_S = 0.25
# How long one try of a write waits for a lock another process holds (a
# backup tool's BEGIN IMMEDIATE, `streamfence prune`), in SQLite's busy
# handler, which takes the lock the moment it is free. A lock held longer is
# a storage fault, and the retry loop goes on waiting for as long as it takes
# (the sink's loop waits with it, which costs no answer: ARCHITECTURE §4.1).
# Why 2 s and not longer: a stop is heard only between two tries, and the
# supervisor SIGKILLs a sink that has not exited 5 s after its SIGTERM.
BUSY_TIMEOUT_S = 2.0
RETRY_FIRST_S = 0.05  # a write that met a storage fault is tried again after this ...
RETRY_MAX_S = 1.0  # ... doubling up to this
REMIND_EVERY_S = 30.0  # a lasting fault is logged again this often
# SQLite's errors of the disk or of a lock, not of the file's content or of
# our SQL: the same write can succeed later (space freed, the lock released,
# the disk back, the file system remounted read-write, descriptors freed), so
# it is retried. Each name covers its extended codes (SQLITE_IOERR_WRITE,
# SQLITE_BUSY_SNAPSHOT, SQLITE_READONLY_DBMOVED, ...). The same set as the
# journal's (supervisor/journal.py).
_FAULTS = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_READONLY",
           "SQLITE_CANTOPEN")
_DAMAGE = ("SQLITE_CORRUPT", "SQLITE_NOTADB")  # never retried: the file is not what we wrote

log = logging.getLogger("streamfence.sink.store")

PRUNE_BATCH = retention.BATCH  # finished calls deleted per transaction, at most

_FINISHED_INDEX = ("CREATE INDEX IF NOT EXISTS calls_finished ON calls (updated_at) "
                   "WHERE status IS NOT NULL")
_OLDEST_FINISHED = ("SELECT call_id FROM calls WHERE status IS NOT NULL AND updated_at < ? "
                    "ORDER BY updated_at LIMIT ?")
_PRUNE_DELETES = ("DELETE FROM events WHERE call_id = ?", "DELETE FROM calls WHERE call_id = ?")

_EVENTS_TABLE = """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY,
        call_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        attempt INTEGER NOT NULL,
        op TEXT NOT NULL,
        n INTEGER NOT NULL,
        body BLOB NOT NULL
    )"""
_EVENT_COLUMNS = "call_id, seq, last_seq, attempt, op, n, body"
# schema_version, and the store pair's store_id and generation (written by
# the supervisor before it starts the sink: supervisor/storepair.py).
META_TABLE = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID"

_SCHEMA = (
    _EVENTS_TABLE,
    "CREATE UNIQUE INDEX IF NOT EXISTS events_by_call ON events (call_id, seq)",
    """CREATE TABLE IF NOT EXISTS calls (
        call_id TEXT PRIMARY KEY,
        max_epoch INTEGER NOT NULL,
        status TEXT,
        done_seq INTEGER,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID""",
    META_TABLE,
    _FINISHED_INDEX,
)

_INSERT_EVENTS = f"INSERT INTO events ({_EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?)"
_UPSERT_EPOCH = """INSERT INTO calls (call_id, max_epoch, updated_at) VALUES (?,?,?)
    ON CONFLICT(call_id) DO UPDATE SET max_epoch = max(max_epoch, excluded.max_epoch),
    updated_at = excluded.updated_at"""
_SET_DONE = """INSERT INTO calls (call_id, max_epoch, status, done_seq, updated_at)
    VALUES (?,?,?,?,?) ON CONFLICT(call_id) DO UPDATE SET status = excluded.status,
    done_seq = excluded.done_seq, max_epoch = max(max_epoch, excluded.max_epoch),
    updated_at = excluded.updated_at"""

Row = tuple[str, int, int, int, str, int, bytes]


class CallRow(NamedTuple):
    call_id: str
    max_epoch: int
    status: str | None  # None while the call runs
    last_seq: int  # last public seq stored for the call (0: none)


def is_storage_fault(exc: BaseException) -> bool:
    """Is `exc` an error of the disk or of a lock (worth another try), not of
    the file's content or a bug?"""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    name = exc.sqlite_errorname or ""
    return any(name == f or name.startswith(f + "_") for f in _FAULTS)


def _error(exc: sqlite3.Error) -> str:
    """SQLite's error as a log line names it: `SQLITE_FULL (database or disk is full)`."""
    return f"{exc.sqlite_errorname} ({exc})"


def _n(events: int) -> str:
    return f"{events} event{'' if events == 1 else 's'}"


class StoreStopped(Exception):
    """A write given up because a stop was asked while it waited out a storage
    fault (the message names the file, the fault and what was not written)."""


def _sleep(seconds: float) -> bool:
    """The default `pause` between tries: sleep; no stop is ever asked."""
    time.sleep(seconds)
    return False


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


def _events_after(conn: sqlite3.Connection, call_id: str, from_seq: int,
                  max_rows: int = -1) -> list[bytes]:
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


def _done_event(conn: sqlite3.Connection, call_id: str) -> bytes | None:
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


class Checkpointer:
    """WAL checkpoints on a thread and connection of their own: at most one per
    `every_s`, and only after a commit (`wake`), so an idle sink sleeps."""

    def __init__(self, path: str, every_s: float = CHECKPOINT_EVERY_S) -> None:
        self.path = path
        self.every_s = every_s
        self._stopping = threading.Event()
        self._committed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sink-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The writer committed: the WAL has grown."""
        self._committed.set()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            failing = False  # logged once per run of failures (a full disk fails each try)
            while True:
                self._committed.wait()
                if self._stopping.is_set():
                    return
                self._committed.clear()
                try:
                    # PASSIVE: never waits for (or blocks) the writer.
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    if failing:
                        failing = False
                        log.info("sink: WAL checkpoints of %s work again", self.path)
                except sqlite3.Error as exc:
                    if not failing:
                        failing = True
                        log.warning("sink: WAL checkpoint of %s failed (retried every %g s): %s",
                                    self.path, self.every_s, exc)
                    self._committed.set()
                if self._stopping.wait(self.every_s):  # at most one per every_s
                    return
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        self._committed.set()
        if self._thread.is_alive():
            self._thread.join(10.0)


class TranscriptStore:
    """The sink's writer connection. Not thread-safe; one per sink process.

    `pause(seconds)` waits between two tries of a write that met a storage
    fault and returns True when a stop was asked (default: sleep, never)."""

    def __init__(self, path: str, background_checkpoints: bool = True,
                 pause: Callable[[float], bool] = _sleep) -> None:
        self.path = path
        self._pause = pause
        self.fault: str | None = None  # the storage fault the last write met, if any
        self.fault_since: float | None = None  # ... since then (wall clock)
        self._fault_start = self._reminded = 0.0  # when it began, last logged (monotonic)
        self._fault_tries = 0  # writes that met it
        self.retries = 0  # tries again after a storage fault, since the start
        self._conn = self._connect()
        try:
            self._retried(self._prepare)
        except BaseException:
            self._conn.close()
            raise
        self._checkpointer: Checkpointer | None = None
        if background_checkpoints:
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = Checkpointer(path)
            self._checkpointer.start()
        self._rows: list[Row] = []
        self._epochs: list[tuple[str, int, float]] = []
        self._done: list[tuple[str, int, str, int, float]] = []
        self.replicated = 0  # leading rows of the buffer the cluster stored (sink/cluster_log.py)
        self.rows_written = 0
        self.commits = 0
        self.pruned = 0  # calls deleted by `prune`
        self.prune_more = False  # the last prune left finished calls that were due

    def _connect(self) -> sqlite3.Connection:
        opened: list[sqlite3.Connection] = []
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per group.
        self._retried(lambda: opened.append(sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)))
        return opened[0]

    def _prepare(self) -> None:
        """WAL mode and the schema. Writes nothing to a file that is already at
        this version: a sink restarted on a full disk opens it."""
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._create_or_upgrade()

    def _create_or_upgrade(self) -> None:
        conn = self._conn
        if conn.in_transaction:  # an earlier try's ROLLBACK failed
            conn.execute("ROLLBACK")
        conn.execute("BEGIN IMMEDIATE")
        try:
            has_meta = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'"
                               ).fetchone() if has_meta else None
            if row is not None and int(row[0]) > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path}: transcript schema version {row[0]} is newer "
                                   f"than this streamfence's ({SCHEMA_VERSION}); upgrade it")
            if row is not None and row[0] == "1":
                # Version 1 -> 2: the events table becomes a rowid table, same rows.
                conn.execute("ALTER TABLE events RENAME TO events_v1")
                conn.execute(_EVENTS_TABLE)
                conn.execute(f"INSERT INTO events ({_EVENT_COLUMNS}) SELECT {_EVENT_COLUMNS} "
                             "FROM events_v1 ORDER BY call_id, seq")
                conn.execute("DROP TABLE events_v1")
                log.info("sink: transcript converted to schema version %d", SCHEMA_VERSION)
            for ddl in _SCHEMA:  # IF NOT EXISTS: no write when all are there
                conn.execute(ddl)
            if row is None or row[0] != str(SCHEMA_VERSION):
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        except BaseException:
            retention.rollback_if_open(conn)
            raise

    def _retried(self, write: Callable[[], object], events: Callable[[], int] | None = None,
                 wait: bool = True) -> bool:
        """Run `write` (one transaction, rolled back on failure) until it
        succeeds, waiting out storage faults (module docstring); with `wait`
        False, try once: False if it met a storage fault. `events`: how many
        events the write holds (None: it opens the store), for the log."""
        def held() -> str:
            return "the sink waits to open it" if events is None else f"holding {_n(events())}"

        pause = RETRY_FIRST_S
        while True:
            try:
                write()
            except sqlite3.OperationalError as exc:
                if not is_storage_fault(exc):
                    raise
                self._faulted(exc, held)
                if not wait:
                    return False
                if self._pause(pause):
                    raise StoreStopped(f"a stop was asked: gave up writing {self.path} after "
                                       f"{time.monotonic() - self._fault_start:.1f} s of "
                                       f"{self.fault} ({held()})") from exc
                self.retries += 1
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            except sqlite3.DatabaseError as exc:
                if (exc.sqlite_errorname or "").startswith(_DAMAGE):
                    log.error("sink: %s is damaged: %s; the sink stops (`streamfence check` "
                              "names what is wrong)", self.path, _error(exc))
                raise
            if self.fault is not None:
                log.warning("sink: %s writable again after %.1f s (%d tries); %s", self.path,
                            time.monotonic() - self._fault_start, self._fault_tries + 1,
                            "opened" if events is None else f"{_n(events())} committed")
                self.fault = self.fault_since = None
            return True

    def _faulted(self, exc: sqlite3.OperationalError, held: Callable[[], str]) -> None:
        """A try met a storage fault: the first is logged at ERROR, a lasting one
        again every REMIND_EVERY_S."""
        now = time.monotonic()
        if self.fault is None:
            self._fault_start = self._reminded = now
            self._fault_tries = 0
            self.fault_since = time.time()
            log.error("sink: cannot write %s: %s; %s; retrying", self.path, _error(exc), held())
        elif now - self._reminded >= REMIND_EVERY_S:
            self._reminded = now
            log.warning("sink: %s still not writable after %.0f s: %s; %s; retrying",
                        self.path, now - self._fault_start, _error(exc), held())
        self.fault = _error(exc)
        self._fault_tries += 1

    # ---- writes (buffered until commit) ----------------------------------------

    def add(self, call_id: str, seq: int, last_seq: int, attempt: int, op: str,
            body: bytes) -> None:
        self._rows.append((call_id, seq, last_seq, attempt, op, last_seq - seq + 1, body))

    def add_run(self, call_id: str, seq: int, attempt: int, events: list[bytes]) -> None:
        """A run of consecutive delta events starting at public seq `seq`."""
        n = len(events)
        self._rows.append((call_id, seq, seq + n - 1, attempt, "delta", n, b"".join(events)))

    def unreplicated(self) -> list[Row]:
        """The buffered rows the cluster has not stored yet (cluster mode)."""
        return self._rows[self.replicated:]

    def replicated_but(self, call_ids: set[str]) -> None:
        """The cluster stored the unreplicated rows but those of `call_ids`,
        which it refused: they are dropped, with the calls' done marks."""
        if call_ids:
            kept = [r for r in self._rows[self.replicated:] if r[0] not in call_ids]
            self._rows[self.replicated:] = kept
            self._done = [d for d in self._done if d[0] not in call_ids]
        self.replicated = len(self._rows)

    def add_replicated(self, rows: list[Row]) -> None:
        """Rows the cluster holds already (a call taken over: sink/cluster_log.py),
        stored at the next commit and never appended again."""
        assert self.replicated == len(self._rows), "replicate what is buffered first"
        self._rows += rows
        self.replicated = len(self._rows)

    def set_epoch(self, call_id: str, epoch: int) -> None:
        self._epochs.append((call_id, epoch, time.time()))

    def set_done(self, call_id: str, epoch: int, status: str, done_seq: int) -> None:
        self._done.append((call_id, epoch, status, done_seq, time.time()))

    def commit(self, wait: bool = True) -> int | None:
        """Write everything buffered in one transaction. Returns the event rows
        written. A storage fault is waited out here (module docstring): the
        buffers are kept until the commit succeeds. Raises `StoreStopped` if a
        stop is asked meanwhile, and any other error at once. With `wait`
        False, one try: None if it met a storage fault (all stays buffered)."""
        rows, epochs, done = self._rows, self._epochs, self._done
        if not (rows or epochs or done):
            return 0
        conn = self._conn

        def write() -> None:
            if conn.in_transaction:  # an earlier try's ROLLBACK failed
                conn.execute("ROLLBACK")
            conn.execute("BEGIN")
            try:
                if rows:
                    conn.executemany(_INSERT_EVENTS, rows)
                if epochs:
                    conn.executemany(_UPSERT_EPOCH, epochs)
                if done:
                    conn.executemany(_SET_DONE, done)
                conn.execute("COMMIT")
            except BaseException:
                # After SQLITE_FULL or SQLITE_IOERR SQLite may have rolled back
                # itself: a ROLLBACK then would raise over the real error.
                retention.rollback_if_open(conn)
                raise

        if not self._retried(write, lambda: sum(row[5] for row in rows), wait):
            return None
        self._rows, self._epochs, self._done = [], [], []
        self.replicated = 0
        self.rows_written += len(rows)
        self.commits += 1
        if self._checkpointer is not None:
            self._checkpointer.wake()
        return len(rows)

    def prune(self, older_than: float, limit: int = PRUNE_BATCH,
              budget_s: float | None = None) -> int:
        """Delete up to `limit` finished calls updated before `older_than` (wall
        clock), oldest first, and their events, in one transaction of its own
        (what is buffered for `commit` is not touched); with `budget_s`, stop
        deleting once that much time is spent. Returns the calls deleted;
        `prune_more` tells whether some were left that are due too. A storage
        fault is raised, not waited out (the caller tries again later)."""
        if self._conn.in_transaction:  # a failed try's ROLLBACK failed too (its rows are kept)
            self._conn.execute("ROLLBACK")
        removed, self.prune_more = retention.in_transaction(
            self._conn, "BEGIN", _OLDEST_FINISHED, _PRUNE_DELETES, older_than, limit, budget_s)
        self.pruned += removed
        if removed and self._checkpointer is not None:
            self._checkpointer.wake()
        return removed

    # ---- reads (the sink's own, for restart and lazy reloads) ---------------

    def call_row(self, call_id: str) -> CallRow | None:
        row = self._conn.execute(
            "SELECT max_epoch, status FROM calls WHERE call_id = ?", (call_id,)
        ).fetchone()
        if row is None:
            return None
        return CallRow(call_id, int(row[0]), row[1], _last_seq(self._conn, call_id))

    def unfinished_calls(self) -> list[CallRow]:
        """Calls without a done event: the fence table and seqs to rebuild at start."""
        rows = self._conn.execute(
            "SELECT call_id, max_epoch FROM calls WHERE status IS NULL"
        ).fetchall()
        return [CallRow(c, int(e), None, _last_seq(self._conn, c)) for c, e in rows]

    def events_after(self, call_id: str, from_seq: int = 0, max_rows: int = -1) -> list[bytes]:
        """Stored events after `from_seq`, from at most `max_rows` rows (-1: all)."""
        return _events_after(self._conn, call_id, from_seq, max_rows)

    def done_event(self, call_id: str) -> bytes | None:
        return _done_event(self._conn, call_id)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
        self._conn.close()


class TranscriptReader:
    """Read-only access for other processes (replay, results, epochs)."""

    def __init__(self, path: str) -> None:
        # mode=ro: this connection can never write, whatever the caller does.
        uri = pathlib.Path(path).absolute().as_uri() + "?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)

    def events_after(self, call_id: str, from_seq: int = 0) -> list[bytes]:
        """The stored public events of `call_id` with seq > from_seq, in seq order,
        each exactly as a subscriber receives it."""
        return _events_after(self._conn, call_id, from_seq)

    def done_event(self, call_id: str) -> bytes | None:
        """The encoded `done` event of a finished call, or None."""
        return _done_event(self._conn, call_id)

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
        out: list[CallRow] = []
        for c in ids:
            row = self._conn.execute(
                "SELECT max_epoch, status FROM calls WHERE call_id = ?", (c,)
            ).fetchone()
            if row is not None:
                out.append(CallRow(c, int(row[0]), row[1], _last_seq(self._conn, c)))
        return out

    def close(self) -> None:
        self._conn.close()


def events_after(db_path: str, call_id: str, from_seq: int = 0) -> list[bytes]:
    """One-shot replay read (opens and closes a read-only connection)."""
    reader = TranscriptReader(db_path)
    try:
        return reader.events_after(call_id, from_seq)
    finally:
        reader.close()


def stored_done(db_path: str, call_id: str) -> dict[str, Any] | None:
    """One-shot read of a finished call's done event, decoded (None: none stored)."""
    reader = TranscriptReader(db_path)
    try:
        frame = reader.done_event(call_id)
    finally:
        reader.close()
    if frame is None:
        return None
    done: dict[str, Any] = msgpack.unpackb(frame, raw=False)
    return done


def prune_transcript(db_path: str, older_than: float, batch: int = PRUNE_BATCH,
                     budget_s: float = 0.01, pause_s: float = 0.01) -> int:
    """Delete every finished call of the transcript at `db_path` updated before
    `older_than` (wall clock), with its events, in transactions of at most
    `batch` calls and about `budget_s`, with a pause between them (a running
    sink commits in between). For `streamfence prune`; returns the calls
    deleted."""
    return retention.prune_file(db_path, _FINISHED_INDEX, _OLDEST_FINISHED, _PRUNE_DELETES,
                                older_than, batch, budget_s, pause_s)


def max_epochs(db_path: str) -> dict[str, int]:
    """One-shot read of the max epoch per call."""
    reader = TranscriptReader(db_path)
    try:
        return reader.max_epochs()
    finally:
        reader.close()
