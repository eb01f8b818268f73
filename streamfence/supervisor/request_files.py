"""Large requests, journaled as files written and synced on a thread.

Storing a 12 MB request in journal.db costs the loop about 70 ms (SQLite
writes it page by page into the WAL, then syncs it), and every other client
waits that long. A file written with one `write` and synced by a thread of
its own costs the loop nothing: `os.write` and `os.fsync` let go of the GIL.
The journal (the only user of this class) keeps the call's row in state
`staging` until the file is durable, and the call is accepted only then.

Files are `<dir>/<call_id>`, written as `<call_id>.part` and renamed once
synced (then the directory is synced), so a file under its final name is
whole. The journal removes a call's file when the call is done; a call that
`holds` names no file (most: a request under FILE_BYTES stays in the
journal), so its end costs no unlink and no sync.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import deque
from pathlib import Path

from streamfence.supervisor.wakeup import Wakeup

STOP_JOIN_S = 10.0  # at shutdown, for the files still being written
SYNC_EVERY_BYTES = 1 << 20  # written and synced a slice at a time (see _write)


class RequestFiles:
    """Owns the directory of request files and the thread that writes them."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        self.dir = directory
        self._todo: queue.SimpleQueue[tuple[str, bytes | memoryview] | None] = queue.SimpleQueue()
        self._done: deque[tuple[str, OSError | None]] = deque()
        self._held: set[str] = set()  # calls that may have a file here (the loop's view)
        self._wakeup = Wakeup()  # set per file done; the loop polls `fileno()`
        self._thread = threading.Thread(target=self._run, name="request-files", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        return self._wakeup.fileno()

    def write(self, call_id: str, body: bytes | memoryview) -> None:
        """Write and sync `body` as `call_id`'s file; `written()` says when."""
        self._held.add(call_id)
        self._todo.put((call_id, body))

    def written(self) -> list[tuple[str, OSError | None]]:
        """The files finished since the last call: (call id, None) once durable,
        or (call id, the error) if it could not be written (nothing is left)."""
        self._wakeup.clear()
        out: list[tuple[str, OSError | None]] = []
        while self._done:
            call_id, error = self._done.popleft()
            if error is not None:  # the thread removed what it had written
                self._held.discard(call_id)
            out.append((call_id, error))
        return out

    def holds(self, call_id: str) -> bool:
        """Whether `call_id` may have a file here (written, or found at start)."""
        return call_id in self._held

    def read(self, call_id: str) -> bytes:
        return (self.dir / call_id).read_bytes()

    def remove(self, call_id: str) -> None:
        self._held.discard(call_id)
        self._unlink(call_id)

    def names(self) -> list[str]:
        """The call ids that have a file (whole or not), for the journal's sweep
        at start; `holds` names them from then on (until `remove`)."""
        found = {p.name.removesuffix(".part") for p in self.dir.iterdir()}
        self._held |= found
        return sorted(found)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(timeout=STOP_JOIN_S)
        self._wakeup.close()

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            call_id, body = item
            error: OSError | None = None
            try:
                self._write(call_id, body)
            except OSError as exc:
                error = exc
                with contextlib.suppress(OSError):  # the thread must outlive any one file
                    self._unlink(call_id)
            self._done.append((call_id, error))
            self._wakeup.set()

    def _unlink(self, call_id: str) -> None:
        for name in (call_id, call_id + ".part"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / name)

    def _write(self, call_id: str, body: bytes | memoryview) -> None:
        part = self.dir / (call_id + ".part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Synced as it is written, a slice at a time: an fsync of the
            # journal queues behind the disk's pending writes (one journal
            # commit of the filesystem), so at most a slice of this file is
            # ever in front of it, never 12 MB.
            view = memoryview(body)
            while view:
                slice_end = min(len(view), SYNC_EVERY_BYTES)
                written = os.write(fd, view[:slice_end])
                view = view[written:]
                os.fdatasync(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(part, self.dir / call_id)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
