"""The gate before an attempt's first request (ARCHITECTURE §2.2).

The supervisor sends W_RUN when it schedules an attempt, before the journal
has committed its epoch and the sink has authorized it; the worker prepares
the attempt meanwhile (reads the request, builds the client and the SDK's
request) and stops at this gate, which opens on the supervisor's W_GO. So
the worker's preparation overlaps the two commits, and still the provider
sees nothing, and the sink hears nothing, of an attempt that was not
authorized: on W_DROP the gate raises `AttemptDropped` and the attempt
ends unseen.

A worker runs one attempt at a time, on its main thread, so there is one
gate: `GATE`, armed per attempt by workers/worker.py (a spare's warm-up
runs before any attempt and finds it open) and waited at: by the SSE
wires' transport once it has the request's connection (workers/http11.py:
a new connection is opened while the word is awaited, so a retry's TCP and
TLS handshakes overlap the commits too; the provider sees a connection,
never a byte of a request, before W_GO), and by botocore's before-send
hook (workers/bedrock_converse.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum


class AttemptDropped(Exception):
    """The supervisor dropped the prepared attempt (W_DROP)."""

    def __init__(self) -> None:
        super().__init__("the attempt was dropped before its request (never authorized)")


class GateState(Enum):
    OPEN = "open"  # no attempt waits here (or its W_GO came)
    SHUT = "shut"  # an attempt is prepared; its word not in yet
    DROPPED = "dropped"  # W_DROP came: nothing of the attempt may be sent


class SendGate:
    """`arm(word, on_go)`: shut the gate for the next attempt. `word()`
    blocks for the supervisor's word (True: W_GO); `on_go()` runs once it
    came, before the first request (the sink's hello, the liveness row)."""

    __slots__ = ("_on_go", "_word", "state")

    def __init__(self) -> None:
        self.state = GateState.OPEN
        self._word: Callable[[], bool] = bool
        self._on_go: Callable[[], None] = _nothing

    def arm(self, word: Callable[[], bool], on_go: Callable[[], None]) -> None:
        self.state = GateState.SHUT
        self._word, self._on_go = word, on_go

    def shut(self) -> bool:
        """Whether the attempt still waits for its word."""
        return self.state is GateState.SHUT

    def wait(self) -> None:
        """Return once the attempt may send (at once if it may already);
        AttemptDropped if it never may."""
        if self.state is GateState.OPEN:
            return
        if self.state is GateState.SHUT:
            if self._word():
                self.state = GateState.OPEN
                self._on_go()
                return
            self.state = GateState.DROPPED
        raise AttemptDropped

    def open(self) -> None:
        """After the attempt (whatever became of it): nothing waits here."""
        self.state = GateState.OPEN


def _nothing() -> None:
    pass


GATE = SendGate()


def wait_at_gate(*_args: object, **_kwargs: object) -> None:
    """botocore's before-send hook (the SSE wires' transport waits itself)."""
    GATE.wait()
