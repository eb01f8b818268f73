"""Who is speaking on the client socket (docs/SECURITY.md).

`ClientAuth` owns the client socket's authentication: with `auth = "curve"`
it runs pyzmq's ZAP authenticator over the key store and makes the socket a
CURVE server, creates the daemon's own user's admin credentials on first
start, and names the identity of every message by its key, looked up again
each time so that a revoked or rotated key stops at once. With
`auth = "none"` every message is the `local` admin.

While `refuse_handshakes(True)` holds (streamfence.supervisor.connections:
the connection cap, or no descriptors left for clients), ZAP refuses every
new handshake (curve only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import zmq

from streamfence.config.identities import Identity, identity_named
from streamfence.protocol.credentials import LOCAL_NAME
from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator

log = logging.getLogger("streamfence.auth")


class ClientAuth:
    """Owns the ZAP authenticator thread (if any) and the identities' config."""

    def __init__(self, context: zmq.Context[Any], keys: KeyStore, mode: str,
                 identities: Mapping[str, Identity], endpoint: str) -> None:
        self._keys = keys
        self._identities = identities
        self._zap = None
        if mode == "curve":
            # The other hosts' keys are known from the cluster only, never from a
            # previous run's file (cluster mode: supervisor/shared_keys.py).
            keys.forget_shared()
            keys.log_changes = True  # this process logs the key changes (protocol/keys.py)
            self._zap = start_authenticator(context, keys)
            local = keys.credentials_path(LOCAL_NAME)
            if not local.exists():
                keys.register(LOCAL_NAME, endpoint, replace=True)
                log.info("created the admin credentials of this user: %s", local)

    def use(self, identities: Mapping[str, Identity]) -> None:
        """Reloaded identities (supervisor/reload.py): the next request's limits."""
        self._identities = identities

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make the client socket (before bind) a CURVE server, if auth is on."""
        if self._zap is not None:
            make_curve_server(sock, self._keys)

    def refuse_handshakes(self, refuse: bool) -> None:
        if self._zap is not None:
            self._zap.full = refuse

    def counts(self) -> dict[str, int]:
        """For `status`: handshakes refused (unregistered key; at the cap)."""
        refused = self._zap.refused if self._zap is not None else 0
        refused_full = self._zap.refused_full if self._zap is not None else 0
        return {"auth_refused": refused, "refused.max_connections": refused_full}

    def user_of(self, frame: zmq.Frame) -> Identity | None:
        """The identity that sent `frame`; None if its key is no longer registered."""
        if self._zap is None:
            return identity_named(LOCAL_NAME, self._identities)
        name = self._keys.identity_of(str(frame.get("User-Id")).encode())
        return None if name is None else identity_named(name, self._identities)

    def stop(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
