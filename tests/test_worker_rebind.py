"""The worker's side of a rebind (workers/worker.py `SinkOutput`,
ARCHITECTURE §2.8), against a fake connection: an attempt's first message
is T_HELLO, and so is the first on a connection opened again mid-attempt, also when the connection breaks
again while the worker sends its held deltas after a T_REBIND (issue 28,
defect 1: the sink dies again during the recovery)."""

from __future__ import annotations

from typing import Any

import msgpack

from streamfence.protocol.internal import T_DELTA, T_HELLO, T_REBIND
from streamfence.workers.worker import SinkOutput


class _Live:
    def touch(self, slot: int, nbytes: int) -> None:
        pass


class _BreakingSink:
    """A connection that breaks at the `break_at`-th send (that frame is
    lost); like SinkChannel, the next send opens a new connection and is
    written there. The sink's answers come from `replies`."""

    def __init__(self, break_at: int, replies: list[list[Any]]) -> None:
        self.written: list[list[Any]] = []
        self.lost = False
        self._sends = 0
        self._break_at = break_at
        self._replies = replies

    def send(self, frame: bytes) -> None:
        self._sends += 1
        if self._sends == self._break_at:
            self.lost = True
            return
        self.written.append(msgpack.unpackb(frame))

    def wait_reply(self, timeout_s: float) -> Any | None:
        return self._replies.pop(0) if self._replies else None


def test_a_break_while_sending_the_held_deltas_says_hello_again_first() -> None:
    """Three deltas under attempt 1, then the sink dies; the restarted one
    answers the hello with attempt 2, and dies at the first delta sent again:
    nothing under attempt 2 may reach its successor before the new hello
    (it would be refused there as superseded or closed), and the rest goes
    under the attempt that successor names."""
    sink = _BreakingSink(break_at=6, replies=[[T_REBIND, "c1", 1, 1, 0],  # the start hello's
                                              [T_REBIND, "c1", 1, 2, 0],
                                              [T_REBIND, "c1", 2, 3, 0]])
    out = SinkOutput(sink, "c1", 1, 7, _Live(), 0)  # type: ignore[arg-type]
    out.begin()
    for text in ("a", "b", "c"):
        out.delta("text", text)
    sink.lost = True  # the first sink died
    out.delta("text", "d")  # held: hello, T_REBIND to 2, sent again (breaks), hello, 3
    assert [(m[0], m[2]) for m in sink.written[:4]] == [(T_HELLO, 1)] + [(T_DELTA, 1)] * 3
    after = [(m[0], m[2]) for m in sink.written[4:]]
    assert after == [(T_HELLO, 1), (T_HELLO, 2)] + [(T_DELTA, 3)] * 4
    assert [m[3] for m in sink.written[6:]] == [1, 2, 3, 4]
    assert out.attempt == 3 and not out.over and not sink.lost
