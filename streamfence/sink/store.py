"""The transcript store: the sink's writer of transcript.db (SQLite, WAL,
synchronous=NORMAL). The file's format and every read of it are
sink/transcript.py's; the store writes that format and reads through it.

Checkpoints: the writer connection has auto-checkpoint off; a `Checkpointer`
thread (sink/checkpoints.py) with its own connection runs PASSIVE
checkpoints, at most one a second. When one finds the WAL past
`wal_limit_bytes`, the next commit rewinds it (`_rewind_wal`: a RESTART
checkpoint on the writer's connection; the file is cut back when it grew
past twice the limit), or the -wal file would grow for as long as commits
never stop.

Commit policy (driven by the sink loop): deltas are group-committed (1000
events, the input running dry, or 5 ms) and their events are published only
after that commit; authorize, accepted finals and `done` events commit
synchronously before they are acknowledged or published.

Retention: `prune` deletes, in one transaction, up to a batch of finished
calls (a status set) whose `updated_at` (wall clock of the done) is older
than a cutoff, oldest first, with their events, and may stop after a time
budget (measured: 0.1-0.2 ms per call of ~60 deltas); never a call that has
not finished. The sink runs it on its own schedule (sink/retention.py);
`transcript.prune_transcript` is the same delete for `streamfence prune`,
from another process, with a busy timeout. Freed pages are reused, so under
steady load the file stops growing.

Storage faults (docs/ARCHITECTURE.md §4.15): a write that fails for the disk
or for another process's lock (`protocol.sqlite_faults.is_storage_fault`) is
tried again, in the same call, until it succeeds: `commit` keeps its buffers,
rolls back only a transaction SQLite still has open, logs one ERROR line (the
file, SQLite's error, the events it holds), a reminder every `REMIND_EVERY_S`,
and a WARNING when it commits again, and waits between tries through `pause`
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
upgraded) retries the same way.

Damage (SQLITE_CORRUPT, SQLITE_NOTADB: a page that is not what SQLite wrote)
met by a commit is waited out the same way, as a storage fault that only
the operator ends: a sink that exited on it would be restarted onto the same
page, again and again, where this one keeps every event it was sent, shows
the fault in `status` and says once which file and what to do (the next
start's check, supervisor/storepair.py, refuses the file by name). Damage
met at open is raised, in one line: the start's check did not read it (a
file over its size cap), and a sink that cannot open its file has nothing
to keep. A replay's read that meets damage ends that replay only
(sink/replays.py).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable

from streamfence.protocol import retention
from streamfence.protocol.sqlite_faults import is_damage, is_storage_fault
from streamfence.sink import transcript
from streamfence.sink.checkpoints import CHECKPOINT_EVERY_S, Checkpointer
from streamfence.sink.transcript import SCHEMA_VERSION, CallRow, Row

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
# The WAL is rewound once a checkpoint finds it past this: about 1.5 s of
# the heaviest steady load measured (20k deltas/s, one commit per few deltas).
WAL_LIMIT_BYTES = 64 << 20

log = logging.getLogger("streamfence.sink.store")

_INSERT_EVENTS = f"INSERT INTO events ({transcript.EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?)"
_UPSERT_EPOCH = """INSERT INTO calls (call_id, max_epoch, updated_at) VALUES (?,?,?)
    ON CONFLICT(call_id) DO UPDATE SET max_epoch = max(max_epoch, excluded.max_epoch),
    updated_at = excluded.updated_at"""
_SET_DONE = """INSERT INTO calls (call_id, max_epoch, status, done_seq, updated_at)
    VALUES (?,?,?,?,?) ON CONFLICT(call_id) DO UPDATE SET status = excluded.status,
    done_seq = excluded.done_seq, max_epoch = max(max_epoch, excluded.max_epoch),
    updated_at = excluded.updated_at"""


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


class TranscriptStore:
    """The sink's writer connection. Not thread-safe; one per sink process.

    `pause(seconds)` waits between two tries of a write that met a storage
    fault and returns True when a stop was asked (default: sleep, never)."""

    def __init__(self, path: str, background_checkpoints: bool = True,
                 pause: Callable[[float], bool] = _sleep,
                 wal_limit_bytes: int = WAL_LIMIT_BYTES,
                 checkpoint_every_s: float = CHECKPOINT_EVERY_S) -> None:
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
        self.wal_rewinds = 0
        if background_checkpoints:
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            # Past twice the limit (rewinds a reader held off), a rewind cuts the
            # file back; not at each one, where the cut is the commit's longest step.
            self._conn.execute(f"PRAGMA journal_size_limit={2 * wal_limit_bytes}")
            self._checkpointer = Checkpointer(path, wal_limit_bytes, checkpoint_every_s)
            self._checkpointer.start()
        self._rows: list[Row] = []
        self._epochs: list[tuple[str, int, float]] = []
        self._done: list[tuple[str, int, str, int, float]] = []
        self.replicated = 0  # leading rows of the buffer the cluster stored (sink/log_queue.py)
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
                conn.execute(transcript.EVENTS_TABLE)
                columns = transcript.EVENT_COLUMNS
                conn.execute(f"INSERT INTO events ({columns}) SELECT {columns} "
                             "FROM events_v1 ORDER BY call_id, seq")
                conn.execute("DROP TABLE events_v1")
                log.info("sink: transcript converted to schema version %d", SCHEMA_VERSION)
            for ddl in transcript.SCHEMA:  # IF NOT EXISTS: no write when all are there
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
            except sqlite3.DatabaseError as exc:
                damaged = is_damage(exc)
                if not (is_storage_fault(exc) or (damaged and events is not None)):
                    if damaged:
                        log.error("sink: %s is damaged: %s; the sink stops (`streamfence "
                                  "check` names what is wrong)", self.path, _error(exc))
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
            if self.fault is not None:
                log.warning("sink: %s writable again after %.1f s (%d tries); %s", self.path,
                            time.monotonic() - self._fault_start, self._fault_tries + 1,
                            "opened" if events is None else f"{_n(events())} committed")
                self.fault = self.fault_since = None
            return True

    def _faulted(self, exc: sqlite3.DatabaseError, held: Callable[[], str]) -> None:
        """A try met a storage fault: the first is logged at ERROR, a lasting one
        again every REMIND_EVERY_S."""
        now = time.monotonic()
        if self.fault is None:
            self._fault_start = self._reminded = now
            self._fault_tries = 0
            self.fault_since = time.time()
            damaged = "" if is_storage_fault(exc) else (
                " (the file is damaged: stop the daemon, run `streamfence check`, then restore "
                "it from a backup, or move the state dir away to start clean)")
            log.error("sink: cannot write %s: %s%s; %s; retrying", self.path, _error(exc),
                      damaged, held())
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

    def take_unreplicated(self) -> list[Row]:
        """The buffered rows the cluster has not stored yet, out of the buffer
        (cluster mode: they wait for their calls' logs, sink/log_queue.py)."""
        rows = self._rows[self.replicated:]
        del self._rows[self.replicated:]
        return rows

    def add_replicated(self, rows: list[Row]) -> None:
        """Rows the cluster holds already (appended, or a call taken over:
        sink/log_queue.py, sink/replica.py), stored at the next commit."""
        self._rows[self.replicated:self.replicated] = rows  # before any not yet replicated
        self.replicated += len(rows)

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
            if len(rows) == 1 and not (epochs or done):
                # A model's pace: one run. One statement is its own transaction
                # (autocommit): BEGIN and COMMIT would be two more per delta.
                conn.execute(_INSERT_EVENTS, rows[0])
                return
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
            if self._checkpointer.rewind_due:
                self._rewind_wal()
        return len(rows)

    def _rewind_wal(self) -> None:
        """A RESTART checkpoint: it moves the frames written since the
        checkpoint that asked for it, and the next write starts the WAL over.
        It waits for nobody: a reader still on the WAL (another process's
        read) makes it give up until the next ask. About 1 ms at 20k deltas/s
        (the checkpointer synced the rest: sink/checkpoints.py)."""
        assert self._checkpointer is not None
        self._checkpointer.rewind_due = False
        conn = self._conn
        conn.execute("PRAGMA busy_timeout=0")
        try:
            busy = conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[0]
        except sqlite3.Error:  # a storage fault: the checkpointer's next try logs it
            busy = 1
        finally:
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        if not busy:
            self.wal_rewinds += 1

    def prune(self, older_than: float, limit: int = transcript.PRUNE_BATCH,
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
            self._conn, "BEGIN", transcript.OLDEST_FINISHED,
            transcript.PRUNE_DELETES, older_than, limit, budget_s)
        self.pruned += removed
        if removed and self._checkpointer is not None:
            self._checkpointer.wake()
        return removed

    # ---- reads (the sink's own, for restart and lazy reloads: sink/transcript.py) ----

    def call_row(self, call_id: str) -> CallRow | None:
        return transcript.call_row(self._conn, call_id)

    def unfinished_calls(self) -> list[CallRow]:
        """Calls without a done event: the fence table and seqs to rebuild at start."""
        return transcript.unfinished_calls(self._conn)

    def events_after(self, call_id: str, from_seq: int = 0, max_rows: int = -1) -> list[bytes]:
        """Stored events after `from_seq`, from at most `max_rows` rows (-1: all)."""
        return transcript.events_after(self._conn, call_id, from_seq, max_rows)

    def done_event(self, call_id: str) -> bytes | None:
        return transcript.done_event(self._conn, call_id)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
        self._conn.close()


