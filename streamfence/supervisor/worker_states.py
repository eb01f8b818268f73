"""One worker as the pool sees it (supervisor/pool.py): its state machine
(`Worker.to`: an event its state does not take is a bug and raises), and an
exit code as a log line says it."""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from enum import Enum

from streamfence.protocol.internal.workers import RunAttempt
from streamfence.protocol.lifecycle import ExitCode
from streamfence.protocol.states import WorkerState


class WorkerEvent(Enum):
    HELLO = "hello"  # W_HELLO: the worker is up
    RESERVE = "reserve"
    RUN = "run"  # W_GO sent (after its W_RUN: at the reservation, or just now)
    RELEASE = "release"
    IDLE = "idle"  # W_IDLE: its attempt is over
    KILL = "kill"
    EXITED = "exited"  # the zygote reaped it


_W = WorkerEvent
# state -> event -> next state; anything else is a bug and raises.
_TRANSITIONS: dict[WorkerState, dict[WorkerEvent, WorkerState]] = {
    WorkerState.SPAWNING: {_W.HELLO: WorkerState.IDLE, _W.KILL: WorkerState.KILLING,
                           _W.EXITED: WorkerState.DEAD},
    WorkerState.IDLE: {_W.RESERVE: WorkerState.RESERVED, _W.KILL: WorkerState.KILLING,
                       _W.EXITED: WorkerState.DEAD},
    WorkerState.RESERVED: {_W.RUN: WorkerState.BUSY, _W.RELEASE: WorkerState.IDLE,
                           _W.KILL: WorkerState.KILLING, _W.EXITED: WorkerState.DEAD},
    WorkerState.BUSY: {_W.IDLE: WorkerState.IDLE, _W.KILL: WorkerState.KILLING,
                       _W.EXITED: WorkerState.DEAD},
    WorkerState.KILLING: {_W.EXITED: WorkerState.DEAD, _W.KILL: WorkerState.KILLING,
                          _W.IDLE: WorkerState.KILLING, _W.HELLO: WorkerState.KILLING},
    WorkerState.DEAD: {},
}


class InvalidTransition(Exception):
    pass


@dataclass(slots=True)
class Worker:
    worker_id: int
    slot: int
    state: WorkerState = WorkerState.SPAWNING
    pid: int = 0
    call_id: str | None = None
    attempt: int = 0
    token: int = 0
    since: float = 0.0
    returncode: int | None = None
    runs: int = 0  # attempts dispatched to it
    prepared: bool = False  # reserved, its W_RUN sent: it waits for W_GO or W_DROP
    held: RunAttempt | None = None  # reserved, its W_RUN to go with its W_GO (Pool.prepare)
    idle_at: float = 0.0  # when it last became idle (the pool's clock)

    @property
    def identity(self) -> bytes:
        return b"w%d" % self.worker_id

    def to(self, event: WorkerEvent) -> None:
        nxt = _TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise InvalidTransition(f"worker {self.worker_id} in state {self.state.value} "
                                    f"got event {event.value!r}")
        self.state = nxt
        self.since = time.monotonic()


def exit_text(code: int | None) -> str:
    """A child's exit code for a log line: its ExitCode name, or the signal."""
    if code is None:
        return "unknown"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} (signal {signal.Signals(-code).name})"
    with contextlib.suppress(ValueError):
        return f"{code} ({ExitCode(code).name})"
    return str(code)
