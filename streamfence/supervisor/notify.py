"""Readiness notification to a service manager (systemd's `Type=notify`).

When `NOTIFY_SOCKET` is set, each notification is one datagram of
newline-separated assignments (`READY=1`, `STOPPING=1`, `STATUS=...`) sent
to that AF_UNIX datagram socket; a name starting with '@' is in the
abstract namespace. This is all of sd_notify(3) the daemon needs, so the
stdlib socket does it rather than a dependency. A notification that cannot
be sent is logged and otherwise ignored: the daemon serves either way.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger("streamfence.supervisor")


class Notifier:
    """Owns the service manager's address (read from the environment once,
    and removed from it so the children, which never notify, do not inherit
    it) and which of READY and STOPPING were sent (each at most once)."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        name = env.pop("NOTIFY_SOCKET", "")
        self._address = "\0" + name[1:] if name.startswith("@") else name
        self._sent: set[str] = set()

    def ready(self, status: str) -> None:
        """The daemon serves: it answers clients and has a warm worker."""
        self._once("READY=1", status)

    def stopping(self, status: str) -> None:
        """The daemon is stopping (draining its running calls, then exiting)."""
        self._once("STOPPING=1", status)

    def _once(self, state: str, status: str) -> None:
        if state in self._sent or not self._address:
            return
        self._sent.add(state)
        # One line per assignment: a newline in the status would start another.
        message = f"{state}\nSTATUS={' '.join(status.split())}"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall(message.encode())
        except OSError as exc:
            log.warning("could not notify the service manager (NOTIFY_SOCKET): %s", exc)
