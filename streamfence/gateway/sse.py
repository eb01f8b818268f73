"""What the two wire renderers share: the SSE frame encoder and the per-attempt
gate that keeps a retried attempt's output out of the stream.

Contract:
- `frame(seq, data, event=None)`: one server-sent event, `event: E` (when
  given), `id: SEQ`, `data: D`, a blank line. `data` is bytes sent as they are
  or an object encoded as compact JSON (which holds no raw newline, so one
  `data:` line always suffices). The id is the daemon event's seq, so a client
  that reconnects with `Last-Event-ID` names the last event it has.
- `AttemptGate`: under `on_partial: "continue"` the daemon retries an attempt
  only while it has delivered no visible text (PROTOCOL §5, §6), and the next
  attempt streams again from the start, with no `reset`. So what an attempt
  sends before its first visible character may be voided: whitespace-only
  text and refusal pieces wait in the gate until the attempt's first visible
  piece (then they go out first) or its done; a delta of a new attempt drops
  them. A new attempt after visible text would be a second answer in one
  stream, which the providers' wires cannot express: `on_attempt` raises
  `SecondAnswer`, and the renderer ends the stream with an error.
- `StreamState`, `RESTARTED`: the renderers' states and the restart's message.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import orjson

from streamfence.protocol.messages import visible_chars

RESTARTED = "the answer was restarted; retry the request"  # the in-stream error of a restart


class StreamState(Enum):
    """A renderer's state: anything unexpected in a state raises ValueError."""

    OPEN = "open"  # deltas go out
    ENDED = "ended"  # the done went out: nothing may follow
    BROKEN = "broken"  # a restart ended the stream with an error: the rest is ignored


def frame(seq: int, data: Any, event: str | None = None) -> bytes:
    """One SSE frame with `id: seq`; see the module docstring."""
    body = data if isinstance(data, bytes) else orjson.dumps(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return b"%sid: %d\ndata: %s\n\n" % (head, seq, body)


class SecondAnswer(Exception):
    """A delta of a new attempt after the current one delivered visible text."""


class AttemptGate:
    """The current attempt's held-back pieces; see the module docstring."""

    __slots__ = ("attempt", "committed", "held")

    def __init__(self) -> None:
        self.attempt: int | None = None
        self.committed = False  # the attempt delivered visible text: it will not be retried
        self.held: list[tuple[str, str]] = []  # (kind, piece): whitespace not yet sent

    def on_attempt(self, attempt: int) -> bool:
        """Note a delta's attempt. True when it starts a retry of an earlier
        attempt (whose held pieces are dropped); raises SecondAnswer when the
        earlier one had delivered visible text."""
        if attempt == self.attempt:
            return False
        retry = self.attempt is not None
        if retry and self.committed:
            raise SecondAnswer(f"attempt {attempt} after attempt {self.attempt} delivered text")
        self.attempt, self.committed = attempt, False
        self.held.clear()
        return retry

    def admit(self, kind: str, piece: str) -> list[tuple[str, str]]:
        """The (kind, piece) pairs of text or refusal to send now: none while the
        attempt has shown nothing visible, else the held ones and this one."""
        if not self.committed and visible_chars(kind, piece) == 0:
            if piece:
                self.held.append((kind, piece))
            return []
        self.committed = True
        out = [*self.held, (kind, piece)]
        self.held.clear()
        return out

    def release(self) -> list[tuple[str, str]]:
        """At a completed or partial done: what is still held goes out."""
        out = list(self.held)
        self.held.clear()
        return out
