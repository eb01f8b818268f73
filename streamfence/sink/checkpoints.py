"""The transcript's WAL checkpoints, on a thread and a connection of their own.

The sink's writer connection turns auto-checkpoint off: an automatic
checkpoint runs inside the commit that passes the WAL's threshold, copying
the WAL into the database and syncing it, in the loop. A `Checkpointer`
does it instead on its own thread (sqlite3 releases the GIL while it
works), PASSIVE (it never waits for or blocks the writer), at most once per
`every_s` and only after a commit, so an idle sink sleeps.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("streamfence.sink")

CHECKPOINT_EVERY_S = 0.25


class Checkpointer:
    """Checkpoints of the database at `path` (see the module docstring)."""

    def __init__(self, path: str, every_s: float = CHECKPOINT_EVERY_S) -> None:
        self.path = path
        self.every_s = every_s
        self._stopping = threading.Event()
        self._committed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"checkpoint-{os.path.basename(path)}")

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """The writer committed: the WAL has grown."""
        self._committed.set()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
            while True:
                self._committed.wait()
                if self._stopping.is_set():
                    return
                self._committed.clear()
                try:
                    # PASSIVE: never waits for (or blocks) the writer.
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    log.warning("WAL checkpoint of %s failed (will retry): %s", self.path, exc)
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
