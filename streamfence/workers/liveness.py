"""Shared liveness table: one row per worker slot, written by the worker on
every real provider chunk, read by the supervisor's stale check.

Why shared memory and not messages: liveness is needed at chunk rate but read
only a few times a second, so a store of two integers per chunk beats a
message per chunk (or a coalescing timer) by orders of magnitude. CLOCK_MONOTONIC
is system-wide on Linux, so the worker's and the supervisor's clocks agree.

Row layout (int64 each): token, last_chunk_ns, chunks, bytes, stream_over.
`token` names the attempt run the row belongs to; the supervisor ignores a
row whose token is not the one it handed out, so a slot reused by the next
worker can never make a stale attempt look alive. `stream_over` is set when
the provider's stream has ended and the worker only waits for the sink: no
chunk is due any more, so the stale watchdog must not blame the provider
for the sink's time (ARCHITECTURE §4.1).
"""

from __future__ import annotations

import mmap
import os
import time

FIELDS = 5
_ITEM = 8


class LivenessTable:
    """Owns the mapping of the shared liveness file: one row per worker slot."""

    def __init__(self, path: str, slots: int, create: bool = False) -> None:
        size = slots * FIELDS * _ITEM
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._rows = memoryview(self._map).cast("q")
        self.slots = slots

    def begin(self, slot: int, token: int) -> None:
        """Claim the row for a new attempt run (worker side, before the request)."""
        base = slot * FIELDS
        rows = self._rows
        rows[base + 1] = 0
        rows[base + 2] = 0
        rows[base + 3] = 0
        rows[base + 4] = 0
        rows[base] = token

    def touch(self, slot: int, nbytes: int) -> None:
        """A real chunk arrived (worker side, hot path)."""
        base = slot * FIELDS
        rows = self._rows
        rows[base + 1] = time.monotonic_ns()
        rows[base + 2] += 1
        rows[base + 3] += nbytes

    def end_stream(self, slot: int) -> None:
        """The provider's stream is over; what is left is the sink's (worker side)."""
        self._rows[slot * FIELDS + 4] = 1

    def stream_over(self, slot: int) -> bool:
        return bool(self._rows[slot * FIELDS + 4])

    def read(self, slot: int) -> tuple[int, int, int, int]:
        """(token, last_chunk_ns, chunks, bytes) of a slot (supervisor side)."""
        base = slot * FIELDS
        rows = self._rows
        return rows[base], rows[base + 1], rows[base + 2], rows[base + 3]

    def close(self) -> None:
        self._rows.release()
        self._map.close()
