"""WAL checkpoints of transcript.db off the sink's loop.

The store's writer connection has auto-checkpoint off; a `Checkpointer`
thread with its own connection runs PASSIVE checkpoints at most once a
second, only after a commit. sqlite3 releases the GIL while it works, so
the checkpoint's fsync never stalls the sink loop (measured at 1k
deltas/s: p99 latency 4.7 ms inline, 0.24 ms here). Why a second, not
less: at a model's pace each checkpoint costs its fsyncs whatever it
moves (every 0.25 s it was a tenth of the sink's CPU at one paced
stream), and a second of WAL at the sink's top rate is some 15 MB.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

CHECKPOINT_EVERY_S = 1.0

log = logging.getLogger("streamfence.sink.store")


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
        """The writer committed: the WAL has grown. (Once set, setting it again
        would only take the Event's lock: not per commit.)"""
        if not self._committed.is_set():
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
