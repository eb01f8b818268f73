"""Who is speaking on the client socket, and how many may connect (docs/SECURITY.md).

`ClientAuth` owns the client socket's authentication: with `auth = "curve"`
it runs pyzmq's ZAP authenticator over the key store and makes the socket a
CURVE server, creates the daemon's own user's admin credentials on first
start, and names the identity of every message by its key, looked up again
each time so that a revoked or rotated key stops at once. With
`auth = "none"` every message is the `local` admin.

It also caps the client socket's live connections (`ConnectionCap`, in every
auth mode): past the cap a new connection's handshake is refused and closed,
so idle clients cannot take the last descriptors (libzmq's listener spins on
accept when the process has none left).
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Mapping
from typing import Any

import zmq

from streamfence.protocol.credentials import LOCAL_NAME
from streamfence.protocol.keys import (
    ZAP_DOMAIN,
    ConnectionCap,
    KeyStore,
    ZapAuthenticator,
    make_curve_server,
    start_authenticator,
)
from streamfence.supervisor.identities import Identity, identity_named

log = logging.getLogger("streamfence.auth")

# The default cap on client connections: what the open-files limit leaves
# once the rest of the supervisor is provided for, within these bounds.
MAX_CONNECTIONS_CEILING = 4096  # a hard limit of 1M must not mean "no cap"
MAX_CONNECTIONS_FLOOR = 32  # a limit too low for workers_max (warned at start) still serves a few
FD_RESERVE = 256  # journal + WAL, sockets, libzmq's mailboxes and poller, handshakes past the cap
FD_PER_WORKER = 4  # the supervisor holds ~2 per worker (1,044 at 500 workers): twice that


def default_max_connections(workers_max: int) -> int:
    """The cap on client connections when none is configured, from the current
    open-files soft limit (read after the daemon has raised it):
    min(4096, soft - 256 - 4 x workers_max), at least 32. The room left under
    the limit is what `_raise_fd_limit` asks for (256 + 4 x workers_max): the
    workers' descriptors with a margin of two, the supervisor's own files and
    sockets, and connections still in their handshake beyond the cap (each
    holds a descriptor until ZAP refuses it or the handshake timer ends it),
    so that accept() does not run out first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    room = soft - FD_RESERVE - FD_PER_WORKER * workers_max
    return max(MAX_CONNECTIONS_FLOOR, min(MAX_CONNECTIONS_CEILING, room))


class ClientAuth:
    """Owns the ZAP authenticator thread, the connection cap and the identities' config."""

    def __init__(self, context: zmq.Context[Any], keys: KeyStore, mode: str,
                 identities: Mapping[str, Identity], endpoint: str) -> None:
        self._context = context
        self._keys = keys
        self._curve = mode == "curve"
        self._identities = identities
        self._zap: ZapAuthenticator | None = None  # started by `secure`, with the cap
        self._cap: ConnectionCap | None = None
        if self._curve:
            local = keys.credentials_path(LOCAL_NAME)
            if not local.exists():
                keys.register(LOCAL_NAME, endpoint, replace=True)
                log.info("created the admin credentials of this user: %s", local)

    def secure(self, sock: zmq.Socket[bytes], max_connections: int) -> None:
        """Before `sock` (the client socket) binds: cap its live connections at
        `max_connections`, and make it a CURVE server if auth is on. With
        auth = "none" the socket gets a ZAP domain only: libzmq then asks ZAP
        about NULL handshakes too, so the cap holds there as well (every NULL
        client within the cap is accepted)."""
        self._cap = ConnectionCap(max_connections)
        self._cap.watch(sock)
        self._zap = start_authenticator(self._context, self._keys, self._cap)
        if self._curve:
            make_curve_server(sock, self._keys)
        else:
            sock.zap_domain = ZAP_DOMAIN.encode()

    @property
    def refused(self) -> int:
        """CURVE handshakes refused for an unregistered key."""
        return self._zap.refused if self._zap is not None else 0

    @property
    def max_connections(self) -> int:
        """The cap on the client socket's live connections (0 before `secure`)."""
        return self._cap.limit if self._cap is not None else 0

    @property
    def connections(self) -> int:
        """The client socket's live connections (accepted, not yet closed),
        as of the ZAP thread's last look at the socket's monitor."""
        return self._cap.live if self._cap is not None else 0

    @property
    def connections_refused(self) -> int:
        """Handshakes refused because the connections were at the cap."""
        return self._cap.refused if self._cap is not None else 0

    def user_of(self, frame: zmq.Frame) -> Identity | None:
        """The identity that sent `frame`; None if its key is no longer registered."""
        if not self._curve:
            return identity_named(LOCAL_NAME, self._identities)
        name = self._keys.identity_of(str(frame.get("User-Id")).encode())
        return None if name is None else identity_named(name, self._identities)

    def stop(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
