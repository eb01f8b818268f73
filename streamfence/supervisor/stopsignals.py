"""SIGTERM and SIGINT ask the daemon to stop. The handler only sets a flag
(`requested`), which the loop turns into the same stop a client could ask
for; the signal's byte on a socket pair the loop polls ends its poll at
once (the loop may sleep for seconds).

SIGHUP does not stop it: reload is not supported yet, and a terminal that
closes sends SIGHUP to the whole process group. The supervisor says so in
one WARNING line per SIGHUP (from the loop, `clear`) and keeps running; its
children ignore SIGHUP from their start. Until the loop runs (`hold_hangups`)
the supervisor ignores it too, and the children it spawns meanwhile inherit that.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from typing import Any

log = logging.getLogger("streamfence.supervisor")

HANGUP_WARNING = ("SIGHUP: reload is not supported yet; restart the daemon to apply a new "
                  "config. The daemon keeps running")


class StopSignals:
    """Owns the flag, the count of SIGHUPs not yet logged and, from `install`
    to `uninstall`, the wakeup socket pair: `fileno` polled and `clear`ed by
    the loop."""

    def __init__(self) -> None:
        self.requested = False
        self._hangups = 0
        self._wake: list[socket.socket] = []  # (read end, write end) once installed

    def request(self, signum: int = 0, frame: Any = None) -> None:
        self.requested = True

    def _hangup(self, signum: int, frame: Any) -> None:
        self._hangups += 1  # logged by the loop (`clear`), not in the handler

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
        """Read the signals' bytes (the flag says what they meant); say what
        each SIGHUP since the last call did not do."""
        with contextlib.suppress(BlockingIOError):
            while self._wake[0].recv(512):
                pass
        hangups, self._hangups = self._hangups, 0
        for _ in range(hangups):
            log.warning(HANGUP_WARNING)

    def uninstall(self) -> None:
        signal.set_wakeup_fd(-1)
        for end in self._wake:
            end.close()
