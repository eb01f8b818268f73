"""Why a client gets no answer, said within a second: `LinkWatch`, `NoConnection`.

Until its first handshake succeeds, a client's request socket has a ZeroMQ
socket monitor (`LINK_EVENTS`, made by client_sockets.watch_link). libzmq
tells it at once what happens to the connection:

    EVENT_CONNECT_RETRIED without EVENT_CONNECTED before it
                                  nothing listens at the endpoint (every
                                  reconnect interval, ~0.1-0.2 s)
    EVENT_HANDSHAKE_FAILED_AUTH   the daemon's ZAP refused the handshake
                                  (value 400): a key it does not accept
                                  (unregistered, revoked, rotated), or its
                                  connection cap (a ZAP 300, "try later",
                                  would reach the client as nothing at all:
                                  libzmq drops the connection silently)
    EVENT_HANDSHAKE_FAILED_PROTOCOL  CURVE on one side only (value
                                  ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
                                  no credentials for a CURVE daemon, or
                                  credentials for an `auth = "none"` one
    EVENT_HANDSHAKE_FAILED_NO_DETAIL  the daemon dropped the handshake: it
                                  does not hold the server key the credentials
                                  name (they were made for another daemon),
                                  or, for a client without credentials, it
                                  wants CURVE. Over ipc:// a mechanism
                                  mismatch often shows so (a race of the
                                  greetings) before a retry names it: only
                                  DROPS_TO_TELL in a row count.
    EVENT_HANDSHAKE_SUCCEEDED     connected: the watch is over

libzmq does not reconnect after a refused (AUTH, PROTOCOL) handshake, so
those are final for the client; a missing daemon gets `NO_DAEMON_AFTER_S` of
a request's wait to appear (a daemon just starting). `LinkWatch` is the pure
part: the shell feeds it the monitor's events (`saw`), a flow waiting for an
answer asks it (`check`, which raises `NoConnection`) and wakes at its
`wake_at`. Once the link is up the shell closes the monitor: from then on a
missing answer is the plain TimeoutError after timeout_s, and nothing here
runs (one `up` test per wait, none per event).

`NoConnection` is a TimeoutError, so code that handled the slow timeout
handles it unchanged, only sooner; its `cause` names the case.
"""

from __future__ import annotations

from typing import Final

import zmq

from streamfence.protocol.credentials import ENV_CREDENTIALS, Credentials

LINK_EVENTS: Final = (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
                      | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
NO_DAEMON_AFTER_S = 0.5  # a request's wait with nothing listening before it fails
DROPS_TO_TELL = 3  # handshakes dropped without detail in a row that are a verdict

# The causes (`NoConnection.cause`).
NO_DAEMON = "no_daemon"
KEY_REFUSED = "key_refused"
NO_CREDENTIALS = "no_credentials"
NOT_CURVE = "not_curve"
WRONG_DAEMON = "wrong_daemon"
HANDSHAKE_FAILED = "handshake_failed"


class NoConnection(TimeoutError):
    """No answer can come: the client could not connect to its daemon, for `cause`."""

    def __init__(self, cause: str, endpoint: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.endpoint = endpoint


class LinkWatch:
    """The state of a client's connection until its first handshake (module docstring)."""

    def __init__(self, endpoint: str, credentials: Credentials | None) -> None:
        self.endpoint = endpoint
        self.credentials = credentials
        self.up = False  # a handshake succeeded: nothing more to watch
        self.cause: str | None = None  # why it is not up (None: not known yet)
        self._detail = 0  # the failure event's value
        self._tcp = False  # connected since the last retry: something listens
        self._dropped = 0  # handshakes dropped without detail in a row

    def saw(self, event: int, value: int) -> None:
        """One monitor event (its number and value)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up, self.cause = True, None
        elif event == zmq.EVENT_CONNECTED:
            self._tcp = True
            if self.cause == NO_DAEMON:
                self.cause = None
        elif event == zmq.EVENT_CONNECT_RETRIED:
            if not self._tcp:
                self.cause = NO_DAEMON
            self._tcp = False
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._dropped += 1
            # Without credentials, a drop is a CURVE daemon's (it takes any NULL client
            # otherwise): two tell; with them, the mismatch may yet show (docstring).
            if self._dropped >= (2 if self.credentials is None else DROPS_TO_TELL):
                self.cause, self._detail = self._refusal(event, value), value
        else:
            self._dropped = 0
            self.cause, self._detail = self._refusal(event, value), value

    def _refusal(self, event: int, value: int) -> str:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return KEY_REFUSED
        if (event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
            return NO_CREDENTIALS if self.credentials is None else NOT_CURVE
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return NO_CREDENTIALS if self.credentials is None else WRONG_DAEMON
        return HANDSHAKE_FAILED

    def check(self, since: float, now: float) -> None:
        """Raise NoConnection if no answer can come to a wait begun at `since`."""
        if self.up or self.cause is None:
            return
        if self.cause == NO_DAEMON and now - since < NO_DAEMON_AFTER_S:
            return
        raise NoConnection(self.cause, self.endpoint, self.explain())

    def wake_at(self, since: float, deadline: float, now: float) -> float:
        """When a wait begun at `since` must look again (`check`), at the latest: at
        the end of the grace for a missing daemon; after it, a monitor event
        wakes the wait (the shells watch the monitor)."""
        grace_ends = since + NO_DAEMON_AFTER_S
        return grace_ends if not self.up and now < grace_ends < deadline else deadline

    def explain(self) -> str:
        """The one-line message of the current cause."""
        at, creds = self.endpoint, self.credentials
        name = repr(creds.name) if creds is not None else ""
        made_for = ""  # (d): credentials of another endpoint
        if creds is not None and creds.endpoint != at:
            made_for = f" (the credentials of {name} were made for {creds.endpoint})"
        cause = self.cause
        if cause == NO_DAEMON:
            return (f"no daemon at {at}: nothing accepts connections there; is `streamfence "
                    f"serve` running, with this endpoint?{made_for}")
        if cause == KEY_REFUSED:
            return (f"the daemon at {at} refused the credentials of {name}: their key is not "
                    f"registered with it (never, or revoked or rotated since); `streamfence "
                    f"keys list` on its host shows who is, `streamfence keys rotate "
                    f"{creds.name if creds else 'NAME'}` makes new credentials; or it is at "
                    f"its connection cap (max_connections){made_for}")
        if cause == NO_CREDENTIALS:
            return (f"the daemon at {at} takes only CURVE clients, and this client has no "
                    f"credentials: pass credentials=PATH to Client (--credentials PATH to the "
                    f"CLI) or set ${ENV_CREDENTIALS}=PATH; `streamfence keys new NAME` on "
                    f"the daemon's host makes them, and its own user's are "
                    f"<state_dir>/keys/local.credentials")
        if cause == NOT_CURVE:
            return (f"the daemon at {at} does not use CURVE (auth = \"none\"), but this "
                    f"client has credentials ({name}): connect without them")
        if cause == WRONG_DAEMON:
            if creds is not None and creds.endpoint != at:
                why = f"they were made for {creds.endpoint}"
            else:
                why = (f"were its keys made anew? `streamfence keys rotate "
                       f"{creds.name if creds else 'NAME'}` there makes new credentials")
            return (f"the daemon at {at} is not the one the credentials of {name} were made "
                    f"for: it does not hold their server_key ({why})")
        return f"the handshake with the daemon at {at} failed (ZMTP error {self._detail:#x})"
