"""The events socket: the sink sends each call's events to its subscribers.

The sink binds the daemon's public events endpoint (docs/PROTOCOL.md §1),
a ROUTER socket that is a CURVE server behind the same key store as the
client endpoint when auth is on. A client connects one DEALER there whose
routing id is its *listener id*, a secret it chose and named only to the
supervisor, over its authenticated request socket; it says `listen` and is
answered `listening` (so it knows its connection is up). The supervisor
decides who may see a call and tells the sink "listener L follows call C
after seq S" (C_SUBSCRIBE, `Replays.subscribe`): the sink replays what
the transcript holds after S, then sends each new event of C right after the
commit that stores it. The supervisor is off the per-delta path
(docs/ARCHITECTURE.md §1).

Each frame holds one event map or, when a commit (or a replay) has several
for one listener, a msgpack array of them in order (at most `BATCH_MAX`
events, about `BATCH_BYTES`): the stored bytes joined behind an array
header, one send per listener per commit instead of one per event.

Flow control (PROTOCOL §5): the sink holds at most `WINDOW_BYTES` of frames
a listener has not acknowledged, and `BUFFER_BYTES` for all listeners
together. A listener says `ack` with the bytes it has read since its
`listen`. A live event that does not fit is not queued: the listener is cut
off from that call with a `cut_off` event naming the last seq it was sent,
and it subscribes again from there (as Redis drops a client whose output
buffer passes its limit). A replay never cuts off: it waits for the
listener's acks (sink/replays.py serves replays in slices). A frame to a
listener that is not connected (say, reconnecting to a restarted sink) is
dropped and counted, and the subscription stays until the call's done: the
client sees a gap in seq and subscribes again from its last seq. A listener
that holds unacknowledged bytes and has been silent `PING_AFTER_S` is sent
an empty array; if it is gone, its bytes are released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgpack
import zmq
import zmq.backend

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator
from streamfence.protocol.messages import (
    cut_off_event,
    error_msg,
    listening_msg,
    parse_listener_msg,
)

log = logging.getLogger("streamfence.sink")

WINDOW_BYTES = 4 << 20  # unacknowledged bytes one listener may have
BUFFER_BYTES = 256 << 20  # ... and all listeners together
# Frames queued per listener: far more than an acking client lets pile up (it
# acks every 64 KiB or 50 ms), and with BATCH_BYTES the bound for one that lies.
SEND_HWM = 1024
BATCH_MAX = 4096  # events per frame at most ...
BATCH_BYTES = 256 << 10  # ... and about this many bytes
MAX_LISTEN_FRAME = 4096  # what a client may send here: `listen`, `ack`
LISTEN_BURST = 100  # inbound messages handled per loop turn
PING_AFTER_S = 10.0  # a silent listener holding bytes is checked after this long
_PING = msgpack.packb([])  # an empty batch: no event, one byte
_raw_send = zmq.backend.Socket.send  # the compiled send, under pyzmq's Python-level one
_NOBLOCK, _MORE = zmq.NOBLOCK, zmq.SNDMORE | zmq.NOBLOCK
_LISTENING = encode(listening_msg())

Outbox = list[tuple[set[bytes], bytes]]  # (the call's listeners, one event) after its commit
Cuts = list[tuple[bytes, list[bytes]]]  # (listener, the events it was not sent, in order)


class Listeners(Protocol):
    """What the rest of the sink needs of `Subscribers` (tests give a stand-in)."""

    def deliver(self, outbox: Outbox) -> Cuts: ...

    def replay(self, listener: bytes, events: list[bytes]) -> int: ...

    def room(self, listener: bytes) -> int: ...

    def cut_off(self, listener: bytes, call_id: str, seq: int) -> None: ...

    def stats(self) -> dict[str, int]: ...


class Subscribers:
    """Owns the events socket (and its ZAP authenticator, if auth is on), each
    listener's unacknowledged bytes and the delivery counters. Who follows
    which call is kept on each call's `LiveCall.subs` (sink/calls.py), where
    the hot path looks; a cut-off is carried out there too."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: KeyStore | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown listener is an error we see
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_LISTEN_FRAME)
        sock.setsockopt(zmq.LINGER, 0)
        self._zap = start_authenticator(ctx, keys) if keys is not None else None
        if keys is not None:
            make_curve_server(sock, keys)
        sock.bind(endpoint)
        self.socket = sock
        self._clock = clock
        self._send = _raw_send.__get__(sock)
        self._array_header = msgpack.Packer().pack_array_header
        self._out: dict[bytes, int] = {}  # listener -> bytes sent, not yet acknowledged
        self._read: dict[bytes, int] = {}  # listener -> its last `ack` figure
        self._heard: dict[bytes, float] = {}  # listener -> when it last said anything
        self.outstanding = 0  # the sum of _out
        self.ping_due = clock() + PING_AFTER_S
        self.sent = 0  # events handed to ZeroMQ
        self.dropped_full = 0  # events dropped: the listener's queue was full
        self.unroutable = 0  # events dropped: the listener was not connected
        self.cut_offs = 0  # subscriptions cut off: their listener fell a window behind
        self.listens = 0
        self.acks = 0
        self.bad_input = 0

    def room(self, listener: bytes) -> int:
        """Bytes `listener` may be sent now (at least one frame if it holds none)."""
        out = self._out.get(listener, 0)
        room = min(WINDOW_BYTES - out, BUFFER_BYTES - self.outstanding)
        return room if out else max(room, 1)

    def deliver(self, outbox: Outbox) -> Cuts:
        """The events of one commit, to their calls' listeners: one frame per
        listener (a batch when it has several). Returns the listeners that had
        no room, with the events they were not sent (to be cut off)."""
        cuts: Cuts = []
        if len(outbox) == 1:  # a model's pace: one event per commit
            subs, event = outbox[0]
            for listener in subs:
                if self._frame(listener, event, 1, live=True) is False:
                    cuts.append((listener, [event]))
            return cuts
        by_listener: dict[bytes, list[bytes]] = {}
        for subs, event in outbox:
            for listener in subs:
                got = by_listener.get(listener)
                if got is None:
                    by_listener[listener] = [event]
                else:
                    got.append(event)
        for listener, events in by_listener.items():
            n = self._events(listener, events, live=True)
            if 0 <= n < len(events):
                cuts.append((listener, events[n:]))
        return cuts

    def replay(self, listener: bytes, events: list[bytes]) -> int:
        """Stored events to one listener, as many as its room allows: how many
        were sent, or -1 if it is not connected."""
        return self._events(listener, events, live=False)

    def cut_off(self, listener: bytes, call_id: str, seq: int) -> None:
        """Tell `listener` its subscription to `call_id` ended after `seq`."""
        self.cut_offs += 1
        self._frame(listener, encode(cut_off_event(
            call_id, seq, f"more than {WINDOW_BYTES} bytes of events were not acknowledged "
            "(or the daemon's event buffer is full); subscribe again from seq "
            f"{seq}")), 0, live=False)

    def _events(self, listener: bytes, events: list[bytes], live: bool) -> int:
        """Send `events` in frames while there is room: how many went, -1 if the
        listener is not connected."""
        total = len(events)
        if total == 1:
            sent = self._frame(listener, events[0], 1, live)
            return -1 if sent is None else int(sent)
        start = 0
        while start < total:
            room = self.room(listener)
            if room <= 0:
                return start
            limit = min(room, BATCH_BYTES)
            end, size = start, 0
            while end < total and end - start < BATCH_MAX and size < limit:
                size += len(events[end])
                end += 1
            if size > room and end - start > 1:
                end -= 1  # its last event would pass the room: next time
            n = end - start
            frame = events[start] if n == 1 else \
                self._array_header(n) + b"".join(events[start:end])
            sent = self._frame(listener, frame, n, live)
            if sent is None:
                return -1
            if not sent:
                return start
            start = end
        return total

    def _frame(self, listener: bytes, frame: bytes, events: int, live: bool) -> bool | None:
        """One frame of `events` events to `listener`: True if sent, False if it
        had no room (`live`: checked here) or its queue was full, None if it is
        not connected (its unacknowledged bytes are released: ZeroMQ dropped
        the connection's queue)."""
        size = len(frame)
        out = self._out.get(listener, 0)
        if live and out and (out + size > WINDOW_BYTES
                             or self.outstanding + size > BUFFER_BYTES):
            return False
        try:
            self._send(listener, _MORE)
            self._send(frame, _NOBLOCK)
        except zmq.Again:
            self.dropped_full += events
            return False
        except zmq.ZMQError:
            self.unroutable += events
            self._forget(listener)
            return None
        self.sent += events
        self._out[listener] = out + size
        self.outstanding += size
        return True

    def _forget(self, listener: bytes) -> None:
        self.outstanding -= self._out.pop(listener, 0)
        self._read.pop(listener, None)
        self._heard.pop(listener, None)

    def drain(self) -> None:
        """What clients sent on the events socket: `listen` (answered `listening`;
        the listener's count starts again) and `ack`; anything else gets an
        error (ref nil) and is counted."""
        sock = self.socket
        now = self._clock()
        for _ in range(LISTEN_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            ident, body = frames[0], frames[1:]
            try:
                if len(body) != 1:
                    raise ProtocolError(ErrorCode.BAD_FRAME,
                                        f"a message must be exactly one frame, got {len(body)}")
                read = parse_listener_msg(decode_untrusted(body[0], MAX_LISTEN_FRAME))
            except ProtocolError as exc:
                self.bad_input += 1
                self._frame(ident, encode(error_msg(None, exc.code, exc.message)), 0, False)
                continue
            self._heard[ident] = now
            if read is None:
                self.listens += 1
                self._forget(ident)
                self._heard[ident] = now
                self._frame(ident, _LISTENING, 0, live=False)
            else:
                self.acks += 1
                self._ack(ident, read)

    def _ack(self, listener: bytes, read: int) -> None:
        newly = read - self._read.get(listener, 0)
        if newly <= 0:
            return  # an old figure (acks are cumulative): nothing new
        self._read[listener] = read
        out = self._out.get(listener, 0)
        newly = min(newly, out)  # frames sent before its `listen` may be counted there
        self._out[listener] = out - newly
        self.outstanding -= newly

    def ping(self) -> None:
        """Check the silent listeners that hold unacknowledged bytes: an empty
        array to each; one that is gone has its bytes released (`_frame`)."""
        now = self._clock()
        self.ping_due = now + PING_AFTER_S
        for listener, out in list(self._out.items()):
            if out and now - self._heard.get(listener, 0.0) >= PING_AFTER_S:
                self._heard[listener] = now
                self._frame(listener, _PING, 0, live=False)

    def stats(self) -> dict[str, int]:
        return {"events_sent": self.sent, "events_dropped_full": self.dropped_full,
                "events_unroutable": self.unroutable, "events_cut_offs": self.cut_offs,
                "events_unacked_bytes": self.outstanding, "listens": self.listens,
                "events_acks": self.acks, "events_bad_input": self.bad_input,
                "events_auth_refused": self._zap.refused if self._zap is not None else 0}

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
