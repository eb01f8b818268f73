"""A descriptor a thread makes readable to wake the supervisor's loop (which
polls it); the loop clears it before reading what the thread left."""

from __future__ import annotations

import contextlib
import socket


class Wakeup:
    """Owns a socket pair: `set` from the thread, `fileno` polled and `clear`ed by the loop."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def set(self) -> None:
        with contextlib.suppress(OSError):
            self._w.send(b"x")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._r.recv(4096):
                pass

    def close(self) -> None:
        self._r.close()
        self._w.close()
