"""WAL checkpoints of transcript.db off the sink's loop.

The store's writer connection has auto-checkpoint off; a `Checkpointer`
thread with its own connection runs PASSIVE checkpoints at most once a
second, only after a commit. sqlite3 releases the GIL while it works, so
the checkpoint's fsync never stalls the sink loop (measured at 1k
deltas/s: p99 latency 4.7 ms inline, 0.24 ms here). Why a second, not
less: at a model's pace each checkpoint costs its fsyncs whatever it
moves (every 0.25 s it was a tenth of the sink's CPU at one paced
stream), and a second of WAL at the sink's top rate is some 15 MB (40 MB
at a steady 20k deltas/s, committed a few at a time).

A PASSIVE checkpoint never rewinds the WAL while the writer keeps
committing: SQLite rewinds it only at a write that begins once every
frame is checkpointed, and under steady load a commit always lands during
the checkpoint's fsyncs, so the -wal file grew for as long as the load
lasted (888 MB after 20 s at 20k deltas/s). A checkpoint that finds the
WAL past `limit_bytes` readies a rewind (`_ready_rewind`) and sets
`rewind_due`; the writer then rewinds it at its next commit
(TranscriptStore), which takes it about 1 ms.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

CHECKPOINT_EVERY_S = 1.0

log = logging.getLogger("streamfence.sink.store")


class Checkpointer:
    """WAL checkpoints on a thread and connection of their own: at most one per
    `every_s`, and only after a commit (`wake`), so an idle sink sleeps."""

    def __init__(self, path: str, limit_bytes: int,
                 every_s: float = CHECKPOINT_EVERY_S) -> None:
        self.path = path
        self.every_s = every_s
        self.limit_bytes = limit_bytes
        self.rewind_due = False  # set here, cleared by the writer that rewinds
        self._stopping = threading.Event()
        self._committed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sink-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The writer committed: the WAL has grown. (Once set, setting it again
        would only take the Event's lock: not per commit.)"""
        if not self._committed.is_set():
            self._committed.set()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            limit_frames = self.limit_bytes // conn.execute("PRAGMA page_size").fetchone()[0]
            failing = False  # logged once per run of failures (a full disk fails each try)
            while True:
                self._committed.wait()
                if self._stopping.is_set():
                    return
                self._committed.clear()
                try:
                    frames = self._checkpoint(conn)
                    if frames >= limit_frames:
                        self._ready_rewind(conn)
                    if failing:
                        failing = False
                        log.info("sink: WAL checkpoints of %s work again", self.path)
                except (sqlite3.Error, OSError) as exc:
                    if not failing:
                        failing = True
                        log.warning("sink: WAL checkpoint of %s failed (retried every %g s): %s",
                                    self.path, self.every_s, exc)
                    self._committed.set()
                if self._stopping.wait(self.every_s):  # at most one per every_s
                    return
        finally:
            conn.close()

    def _ready_rewind(self, conn: sqlite3.Connection) -> None:
        """Leave the writer's rewind little to do: one more checkpoint at once
        (what is left to move is then only what came during this one), and
        the pages checkpoints wrote to the database file, which SQLite syncs
        only when one moved every frame (never, under steady load), synced
        here (5-10 ms at 20k deltas/s, on the sink's loop otherwise)."""
        self._checkpoint(conn)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self.rewind_due = True

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection) -> int:
        """One PASSIVE checkpoint: it never waits for (or blocks) the writer.
        Returns the frames in the WAL."""
        frames: int = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
        return frames

    def stop(self) -> None:
        self._stopping.set()
        self._committed.set()
        if self._thread.is_alive():
            self._thread.join(10.0)
