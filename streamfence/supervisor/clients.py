"""What the daemon sends to clients on the client endpoint: replies, and the
answers owed to `result` requests that wait (the events go from the sink)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from streamfence.protocol.codec import encode
from streamfence.protocol.messages import pending_msg
from streamfence.supervisor.timers import Deadlines


class Clients:
    """Owns the client ROUTER socket's sending side, the listeners following each
    live call (so a restarted sink can be told again: the events themselves
    go from the sink to them), and the `result` requests waiting for a
    call's end."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket
        self._send_multipart = socket.send_multipart
        self._listeners: dict[str, set[str]] = {}
        self._waiters: dict[str, list[tuple[bytes, str, float]]] = {}
        self._waits_due: Deadlines[str] = Deadlines()  # call -> its first waiter's end

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self._send_multipart([identity, encode(msg)])

    # ---- listeners of live calls -----------------------------------------------------
    def follow(self, call_id: str, listener: str) -> None:
        """`listener` subscribed to the live call `call_id` (at the sink)."""
        self._listeners.setdefault(call_id, set()).add(listener)

    def following(self) -> list[tuple[str, str]]:
        """(call, listener) of every live call's subscription."""
        return [(c, lst) for c, listeners in self._listeners.items() for lst in listeners]

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
