"""The sink's control peer: the supervisor, the only reader of its events."""

from __future__ import annotations

import logging

import msgpack
import zmq
import zmq.backend

from streamfence.protocol.internal.control import EVENTS_BATCH_HEAD

log = logging.getLogger("streamfence.sink")

BACKLOG_MAX = 200_000  # events kept while no supervisor is connected
BATCH_MAX = 4096  # E_EVENT frames per E_EVENTS message
_raw_send = zmq.backend.Socket.send  # the compiled send, under pyzmq's Python-level one


class SupervisorPeer:
    """Owns who may drive the sink and receive its events, the sending side of
    events on `sink.ctl`, and the events kept while that peer is unreachable.

    Only the supervisor may drive the sink: its DEALER carries a secret
    identity handed to the sink at spawn (never on a socket). Without one, the
    first peer that sends a valid control message is pinned for good."""

    def __init__(self, ctl: zmq.Socket[bytes], identity: bytes | None) -> None:
        self._ctl = ctl
        self._identity = identity
        self._peer: bytes | None = None  # where events go (None: unreachable / not yet seen)
        self.backlog: list[bytes] = []
        self.events_unsent = 0  # over BACKLOG_MAX: still in the store, subscribers can replay
        self._batch_header = msgpack.Packer().pack_array_header
        self._send = _raw_send.__get__(ctl)

    def admits(self, ident: bytes) -> bool:
        """May `ident` drive the sink?"""
        return self._identity is None or ident == self._identity

    def heard_from(self, ident: bytes) -> None:
        """A valid control message came from `ident` (which `admits`): events go
        there from now on, the backlog first."""
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
                self._lose(exc)
        self._keep(frame)

    def publish_all(self, frames: list[bytes]) -> None:
        """The E_EVENT frames of one commit, as E_EVENTS messages (in slices of
        BATCH_MAX): the supervisor then decodes once per batch."""
        peer = self._peer
        if peer is None:
            for frame in frames:
                self._keep(frame)
            return
        send = self._send
        header = self._batch_header
        for start in range(0, len(frames), BATCH_MAX):
            part = frames[start:start + BATCH_MAX]
            body = part[0] if len(part) == 1 else \
                EVENTS_BATCH_HEAD + header(len(part)) + b"".join(part)
            try:
                send(peer, zmq.SNDMORE)
                send(body)
            except zmq.ZMQError as exc:
                self._lose(exc)
                for rest in frames[start:]:
                    self._keep(rest)
                return

    def stats(self) -> dict[str, int]:
        return {"events_buffered": len(self.backlog), "events_unsent": self.events_unsent}

    def _keep(self, frame: bytes) -> None:
        if len(self.backlog) < BACKLOG_MAX:
            self.backlog.append(frame)
        else:
            self.events_unsent += 1

    def _lose(self, exc: zmq.ZMQError) -> None:
        log.warning("sink: supervisor control peer unreachable (%s); buffering events", exc)
        self._peer = None
