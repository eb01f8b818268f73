"""The journal's unit of writes: every write since the last commit, its
commit, its durability, and the storage faults it meets.

A call is acknowledged (`accepted`) only after its row is committed and the
WAL synced, so the ack survives a power cut, not just a crash. The loop
commits without waiting for the disk (synchronous=NORMAL); what must be
durable first (the `accepted` replies, an attempt's epoch before its
worker's go) is a callback of `commit(then=...)`, run by `on_synced` once
the sync thread (streamfence.supervisor.journal_sync) has fsynced the WAL:
one fsync for all the commits before it, never in the loop.

Storage faults (docs/ARCHITECTURE.md §4.15): a full disk, an I/O error, or a
lock another process holds past the connection's busy timeout never raises
out of here and never loses a write. Every write of the unit since the last
commit is also kept as (call, sql, parameters); when one fails, the unit is
rolled back (only if SQLite still has it open: after SQLITE_FULL it may
not) and the unit is `fault`ed: writes are only kept, the callbacks of
`commit(then=)` wait for the commit that writes them, and each `commit`
after `retry_due` writes the kept unit again in one transaction (back-off
from `RETRY_FIRST_S` to `RETRY_MAX_S`) until it commits. The calls the
failed unit added were never accepted: their writes are dropped, and
`take_refused` names them for the front to refuse (with the fault's code),
as it refuses every submit while the fault lasts.

Damage (SQLITE_CORRUPT, "not a database": a page that is not what SQLite
wrote, met by a write or a read the start did not make) is a storage fault
too, with `storage_error`, and a lasting one: the unit's writes are kept and
retried as above (a write that does not touch the damaged page commits),
but `damage` stays set until the daemon stops, so every submit is refused
meanwhile (a new call's row would meet the page again, or the next one's);
running calls go on (their done events are in the transcript). It is logged
once, at ERROR, with the file and what to do; a read that meets it
(`read_failed`) is refused with it, never raised as SQLite's error.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamfence.protocol import retention
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.sqlite_faults import is_damage, is_storage_fault
from streamfence.supervisor.journal_file import PROBE
from streamfence.supervisor.journal_sync import WalSyncer
from streamfence.supervisor.request_files import RequestFiles

log = logging.getLogger("streamfence.journal")

RETRY_FIRST_S = 0.05  # a faulted journal tries its kept writes again after this ...
RETRY_MAX_S = 1.0  # ... doubling up to this
REMIND_EVERY_S = 30.0  # a lasting fault is logged again this often


@dataclass(frozen=True, slots=True)
class StorageFault:
    """Why the journal cannot commit now: the code refused submits get, and
    the message they read (the file and SQLite's error, never a request)."""

    code: ErrorCode
    message: str
    since: float  # monotonic
    damage: bool = False  # the file is damaged (module docstring), not the disk or a lock


def storage_fault(path: str, exc: sqlite3.Error) -> StorageFault | None:
    """The fault `exc` is (protocol/sqlite_faults.py: `is_storage_fault`, or
    damage), or None if it is none (a bug)."""
    if is_damage(exc):
        return StorageFault(ErrorCode.STORAGE_ERROR, f"{path} is damaged ({exc}): no new "
                            f"calls are accepted, running calls go on; stop the daemon, run "
                            f"`streamfence check`, then restore the file from a backup, or "
                            f"move the state dir away to start clean", time.monotonic(),
                            damage=True)
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


class WriteUnit:
    """Owns the open transaction, the kept writes, the calls the unit adds
    and finishes, the fault and its retries, and the callbacks waiting for
    a sync; writes through the Journal's connection `db`. `files`: a
    finished call's request file goes once its finish is synced; a call
    without one asks nothing of the disk when it finishes."""

    def __init__(self, path: str, db: sqlite3.Connection, files: RequestFiles) -> None:
        self._path = path
        self._db = db
        self._files = files
        self._in_tx = False
        self.finishing: list[str] = []  # calls the unit finishes: their files go once it commits
        self._syncer = WalSyncer(path)
        self._commits = 0  # COMMITs so far ...
        self._synced = 0  # ... and how many of them are on disk
        self._waiting: deque[tuple[int, Callable[[], object]]] = deque()  # (commit, then)
        self._unit: list[tuple[str | None, str, tuple[Any, ...]]] = []  # (call, sql, params)
        self._unit_calls: dict[str, bool] = {}  # calls the unit adds: in a file?
        self.fault: StorageFault | None = None
        self.damage: StorageFault | None = None  # met once: set until the daemon stops
        self._retry_due = 0.0
        self._retry_wait = RETRY_FIRST_S
        self._reminded = 0.0
        self._refused: list[str] = []  # calls of a failed unit, for `take_refused`
        self._refused_files: set[str] = set()  # ... whose request file is still being written

    def adds(self, call_id: str, in_file: bool) -> bool:
        """A new call's writes come next; False if it is refused at once (the
        unit is faulted: the front refuses submits meanwhile; so does this)."""
        if self.fault is not None or self.damage is not None:
            self._refused.append(call_id)
            return False
        self._unit_calls[call_id] = in_file
        return True

    def is_refused(self, call_id: str) -> bool:
        return call_id in self._refused

    def drop_refused_file(self, call_id: str) -> bool:
        """Whether `call_id`'s request file was written for a refused call (it
        is forgotten here: the caller removes it)."""
        if call_id not in self._refused_files:
            return False
        self._refused_files.discard(call_id)
        return True

    def write(self, call_id: str | None, sql: str, params: tuple[Any, ...]) -> None:
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
        except sqlite3.DatabaseError as exc:
            self._failed(exc)

    def _damaged(self, fault: StorageFault) -> bool:
        """Note damage (module docstring): logged the first time only. False:
        `fault` is no damage."""
        if not fault.damage:
            return False
        if self.damage is None:
            self.damage = fault
            log.error("journal: %s", fault.message)
        return True

    def read_failed(self, exc: sqlite3.DatabaseError) -> Exception:
        """What a read of the journal that raised `exc` raises instead: a
        ProtocolError with the fault's code for a storage fault or damage (the
        request that read is refused with it), else `exc` itself (a bug)."""
        fault = storage_fault(self._path, exc)
        if fault is None:
            return exc
        self._damaged(fault)
        return ProtocolError(fault.code, fault.message)

    def _failed(self, exc: sqlite3.DatabaseError) -> None:
        """The unit could not be written: roll it back, keep it, refuse its new calls."""
        fault = storage_fault(self._path, exc)
        if fault is None:
            raise exc
        damaged = self._damaged(fault)
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
            if not damaged:  # damage was logged once, by `_damaged`
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
        and how many writes wait for it. Damage shows while it lasts."""
        fault = self.fault or self.damage
        if fault is None:
            return None
        return {"code": fault.code.value, "message": fault.message,
                "for_s": round(time.monotonic() - fault.since, 1),
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
            for _, sql, params in self._unit or [(None, PROBE, (time.time(),))]:
                self._db.execute(sql, params)
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self._failed(exc)
            now = time.monotonic()
            if self.fault is not None and now - self._reminded >= REMIND_EVERY_S:
                self._reminded = now
                log.error("journal: still faulted after %.0fs: %s; %d write(s) kept",
                          now - self.fault.since, exc, len(self._unit))
            return False
        assert self.fault is not None
        # Damage stays (`damage`): what is written again is not news to log.
        (log.debug if self.damage is not None else log.warning)(
            "journal: %s writable again after %.1fs; %d kept write(s) committed",
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
            except sqlite3.DatabaseError as exc:
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
        filed = [call_id for call_id in self.finishing if self._files.holds(call_id)]
        self.finishing.clear()
        if filed:
            self._after_sync(functools.partial(self._remove_files, filed))
        if then is not None:
            self._after_sync(then)

    def _remove_files(self, call_ids: list[str]) -> None:
        for call_id in call_ids:
            self._files.remove(call_id)

    def _after_sync(self, then: Callable[[], object]) -> None:
        if self._commits <= self._synced:
            then()
            return
        self._waiting.append((self._commits, then))
        self._syncer.request(self._commits)

    def fsyncs(self) -> int:
        """How many times the WAL was fsynced (for `status`)."""
        return self._syncer.fsyncs()

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

    def close(self) -> None:
        """Commit, sync everything, and run what waited for it. Writes a
        lasting storage fault kept are lost with the process, and said so."""
        self.commit(retry_now=self.fault is not None)
        if self.fault is not None:
            log.error("journal: stopping with %d write(s) not committed (%s); the next start "
                      "recovers from the transcript", len(self._unit), self.fault.message)
        if self._commits > self._synced:
            self._syncer.request(self._commits)
        self._synced = self._syncer.close()
        self._run_synced()
