"""The supervisor's end of the sink's control socket: requests with callbacks
matched by request id, and the sink's unsolicited events handed to handlers.

Replies and events share one socket, so their order is the sink's order: an
attempt's E_ENDED that the sink produced before a fence arrives before that
fence's reply. The attempt driver relies on this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from streamfence.protocol.internal import (
    C_AUTHORIZE,
    C_FENCE,
    C_FINISH,
    C_STATS,
    E_ENDED,
    E_EVENT,
    E_EVENTS,
    E_FINAL_REFUSED,
    R_OK,
    R_REFUSED,
)

log = logging.getLogger("streamfence.sinklink")

Reply = Callable[[bool, Any], None]


class SinkLink:
    def __init__(self, socket: zmq.Socket[bytes],
                 on_event: Callable[[str, int, bytes], None],
                 on_ended: Callable[[str, int, dict[str, Any], dict[str, Any]], None],
                 on_final_refused: Callable[[str, int, str], None]) -> None:
        self.socket = socket
        self._on_event = on_event
        self._on_ended = on_ended
        self._on_final_refused = on_final_refused
        self._next_req = 1
        self._pending: dict[int, Reply] = {}
        self.stats: dict[str, Any] = {}

    def _request(self, msg: list[Any], reply: Reply) -> None:
        req = self._next_req
        self._next_req += 1
        msg.insert(1, req)
        self._pending[req] = reply
        self.socket.send(msgpack.packb(msg, use_bin_type=True))

    def authorize(self, call_id: str, attempt: int, reset: bool, model: str,
                  reply: Reply) -> None:
        self._request([C_AUTHORIZE, call_id, attempt, reset, model], reply)

    def fence(self, call_id: str, attempt: int, reply: Reply) -> None:
        self._request([C_FENCE, call_id, attempt], reply)

    def finish(self, call_id: str, status: str, error: dict[str, Any] | None, attempts: int,
               meta: dict[str, Any], reply: Reply) -> None:
        self._request([C_FINISH, call_id, status, error, attempts, meta], reply)

    def refresh_stats(self) -> None:
        self._request([C_STATS], self._store_stats)

    def _store_stats(self, ok: bool, payload: Any) -> None:
        if ok and isinstance(payload, dict):
            self.stats = payload

    def forget_pending(self) -> list[Reply]:
        """The sink died: its replies will never come. Hands back the waiting
        callbacks (the caller fails each one) and starts afresh."""
        lost = list(self._pending.values())
        self._pending.clear()
        return lost

    def drain(self, limit: int = 10_000) -> int:
        """Handle what the sink sent, without blocking. Returns messages handled."""
        n = 0
        while n < limit:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            msg = msgpack.unpackb(frame, raw=False)
            tag = msg[0]
            if tag == E_EVENTS:
                on_event = self._on_event
                for event in msg[1]:
                    on_event(event[1], event[2], event[3])
            elif tag == E_EVENT:
                self._on_event(msg[1], msg[2], msg[3])
            elif tag in (R_OK, R_REFUSED):
                callback = self._pending.pop(msg[1], None)
                if callback is None:
                    log.warning("sink reply to unknown request %r", msg[1])
                else:
                    callback(tag == R_OK, msg[2])
            elif tag == E_ENDED:
                self._on_ended(msg[1], msg[2], msg[3], msg[4])
            elif tag == E_FINAL_REFUSED:
                self._on_final_refused(msg[1], msg[2], msg[3])
            else:
                log.warning("unexpected message tag %r from the sink", tag)
        return n
