"""What the daemon sends to clients on the client endpoint: replies, replies
held back (a refusal for a rate is answered when the wait is over, as Kafka
throttles a client over its quota: one that waits for its replies then
cannot send faster than its quota allows), and the answers owed to `result`
requests that wait (the events go from the sink). Every reply goes
through streamfence.supervisor.replies, which bounds the bytes queued to
clients that do not read them."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.internal.control import ListenerOwner
from streamfence.protocol.messages import pending_msg
from streamfence.supervisor.replies import ReplyQueues
from streamfence.supervisor.timers import Deadlines

HELD_MAX = 10_000  # replies held back at most (a bound on their memory)


class Clients:
    """Owns the client ROUTER socket's sending side, the listeners following each
    live call (so a restarted sink can be told again: the events themselves
    go from the sink to them), and the `result` requests waiting for a
    call's end."""

    def __init__(self, socket: zmq.Socket[bytes], counters: Counter[str]) -> None:
        self.socket = socket
        self.replies = ReplyQueues(socket, counters)
        self._listeners: dict[str, dict[str, ListenerOwner]] = {}  # call -> listener -> owner
        self._waiters: dict[str, list[tuple[bytes, str, float]]] = {}
        self._waits_due: Deadlines[str] = Deadlines()  # call -> its first waiter's end
        # (when, order, identity, frame, the request's ref)
        self._held: list[tuple[float, int, bytes, bytes, str | None]] = []
        self._order = itertools.count()

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.replies.send(identity, encode(msg), msg.get("ref"))

    def send_at(self, identity: bytes, msg: dict[str, Any], when: float) -> None:
        """Send `msg` at `when` (monotonic seconds); at once if HELD_MAX replies wait."""
        if len(self._held) >= HELD_MAX:
            self.send(identity, msg)
            return
        heapq.heappush(self._held, (when, next(self._order), identity, encode(msg),
                                    msg.get("ref")))

    # ---- listeners of live calls -----------------------------------------------------
    def follow(self, call_id: str, listener: str, owner: ListenerOwner) -> None:
        """`listener` subscribed to the live call `call_id` (at the sink), for `owner`."""
        self._listeners.setdefault(call_id, {})[listener] = owner

    def unfollow(self, call_id: str, listener: str) -> None:
        """The sink refused that subscription."""
        self._listeners.get(call_id, {}).pop(listener, None)

    def following(self) -> list[tuple[str, str, ListenerOwner]]:
        """(call, listener, owner) of every live call's subscription."""
        return [(c, lst, owner) for c, listeners in self._listeners.items()
                for lst, owner in listeners.items()]

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
        self._listeners.pop(call_id, None)

    # ---- `result` requests that wait ---------------------------------------------
    def wait_result(self, call_id: str, identity: bytes, ref: str, until: float) -> None:
        waiters = self._waiters.setdefault(call_id, [])
        waiters.append((identity, ref, until))
        self._waits_due.arm(call_id, min(w[2] for w in waiters))

    def next_due(self) -> float | None:
        """When the next wait runs out or a held reply is due (monotonic seconds)."""
        due = self._waits_due.next_due()
        if self._held and (due is None or self._held[0][0] < due):
            return self._held[0][0]
        return due

    def expire_waiters(self, now: float) -> None:
        """Waits that ran out get `pending`; held replies whose time came go."""
        held = self._held
        while held and held[0][0] <= now:
            _, _, identity, frame, ref = heapq.heappop(held)
            self.replies.send(identity, frame, ref)
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
