"""The events socket: the sink sends each call's events to its subscribers.

The sink binds the daemon's public events endpoint (docs/PROTOCOL.md §1),
a ROUTER socket that is a CURVE server behind the same key store as the
client endpoint when auth is on. A client connects one DEALER there whose
routing id is its *listener id*, a secret it chose and named only to the
supervisor, over its authenticated request socket; it says `listen` and is
answered `listening` (so it knows its connection is up). The supervisor
decides who may see a call and tells the sink "listener L follows call C
after seq S" (C_SUBSCRIBE, `SinkState.add_subscriber`): the sink replays what
the transcript holds after S, then sends each new event of C right after the
commit that stores it. The supervisor is off the per-delta path
(docs/ARCHITECTURE.md §1).

Each frame holds one event map or, when a commit (or a replay) has several
for one listener, a msgpack array of them in order (at most `BATCH_MAX`
events, about `BATCH_BYTES`): the stored bytes joined behind an array
header, one send per listener per commit instead of one per event.

Delivery has the client endpoint's rules (PROTOCOL §5): at most `SNDHWM`
messages queued per listener. An event a listener cannot take now (its queue
is full, or it is not connected: say, reconnecting to a restarted sink) is
dropped and counted, and the subscription stays until the call's done; the
client sees a gap in seq, or silence, and subscribes again from its last
seq. A replay to a listener that is not connected starts no subscription.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import zmq
import zmq.backend

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator
from streamfence.protocol.messages import error_msg, listening_msg, parse_listen

log = logging.getLogger("streamfence.sink")

SEND_HWM = 100_000  # messages queued per listener (as the client endpoint's SNDHWM)
BATCH_MAX = 4096  # events per frame at most ...
BATCH_BYTES = 1 << 20  # ... and about this many bytes
MAX_LISTEN_FRAME = 4096  # what a client may send here: `listen`
LISTEN_BURST = 100  # inbound messages handled per loop turn
_raw_send = zmq.backend.Socket.send  # the compiled send, under pyzmq's Python-level one
_NOBLOCK, _MORE = zmq.NOBLOCK, zmq.SNDMORE | zmq.NOBLOCK
_LISTENING = encode(listening_msg())

Outbox = list[tuple[set[bytes], bytes]]  # (the call's listeners, one event) after its commit


class Subscribers:
    """Owns the events socket (and its ZAP authenticator, if auth is on) and the
    delivery counters. Who follows which call is kept on each call's
    `LiveCall.subs` (sink/state.py), where the hot path looks."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: KeyStore | None) -> None:
        self._zap = start_authenticator(ctx, keys) if keys is not None else None
        sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown listener is an error we see
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_LISTEN_FRAME)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            make_curve_server(sock, keys)
        sock.bind(endpoint)
        self.socket = sock
        self._send = _raw_send.__get__(sock)
        self._array_header = msgpack.Packer().pack_array_header
        self.sent = 0  # events handed to ZeroMQ
        self.dropped_full = 0  # events dropped: the listener's queue was full
        self.unroutable = 0  # events dropped: the listener was not connected
        self.listens = 0
        self.bad_input = 0

    def deliver(self, outbox: Outbox) -> None:
        """The events of one commit, to their calls' listeners: one frame per
        listener (a batch when it has several)."""
        if len(outbox) == 1:  # a model's pace: one event per commit
            subs, event = outbox[0]
            for listener in subs:
                self._frame(listener, event, 1)
            return
        by_listener: dict[bytes, list[bytes]] = {}
        for subs, event in outbox:
            for listener in subs:
                got = by_listener.get(listener)
                if got is None:
                    by_listener[listener] = [event]
                else:
                    got.append(event)
        for listener, events in by_listener.items():
            self._batches(listener, events)

    def send_event(self, subs: set[bytes], event: bytes) -> None:
        """One event (a reset, a done) to a call's listeners."""
        for listener in subs:
            self._frame(listener, event, 1)

    def replay(self, listener: bytes, events: list[bytes]) -> bool:
        """Stored events to one listener; False if it is not connected."""
        return self._batches(listener, events)

    def _batches(self, listener: bytes, events: list[bytes]) -> bool:
        if len(events) == 1:
            return self._frame(listener, events[0], 1)
        start, size = 0, 0
        for i, event in enumerate(events):
            size += len(event)
            if i + 1 - start == BATCH_MAX or size >= BATCH_BYTES or i + 1 == len(events):
                n = i + 1 - start
                if not self._frame(listener, self._array_header(n) + b"".join(events[start:i + 1]),
                                   n):
                    return False
                start, size = i + 1, 0
        return True

    def _frame(self, listener: bytes, frame: bytes, events: int) -> bool:
        """One frame of `events` events to `listener`; False if it is not connected."""
        try:
            self._send(listener, _MORE)
            self._send(frame, _NOBLOCK)
            self.sent += events
            return True
        except zmq.Again:
            self.dropped_full += events
            return True
        except zmq.ZMQError:
            self.unroutable += events
            return False

    def drain(self) -> None:
        """What clients sent on the events socket: `listen`, answered `listening`;
        anything else gets an error (ref nil) and is counted."""
        sock = self.socket
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
                parse_listen(decode_untrusted(body[0], MAX_LISTEN_FRAME))
                reply = _LISTENING
                self.listens += 1
            except ProtocolError as exc:
                self.bad_input += 1
                reply = encode(error_msg(None, exc.code, exc.message))
            try:
                self._send(ident, _MORE)
                self._send(reply, _NOBLOCK)
            except zmq.ZMQError:
                pass  # gone already, or not reading: nothing to answer

    def stats(self) -> dict[str, int]:
        return {"events_sent": self.sent, "events_dropped_full": self.dropped_full,
                "events_unroutable": self.unroutable, "listens": self.listens,
                "events_bad_input": self.bad_input,
                "events_auth_refused": self._zap.refused if self._zap is not None else 0}

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
