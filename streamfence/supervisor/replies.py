"""The bytes of replies queued to clients that do not read them, bounded.

The client socket is a ROUTER with ROUTER_MANDATORY: a reply that cannot be
queued (the connection's queue holds SEND_HWM messages, or the connection
is gone) raises at once instead of being dropped unseen, and is counted.
A message count does not bound bytes, so a reply of TRACK_BYTES or more is
sent zero-copy with a tracker: libzmq releases it once it has written it
to the connection, which is the only sign of a peer reading that the
supervisor can see. Such a reply is queued only while its connection holds
less than CONNECTION_BYTES of them not yet written and all connections
together less than TOTAL_BYTES; past either, the request is answered
`reply_backlog` instead (a connection with nothing queued gets one reply
however large, within the total). So large replies to clients that never
read hold at most TOTAL_BYTES, and each connection at most SEND_HWM
replies under TRACK_BYTES besides (docs/SECURITY.md, "Limits").
"""

from __future__ import annotations

import errno
from collections import Counter, deque

import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.messages import error_msg

SEND_HWM = 1_000  # messages queued per client connection (the socket's SNDHWM)
TRACK_BYTES = 4 * 1024  # replies this large are tracked until libzmq has written them
CONNECTION_BYTES = 8 * 1024 * 1024  # tracked bytes not yet written, per connection
TOTAL_BYTES = 128 * 1024 * 1024  # the same, all connections together


class ReplyQueues:
    """Owns the accounting of large replies libzmq has not written yet, per
    routing id; sends every reply to a client (`send`). Counts under
    `replies_dropped.{unread,gone}` the replies that could not be queued
    and under `refused.reply_backlog` those answered `reply_backlog`."""

    def __init__(self, socket: zmq.Socket[bytes], counters: Counter[str]) -> None:
        socket.copy_threshold = 0  # copy=False is zero-copy whatever the size: trackable
        self._send_multipart = socket.send_multipart
        self._counters = counters
        # routing id -> (tracker, size) of its large replies, oldest first
        self._queued: dict[bytes, deque[tuple[zmq.MessageTracker, int]]] = {}
        self._bytes: dict[bytes, int] = {}  # routing id -> its tracked bytes not yet written
        self.total = 0  # all connections' tracked bytes not yet written (for `status`)

    def send(self, identity: bytes, frame: bytes, ref: str | None) -> None:
        """Queue `frame` (an encoded reply to the request `ref`) to `identity`."""
        size = len(frame)
        if size < TRACK_BYTES:
            self._send(identity, frame)
            return
        queued = self.queued_to(identity)
        if (queued and queued + size > CONNECTION_BYTES) or (
                self.total + size > TOTAL_BYTES and self._sweep() + size > TOTAL_BYTES):
            self._backlog(identity, ref, queued)
            return
        try:
            tracker = self._send_multipart([identity, frame], zmq.NOBLOCK, copy=False,
                                           track=True)
        except zmq.ZMQError as exc:
            self._dropped(exc)
            return
        assert tracker is not None  # track=True
        self._queued.setdefault(identity, deque()).append((tracker, size))
        self._bytes[identity] = queued + size
        self.total += size

    def _send(self, identity: bytes, frame: bytes) -> None:
        try:
            self._send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._dropped(exc)

    def _dropped(self, exc: zmq.ZMQError) -> None:
        if exc.errno == zmq.EAGAIN:  # SEND_HWM replies queued: the client does not read
            self._counters["replies_dropped.unread"] += 1
        elif exc.errno == errno.EHOSTUNREACH:  # the connection is gone
            self._counters["replies_dropped.gone"] += 1
        else:
            raise exc

    def _backlog(self, identity: bytes, ref: str | None, queued: int) -> None:
        self._counters["refused.reply_backlog"] += 1
        self._send(identity, encode(error_msg(
            ref, ErrorCode.REPLY_BACKLOG,
            f"{queued} bytes of replies to this connection are not read yet "
            f"({self.total} to all clients; limits {CONNECTION_BYTES} and {TOTAL_BYTES}): "
            f"read them, then ask again")))

    def queued_to(self, identity: bytes) -> int:
        """`identity`'s tracked bytes not yet written. (Forgets its replies
        libzmq has written, or dropped with its connection: they go in order.)"""
        queue = self._queued.get(identity)
        if queue is None:
            return 0
        written = 0
        while queue and queue[0][0].done:
            written += queue.popleft()[1]
        left = self._bytes[identity] - written
        self.total -= written
        if queue:
            self._bytes[identity] = left
        else:
            del self._queued[identity], self._bytes[identity]
        return left

    def _sweep(self) -> int:
        """Every connection's written replies forgotten; the total left."""
        for identity in list(self._queued):
            self.queued_to(identity)
        return self.total
