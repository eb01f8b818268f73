"""The sink's control peer: the supervisor, the one that drives the sink and
hears how attempts ended."""

from __future__ import annotations

import logging
from typing import Protocol

import zmq

log = logging.getLogger("streamfence.sink")

BACKLOG_MAX = 200_000  # messages kept while no supervisor is connected


class Publisher(Protocol):
    """What the rest of the sink needs of `SupervisorPeer` (tests give a stand-in)."""

    def publish(self, frame: bytes) -> None: ...

    def stats(self) -> dict[str, int]: ...


class SupervisorPeer:
    """Owns who may drive the sink, the sending side of its unsolicited
    messages on `sink.ctl` (E_ENDED, E_FINAL_REFUSED), and those kept while
    that peer is unreachable.

    Only the supervisor may drive the sink: its DEALER carries a secret
    identity handed to the sink at spawn (never on a socket). Without one, the
    first peer that sends a valid control message is pinned for good."""

    def __init__(self, ctl: zmq.Socket[bytes], identity: bytes | None) -> None:
        self._ctl = ctl
        self._identity = identity
        self._peer: bytes | None = None  # where messages go (None: unreachable / not yet seen)
        self.backlog: list[bytes] = []
        self.unsent = 0  # over BACKLOG_MAX

    def admits(self, ident: bytes) -> bool:
        """May `ident` drive the sink?"""
        return self._identity is None or ident == self._identity

    def heard_from(self, ident: bytes) -> None:
        """A valid control message came from `ident` (which `admits`): messages
        go there from now on, the backlog first."""
        if self._identity is None:
            self._identity = ident  # trust on first use
        if ident == self._peer:
            return
        self._peer = ident
        backlog, self.backlog = self.backlog, []
        for frame in backlog:
            self.publish(frame)

    def publish(self, frame: bytes) -> None:
        """Send one frame (an E_* message) to the supervisor, or keep it."""
        peer = self._peer
        if peer is not None:
            try:
                self._ctl.send(peer, zmq.SNDMORE)
                self._ctl.send(frame)
                return
            except zmq.ZMQError as exc:
                log.warning("sink: supervisor control peer unreachable (%s); keeping its "
                            "messages", exc)
                self._peer = None
        if len(self.backlog) < BACKLOG_MAX:
            self.backlog.append(frame)
        else:
            self.unsent += 1

    def stats(self) -> dict[str, int]:
        return {"ctl_buffered": len(self.backlog), "ctl_unsent": self.unsent}
