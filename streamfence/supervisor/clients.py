"""What the daemon sends to clients: replies, the events of subscribed calls,
and the answers owed to `result` requests that wait."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.messages import pending_msg
from streamfence.supervisor.timers import Deadlines


class Clients:
    """Owns the client ROUTER socket's sending side, the subscribers of live
    calls (identity -> next seq owed), each live call's event buffer (every
    event published so far, index = seq - 1, for late subscribers), and the
    `result` requests waiting for a call's end."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket
        self._send_multipart = socket.send_multipart
        self._subscribers: dict[str, dict[bytes, int]] = {}
        self._events: dict[str, list[bytes]] = {}
        self._waiters: dict[str, list[tuple[bytes, str, float]]] = {}
        self._waits_due: Deadlines[str] = Deadlines()  # call -> its first waiter's end

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._send_multipart([identity, encode(msg)])

    def send_frames(self, identity: bytes, frames: list[bytes]) -> None:
        for frame in frames:
            self._send_multipart([identity, frame])

    # ---- live calls --------------------------------------------------------------
    def open(self, call_id: str, events: list[bytes], subscriber: bytes | None = None) -> None:
        """A call became live: `events` are those it published already (recovery)."""
        self._events[call_id] = events
        if subscriber is not None:
            self._subscribers.setdefault(call_id, {})[subscriber] = 1

    def subscribe(self, identity: bytes, call_id: str, from_seq: int) -> bool:
        """Replay a live call's buffer after `from_seq`, then follow it. False if
        the call is not live."""
        live = self._events.get(call_id)
        if live is None:
            return False
        self.send_frames(identity, live[from_seq:])
        self._subscribers.setdefault(call_id, {})[identity] = len(live) + 1
        return True

    def published(self, call_id: str) -> list[bytes]:
        """The events a live call published so far (do not modify)."""
        return self._events.get(call_id, [])

    def on_event(self, call_id: str, seq: int, frame: bytes) -> None:
        """An event the sink committed: buffer it, and send it to the subscribers."""
        buffer = self._events.get(call_id)
        if buffer is not None and seq == len(buffer) + 1:
            buffer.append(frame)
        subs = self._subscribers.get(call_id)
        if subs:
            send = self._send_multipart
            for identity, owed in subs.items():
                if seq >= owed:
                    send([identity, frame])
                    subs[identity] = seq + 1

    def on_call_done(self, call_id: str, done: dict[str, Any],
                     diagnostics: Callable[[], list[dict[str, Any]]]) -> None:
        """The call's done event is stored: answer its waiters (the done event and
        the attempts' `diagnostics`), and forget the call."""
        waiters = self._waiters.pop(call_id, None)
        self._waits_due.clear(call_id)
        if waiters:
            reply = dict(done, diagnostics=diagnostics())
            for identity, ref, _ in waiters:
                self.send(identity, dict(reply, ref=ref))
        self._subscribers.pop(call_id, None)
        self._events.pop(call_id, None)

    # ---- `result` requests that wait ---------------------------------------------
    def wait_result(self, call_id: str, identity: bytes, ref: str, until: float) -> None:
        waiters = self._waiters.setdefault(call_id, [])
        waiters.append((identity, ref, until))
        self._waits_due.arm(call_id, min(w[2] for w in waiters))

    def next_due(self) -> float | None:
        """When the next wait runs out (monotonic seconds)."""
        return self._waits_due.next_due()

    def expire_waiters(self, now: float) -> None:
        """Waits that ran out get `pending`."""
        for call_id in self._waits_due.pop_due(now):
            keep = []
            for identity, ref, until in self._waiters.pop(call_id, []):
                if now >= until:
                    self.send(identity, pending_msg(ref, call_id))
                else:
                    keep.append((identity, ref, until))
            if keep:
                self._waiters[call_id] = keep
                self._waits_due.arm(call_id, min(w[2] for w in keep))
