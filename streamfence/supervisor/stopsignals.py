"""SIGTERM and SIGINT ask the daemon to stop. The handler only sets a flag
(`requested`), which the loop turns into the same stop a client could ask
for; the signal's byte on a socket pair the loop polls ends its poll at
once (the loop may sleep for seconds).
"""

from __future__ import annotations

import contextlib
import signal
import socket
from typing import Any


class StopSignals:
    """Owns the flag and, from `install` to `uninstall`, the wakeup socket
    pair: `fileno` polled and `clear`ed by the loop."""

    def __init__(self) -> None:
        self.requested = False
        self._wake: list[socket.socket] = []  # (read end, write end) once installed

    def request(self, signum: int = 0, frame: Any = None) -> None:
        self.requested = True

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)
        self._wake = list(socket.socketpair())
        for end in self._wake:
            end.setblocking(False)
        signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)

    def fileno(self) -> int:
        return self._wake[0].fileno()

    def clear(self) -> None:
        """Read the signals' bytes (the flag says what they meant)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake[0].recv(512):
                pass

    def uninstall(self) -> None:
        signal.set_wakeup_fd(-1)
        for end in self._wake:
            end.close()
