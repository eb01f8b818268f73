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
header, one send per listener per commit instead of one per event. A
listener on this host may take its frames over a plain link instead
(sink/links.py: offered in `listening`; its acks stay here).

Flow control (PROTOCOL §5): the sink holds at most `WINDOW_BYTES` of frames
a listener has not acknowledged, `IDENTITY_BYTES` for all the listeners of
one identity (its `Share`, sink/shares.py: the identity the supervisor
charged the listener's subscriptions to), and `BUFFER_BYTES` for all
listeners together; one identity's backlog leaves the others' room. A
listener says `ack` with the bytes it has read since its
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

Revoked keys (docs/SECURITY.md, "Rotating and revoking"): ZAP authenticates
a connection once, at its handshake, so a connection made before a key is
revoked or rotated stays open. Each listener's key is the User-Id of what
it says here (`listen`, or its first `ack`); when `keys/clients/` changed
(sink/key_checks.py) `tick` looks at the allow-list ZAP reads, and every
listener whose key left it is cut: it gets an `error` (ref nil, code
`key_revoked`), its bytes are released, and `tick` returns it so that its
subscriptions are dropped (sink/replays.py); a later `listen` from it gets
the same error, and a subscribe of it is refused. Why here and not a
control op from the supervisor: the supervisor learns of a key change no
sooner (the CLI just edits `keys/clients/`), and only the sink knows which
key each events connection holds (not always the subscribing socket's). A
listener that never speaks here has no known key: it gets at most one
window (it never acks), and nobody with the revoked key can subscribe it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.backend

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.internal.control import ListenerOwner
from streamfence.protocol.keys import KeyStore, make_curve_server, start_authenticator
from streamfence.protocol.messages import (
    cut_off_event,
    error_msg,
    listening_msg,
    parse_listener_msg,
)
from streamfence.sink.key_checks import KeyChecks
from streamfence.sink.links import Links
from streamfence.sink.listeners import Cuts, Outbox, Peer
from streamfence.sink.shares import Active, Shares

log = logging.getLogger("streamfence.sink")

WINDOW_BYTES = 4 << 20  # unacknowledged bytes one listener may have
BUFFER_BYTES = 256 << 20  # ... and all listeners together
IDENTITY_BYTES = BUFFER_BYTES // 8  # ... and the listeners of one identity (32 MiB)
# Frames queued per listener: far more than an acking client lets pile up (it
# acks every 64 KiB or 2 s), and with BATCH_BYTES the bound for one that lies.
SEND_HWM = 1024
BATCH_MAX = 4096  # events per frame at most ...
BATCH_BYTES = 256 << 10  # ... and about this many bytes
MAX_LISTEN_FRAME = 4096  # what a client may send here: `listen`, `ack`
LISTEN_BURST = 100  # inbound messages handled per loop turn
PING_AFTER_S = 10.0  # a silent listener holding bytes is checked after this long
_PING = msgpack.packb([])  # an empty batch: no event, one byte
_raw_send = zmq.backend.Socket.send  # the compiled send, under pyzmq's Python-level one
_NOBLOCK, _MORE = zmq.NOBLOCK, zmq.SNDMORE | zmq.NOBLOCK
_REVOKED = encode(error_msg(None, ErrorCode.KEY_REVOKED,
                            "the key of this connection was revoked or rotated: nothing more "
                            "is sent on it; connect again with valid credentials"))


class Subscribers:
    """Owns the events socket (and its ZAP authenticator, if auth is on), each
    listener's `Peer`, the identities' `Shares` and the delivery counters.
    Who follows which call is kept on each call's `LiveCall.subs`
    (sink/calls.py), where the hot path looks; a cut-off is carried out there
    too."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, keys: KeyStore | None,
                 clock: Callable[[], float] = time.monotonic,
                 links: Links | None = None) -> None:
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
        self.key_checks = KeyChecks(keys, clock()) if keys is not None else None
        self.links = links  # local listeners' plain links (sink/links.py), if offered
        self._cut_since_tick: list[bytes] = []  # cut at their `listen`, for `tick` to return
        self._clock = clock
        self._send = _raw_send.__get__(sock)
        self._array_header = msgpack.Packer().pack_array_header
        self.shares = Shares()
        self._peers: dict[bytes, Peer] = {}
        self.outstanding = 0  # the sum of the peers' `out`
        self.ping_due = clock() + PING_AFTER_S
        self.due = math.inf  # when `tick` is due (an attribute: the loop reads it every turn)
        self.sent = 0  # events handed to ZeroMQ
        self.dropped_full = 0  # events dropped: the listener's queue was full
        self.unroutable = 0  # events dropped: the listener was not connected
        self.cut_offs = 0  # subscriptions cut off: their listener fell a window behind
        self.revoked = 0  # listeners cut: their key was revoked or rotated
        self.listens = 0
        self.acks = 0
        self.bad_input = 0

    def _peer(self, listener: bytes) -> Peer:
        peer = self._peers[listener] = Peer(self.shares.of.get(listener, self.shares.nobody))
        if self.due == math.inf:
            self.due = self._next_due()
        return peer

    def room(self, listener: bytes) -> int:
        """Bytes `listener` may be sent now (at least one frame if it holds none)."""
        peer = self._peers.get(listener) or self._peer(listener)
        out = peer.out
        room = min(WINDOW_BYTES - out, IDENTITY_BYTES - peer.share.out,
                   BUFFER_BYTES - self.outstanding)
        return room if out else max(room, 1)

    def subscribe(self, listener: bytes, call_id: str, owner: ListenerOwner,
                  active: Active) -> str | None:
        """`listener` follows `call_id` for `owner` (C_SUBSCRIBE): None, or the
        reason it may not (a revoked key, a cap of the owner's)."""
        peer = self._peers.get(listener)
        if peer is not None and peer.revoked:
            return "key_revoked: this listener's connection was made with a revoked key"
        refused = self.shares.admit(listener, call_id, owner, active)
        if refused is None and peer is not None:
            share = self.shares.of[listener]
            if peer.share is not share:  # its bytes count in its owner's share from now on
                peer.share.out -= peer.out
                share.out += peer.out
                peer.share = share
        return refused

    def unsubscribe_all(self, listener: bytes) -> set[str]:
        """The calls `listener` was recorded as following, forgotten."""
        return self.shares.drop(listener)

    def deliver(self, outbox: Outbox) -> Cuts:
        """The runs of one commit, to their calls' listeners: one frame per
        listener (a batch when it has several events). Returns the listeners
        that had no room, with the events they were not sent (to be cut off)."""
        cuts: Cuts = []
        if len(outbox) == 1:  # one call's run (at a model's pace: one event)
            by_listener = dict.fromkeys(outbox[0][0], outbox[0][1])
        else:
            by_listener = {}
            for subs, events in outbox:  # per call run, never per event
                for listener in subs:
                    got = by_listener.get(listener)
                    if got is None:
                        by_listener[listener] = got = []
                    got += events
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
            "(or its identity's share, or the daemon's event buffer, is full); subscribe "
            f"again from seq {seq}")), 0, live=False)

    def _events(self, listener: bytes, events: list[bytes], live: bool) -> int:
        """Send `events` in frames while there is room: how many went, -1 if the
        listener is not connected."""
        total = len(events)
        if total == 1:
            sent = self._frame(listener, events[0], 1, live)
            return -1 if sent is None else int(sent)
        whole = sum(map(len, events)) if total <= BATCH_MAX else BATCH_BYTES + 1
        start = 0
        while start < total:
            room = self.room(listener)
            if room <= 0:
                return start
            limit = min(room, BATCH_BYTES)
            # All in one frame, the common case, is seen without a loop per event.
            end, size = (total, whole) if start == 0 and whole <= limit else (start, 0)
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
        peer = self._peers.get(listener) or self._peer(listener)
        out = peer.out
        if live and out and (out + size > WINDOW_BYTES or peer.share.out + size > IDENTITY_BYTES
                             or self.outstanding + size > BUFFER_BYTES):
            return False
        links = self.links
        try:
            if links is None or (linked := links.send(listener, frame)) is None:
                self._send(listener, _MORE)
                self._send(frame, _NOBLOCK)
            elif not linked:
                raise zmq.ZMQError(errno.EPIPE)  # the link ended: as an unroutable listener
        except zmq.Again:
            self.dropped_full += events
            return False
        except zmq.ZMQError:
            self.unroutable += events
            self._release(peer)
            return None
        self.sent += events
        peer.out = out + size
        peer.share.out += size
        self.outstanding += size
        return True

    def _release(self, peer: Peer) -> None:
        """The peer's unacknowledged bytes are gone (its queue, or a new `listen`)."""
        peer.share.out -= peer.out
        self.outstanding -= peer.out
        peer.out = peer.read = 0

    def drain(self) -> None:
        """What clients sent on the events socket: `listen` (answered `listening`;
        the listener's count starts again) and `ack`; anything else gets an
        error (ref nil) and is counted. A listener whose key is no longer
        registered is answered `key_revoked` instead, and cut."""
        sock = self.socket
        now = self._clock()
        for _ in range(LISTEN_BURST):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, body = frames[0].bytes, frames[1:]
            try:
                if len(body) != 1:
                    raise ProtocolError(ErrorCode.BAD_FRAME,
                                        f"a message must be exactly one frame, got {len(body)}")
                read = parse_listener_msg(decode_untrusted(body[0].bytes, MAX_LISTEN_FRAME))
            except ProtocolError as exc:
                self.bad_input += 1
                self._frame(ident, encode(error_msg(None, exc.code, exc.message)), 0, False)
                continue
            peer = self._peers.get(ident) or self._peer(ident)
            peer.heard = now
            just_cut = self.key_checks is not None and (read is None or peer.key is None) \
                and self._learn_key(ident, peer, body[0])
            if peer.revoked:
                if read is None or just_cut:  # (a later ack gets no answer)
                    self._try_send(ident, _REVOKED)
            elif read is None:
                self.listens += 1
                self._release(peer)
                self._frame(ident, self._listening(ident), 0, live=False)
            else:
                self.acks += 1
                self._ack(peer, read)

    def _listening(self, listener: bytes) -> bytes:
        """`listening`, with a fresh link offer when links are on (PROTOCOL §5)."""
        offer = None if self.links is None else {"path": self.links.path,
                                                 "token": self.links.offer(listener)}
        return encode(listening_msg(offer))

    def poll_links(self) -> None:
        """The links' epoll was readable: attaches, drains, ends (a listener whose
        link ended is not connected: its bytes are released)."""
        assert self.links is not None
        for listener in self.links.poll():
            peer = self._peers.get(listener)
            if peer is not None:
                self._release(peer)
        self.due = min(self.due, self.links.due() or math.inf)  # an unattached one's deadline

    def _learn_key(self, listener: bytes, peer: Peer, frame: zmq.Frame) -> bool:
        """The key `peer` connected with (ZAP's User-Id); if it is not (or no
        longer) registered, the peer is cut now (module docstring): True."""
        key = str(frame.get("User-Id")).encode()
        if key != peer.key:  # a new connection under this routing id
            peer.key, peer.revoked = key, False
        assert self.key_checks is not None
        if not peer.revoked and not self.key_checks.allowed(key):
            self._cut(listener, peer)
            self._cut_since_tick.append(listener)
            self.due = 0.0  # its subscriptions are dropped in this loop turn
            return True
        return False

    def _ack(self, peer: Peer, read: int) -> None:
        newly = read - peer.read
        if newly <= 0:
            return  # an old figure (acks are cumulative): nothing new
        peer.read = read
        newly = min(newly, peer.out)  # frames sent before its `listen` may be counted there
        peer.out -= newly
        peer.share.out -= newly
        self.outstanding -= newly

    def _next_due(self) -> float:
        """When `tick` has something to do (the loop's timer): nothing without peers."""
        checks, links = self.key_checks, self.links.due() if self.links is not None else None
        due = math.inf if not self._peers else self.ping_due if checks is None \
            else min(self.ping_due, checks.due)
        return due if links is None else min(due, links)

    def keys_changed(self) -> None:
        """`keys/clients/` changed: `tick` looks at the allow-list this loop turn."""
        assert self.key_checks is not None
        self.key_checks.on_readable()
        self.due = 0.0

    def tick(self) -> list[bytes]:
        """The timer's work: pings when due, and the listeners cut for a revoked
        key since the last tick (module docstring), whose subscriptions the
        caller drops."""
        now = self._clock()
        if now >= self.ping_due:
            self.ping()
        if self.links is not None:
            self.links.tick()
        cut, self._cut_since_tick = self._cut_since_tick, []
        checks = self.key_checks
        if checks is not None and now >= checks.due:
            allowed = checks.changed(now)
            if allowed is not None:
                for listener, peer in self._peers.items():
                    if peer.key is not None and not peer.revoked and peer.key not in allowed:
                        self._cut(listener, peer)
                        self._try_send(listener, _REVOKED)
                        cut.append(listener)
                if cut:
                    log.warning("sink: cut %d events connection(s) whose key was revoked or "
                                "rotated", len(cut))
        self.due = self._next_due()
        return cut

    def _cut(self, listener: bytes, peer: Peer) -> None:
        """`listener` gets nothing more (its subscriptions are dropped by the
        caller of `tick`); it is told by whoever found it (`_REVOKED`)."""
        peer.revoked = True
        self.revoked += 1
        self._release(peer)
        if self.links is not None:
            self.links.close_link(listener)

    def _try_send(self, listener: bytes, frame: bytes) -> None:
        """A frame that is not counted in the listener's window (it is cut)."""
        with contextlib.suppress(zmq.ZMQError):
            if self.links is None or self.links.send(listener, frame) is None:
                self._send(listener, _MORE)
                self._send(frame, _NOBLOCK)

    def ping(self) -> None:
        """Check the silent listeners that hold unacknowledged bytes: an empty
        array to each; one that is gone has its bytes released (`_frame`).
        Listeners that hold nothing and no subscription are forgotten."""
        now = self._clock()
        self.ping_due = now + PING_AFTER_S
        charged = self.shares.of
        for listener, peer in list(self._peers.items()):
            if peer.out and now - peer.heard >= PING_AFTER_S:
                peer.heard = now
                self._frame(listener, _PING, 0, live=False)
            elif not peer.out and not peer.revoked and listener not in charged:
                del self._peers[listener]

    def stats(self) -> dict[str, int]:
        return {"events_sent": self.sent, "events_dropped_full": self.dropped_full,
                "events_unroutable": self.unroutable, "events_cut_offs": self.cut_offs,
                "events_unacked_bytes": self.outstanding, "listens": self.listens,
                "events_acks": self.acks, "events_bad_input": self.bad_input,
                "events_key_revoked": self.revoked, "events_listeners": len(self._peers),
                "events_auth_refused": self._zap.refused if self._zap is not None else 0,
                **({"events_links_attached": self.links.attached, "events_links_refused":
                    self.links.refused, "events_links_bytes": self.links.bytes_sent}
                   if self.links is not None else {}),
                **self.shares.stats()}

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.links is not None:
            self.links.close()
        if self.key_checks is not None:
            self.key_checks.close()
        if self._zap is not None:
            self._zap.stop()
