"""The signals the supervisor answers. SIGTERM and SIGINT ask the daemon to
stop; SIGHUP asks it to read its config file again (supervisor/reload.py).
The handlers only set a flag (`requested`) or count (`take_hangups`), which
the loop turns into the same stop a client could ask for, or a reload; the
signal's byte on a socket pair the loop polls ends its poll at once (the
loop may sleep for seconds).

A terminal that closes sends SIGHUP to the whole process group: the
supervisor reloads (a config unchanged changes nothing) and its children
ignore SIGHUP from their start. Until the loop runs (`hold_hangups`) the
supervisor ignores it too, and the children it spawns meanwhile inherit
that: a SIGHUP before the daemon is up reloads nothing.
"""

from __future__ import annotations

import contextlib
import signal
import socket
from typing import Any


class StopSignals:
    """Owns the stop flag, the count of SIGHUPs the loop has not answered
    and, from `install` to `uninstall`, the wakeup socket pair: `fileno`
    polled and `clear`ed by the loop."""

    def __init__(self) -> None:
        self.requested = False
        self._hangups = 0
        self._wake: list[socket.socket] = []  # (read end, write end) once installed

    def request(self, signum: int = 0, frame: Any = None) -> None:
        self.requested = True

    def _hangup(self, signum: int, frame: Any) -> None:
        self._hangups += 1  # answered by the loop (`take_hangups`), not in the handler

    @staticmethod
    def hold_hangups() -> None:
        """Before the children start: SIGHUP is ignored until `install`."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.request)
        signal.signal(signal.SIGINT, self.request)
        signal.signal(signal.SIGHUP, self._hangup)
        self._wake = list(socket.socketpair())
        for end in self._wake:
            end.setblocking(False)
        signal.set_wakeup_fd(self._wake[1].fileno(), warn_on_full_buffer=False)

    def fileno(self) -> int:
        return self._wake[0].fileno()

    def clear(self) -> None:
        """Read the signals' bytes (the flag and the count say what they meant)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake[0].recv(512):
                pass

    def take_hangups(self) -> bool:
        """Whether a SIGHUP came since the last call: several are one reload."""
        hangups, self._hangups = self._hangups, 0
        return hangups > 0

    def uninstall(self) -> None:
        signal.set_wakeup_fd(-1)
        for end in self._wake:
            end.close()
