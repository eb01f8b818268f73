"""The journal's fsync, on a thread: group commit without stalling the loop.

The journal commits with synchronous=NORMAL: a COMMIT appends its frames to
the WAL file and returns without waiting for the disk. What must survive a
power cut before the daemon says so (an `accepted` reply, an attempt's epoch
before its worker may send) waits for this thread to fsync the WAL file,
which makes every frame written before it durable: SQLite's recovery replays
the WAL up to its last whole commit. One fsync covers every commit made
before it started, so commits of many loop turns share one (group commit).
Measured in the heavy-clients chaos run: the loop's own fsyncs, behind the
large requests' file writes on the same disk, took 20-45 ms each.
"""

from __future__ import annotations

import logging
import os
import threading

from streamfence.supervisor.wakeup import Wakeup

log = logging.getLogger("streamfence.journal")


class WalSyncer:
    """Owns the sync thread and its counters: `request(n)` asks for commit
    number n to be made durable; `synced()` says up to which it is."""

    def __init__(self, db_path: str) -> None:
        self._wal = db_path + "-wal"
        self._dir = os.path.dirname(os.path.abspath(db_path))
        self._cond = threading.Condition()
        self._wanted = 0
        self._synced = 0
        self._fsyncs = 0  # of the WAL, done (for `status`)
        self._stopping = False
        self._wakeup = Wakeup()
        self._thread = threading.Thread(target=self._run, name="journal-sync", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Readable when `synced()` has moved (the loop polls it)."""
        return self._wakeup.fileno()

    def request(self, commit_no: int) -> None:
        with self._cond:
            if commit_no > self._wanted:
                self._wanted = commit_no
                self._cond.notify()

    def synced(self) -> int:
        self._wakeup.clear()
        with self._cond:
            return self._synced

    def fsyncs(self) -> int:
        """How many times the thread has fsynced the WAL."""
        with self._cond:
            return self._fsyncs

    def close(self) -> int:
        """Sync what was asked for, stop, and say up to which commit is durable."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30.0)
        self._wakeup.close()
        with self._cond:
            return self._synced

    def _run(self) -> None:
        dir_synced = False
        while True:
            with self._cond:
                while self._wanted <= self._synced and not self._stopping:
                    self._cond.wait()
                if self._wanted <= self._synced:
                    return  # stopping, and nothing left to sync
                target = self._wanted
            try:
                fd = os.open(self._wal, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if not dir_synced:  # the WAL file's own directory entry, once
                    fd = os.open(self._dir, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    dir_synced = True
            except OSError as exc:
                # Nothing is acknowledged as durable; the next request tries again.
                log.error("journal: cannot sync %s: %s", self._wal, exc)
                with self._cond:
                    if self._stopping:
                        return
                    self._cond.wait(1.0)
                continue
            with self._cond:
                self._synced = max(self._synced, target)
                self._fsyncs += 1
            self._wakeup.set()
