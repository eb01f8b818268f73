"""Who is speaking on the client socket (docs/SECURITY.md).

`ClientAuth` owns the client socket's authentication: with `auth = "curve"`
it runs pyzmq's ZAP authenticator over the key store and makes the socket a
CURVE server, creates the daemon's own user's admin credentials on first
start, and names the identity of every message by its key, looked up again
each time so that a revoked or rotated key stops at once. With
`auth = "none"` every message is the `local` admin.

It also counts the client connections (the socket's monitor: accepted,
disconnected) for `[daemon] max_connections`: at the cap, new handshakes are
refused at ZAP (curve only; with `none` the cap is only logged), with one
log line when it is reached and one when it is left. libzmq's I/O thread
sends monitor events with a blocking send, so the monitor's queue has no
limit (RCVHWM 0) and the loop drains it every time it is readable: the I/O
thread never waits on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from streamfence.config.identities import Identity, identity_named
from streamfence.protocol.credentials import LOCAL_NAME
from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator

log = logging.getLogger("streamfence.auth")


CAP_LOG_EVERY_S = 10.0  # "cap reached" and "cannot accept" lines, at most this often
_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED


class ClientAuth:
    """Owns the ZAP authenticator thread (if any), the identities' config, and
    the count of client connections (its monitor socket)."""

    def __init__(self, context: zmq.Context[Any], keys: KeyStore, mode: str,
                 identities: Mapping[str, Identity], endpoint: str,
                 max_connections: int = 0) -> None:
        self._context = context
        self._keys = keys
        self._identities = identities
        self._max_connections = max_connections
        self.connections = 0
        self.accept_failed = 0
        self._full = False
        self._logged: dict[str, float] = {}  # what was last logged when (rate limit)
        self.monitor: zmq.Socket[bytes] | None = None
        self._zap = None
        if mode == "curve":
            self._zap = start_authenticator(context, keys)
            local = keys.credentials_path(LOCAL_NAME)
            if not local.exists():
                keys.register(LOCAL_NAME, endpoint, replace=True)
                log.info("created the admin credentials of this user: %s", local)

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make the client socket (before bind) a CURVE server, if auth is on,
        and watch its connections (before bind: none is missed)."""
        if self._zap is not None:
            make_curve_server(sock, self._keys)
        where = f"inproc://streamfence-client-connections-{id(self)}"
        sock.monitor(where, _WATCHED)
        monitor: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)
        monitor.rcvhwm = 0
        monitor.connect(where)
        self.monitor = monitor

    def on_monitor(self) -> None:
        """The loop's turn when the monitor is readable: count the connections,
        and refuse new handshakes while the cap is reached."""
        assert self.monitor is not None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_ACCEPTED:
                self.connections += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connections = max(0, self.connections - 1)
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self.accept_failed += 1
                self._log_at_most_every("accept", logging.ERROR,
                                        "cannot accept client connections: %s (%d so far)",
                                        _strerror(event["value"]), self.accept_failed)
        # The count includes the connections whose handshake is not done yet:
        # those past the cap are the ones refused.
        full = bool(self._max_connections) and self.connections > self._max_connections
        if full and not self._full:
            self._log_at_most_every(
                "cap", logging.WARNING, "connection cap reached (max_connections %d): new "
                "clients are refused until some close", self._max_connections)
        elif self._full and not full:
            log.info("below the connection cap again: %d client connections", self.connections)
        self._full = full
        if self._zap is not None:
            self._zap.full = full

    def _log_at_most_every(self, what: str, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, -CAP_LOG_EVERY_S) >= CAP_LOG_EVERY_S:
            self._logged[what] = now
            log.log(level, msg, *args)

    def counts(self) -> dict[str, int]:
        """For `status`: handshakes refused (unregistered key; at the cap), connections."""
        refused = self._zap.refused if self._zap is not None else 0
        refused_full = self._zap.refused_full if self._zap is not None else 0
        return {"auth_refused": refused, "refused.max_connections": refused_full,
                "connections": self.connections, "accept_failed": self.accept_failed}

    def close_monitor(self, sock: zmq.Socket[bytes]) -> None:
        """Before `sock` closes: no event may go to a monitor nobody reads."""
        if self.monitor is not None:
            sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None

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


def _strerror(code: int) -> str:
    return zmq.strerror(code) if code else "unknown error"
