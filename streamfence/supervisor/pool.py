"""The warm worker pool, as seen from the supervisor.

Workers are forked by the zygote (workers/zygote.py); the pool tracks each
one's state, keeps `spare` ready workers beyond the busy ones so a retry never
waits for a fork, kills a worker with SIGKILL when its attempt is fenced, and
replaces it in the background. Every worker has a liveness slot
(workers/liveness.py), reused only after its previous holder was reaped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack
import zmq

from streamfence.protocol.internal import W_HELLO, W_IDLE
from streamfence.protocol.internal.workers import RunAttempt, SpawnWorker, ZygoteCommand, encode_run
from streamfence.protocol.lifecycle import ExitCode
from streamfence.workers.liveness import LivenessTable

log = logging.getLogger("streamfence.pool")


class WorkerState(Enum):
    SPAWNING = "spawning"  # fork requested, no hello yet
    IDLE = "idle"  # ready for an attempt
    RESERVED = "reserved"  # picked for an attempt that awaits its authorization
    BUSY = "busy"  # running an attempt
    KILLING = "killing"  # SIGKILL sent, not yet reaped
    DEAD = "dead"


class WorkerEvent(Enum):
    HELLO = "hello"  # W_HELLO: the worker is up
    RESERVE = "reserve"
    RUN = "run"  # W_RUN sent
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


class Pool:
    """Owns the workers (their states, slots, pids), the supervisor's side of the
    `workers` socket (W_RUN out; W_HELLO, W_IDLE in) and the liveness table.
    Fork requests go to the zygote through `send_to_zygote`."""

    def __init__(self, send_to_zygote: Callable[[ZygoteCommand], None],
                 workers_sock: zmq.Socket[bytes], live: LivenessTable, slots: int,
                 spare: int, max_workers: int) -> None:
        self._send = send_to_zygote
        self.socket = workers_sock
        self._live = live
        self._free_slots = list(range(slots - 1, -1, -1))
        self.spare = spare
        self.max_workers = min(max_workers, slots)
        self.workers: dict[int, Worker] = {}
        self._by_pid: dict[int, Worker] = {}
        self._next_id = 1
        self.spawned_total = 0
        self.killed_total = 0

    # ---- bookkeeping -------------------------------------------------------
    def get(self, worker_id: int | None) -> Worker | None:
        return None if worker_id is None else self.workers.get(worker_id)

    def liveness(self, worker: Worker) -> tuple[int, int, int, int]:
        """The worker's liveness row: (token, last chunk ns, chunks, bytes)."""
        return self._live.read(worker.slot)

    def count(self, *states: WorkerState) -> int:
        return sum(1 for w in self.workers.values() if w.state in states)

    def live(self) -> int:
        return self.count(WorkerState.SPAWNING, WorkerState.IDLE, WorkerState.RESERVED,
                          WorkerState.BUSY, WorkerState.KILLING)

    def maintain(self, demand: int = 0) -> None:
        """Fork until idle+spawning covers the queued demand plus the spares."""
        want = self.spare + demand
        have = self.count(WorkerState.SPAWNING, WorkerState.IDLE)
        while have < want and self.live() < self.max_workers and self._free_slots:
            self._spawn()
            have += 1

    def _spawn(self) -> None:
        worker = Worker(worker_id=self._next_id, slot=self._free_slots.pop(),
                        since=time.monotonic())
        self._next_id += 1
        self.workers[worker.worker_id] = worker
        self.spawned_total += 1
        self._send(SpawnWorker(worker.worker_id, worker.slot))

    # ---- events ------------------------------------------------------------
    def on_spawned(self, worker_id: int, pid: int) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.pid = pid
            self._by_pid[pid] = worker

    def on_hello(self, worker_id: int, pid: int) -> Worker | None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state is WorkerState.DEAD:
            return None
        worker.pid = pid
        self._by_pid[pid] = worker
        worker.to(WorkerEvent.HELLO)
        return worker

    def on_idle(self, worker_id: int) -> Worker | None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state is not WorkerState.BUSY:
            return None
        worker.to(WorkerEvent.IDLE)
        worker.call_id, worker.attempt, worker.token = None, 0, 0
        return worker

    def on_exited(self, worker_id: int, pid: int, returncode: int) -> Worker | None:
        worker = self.workers.get(worker_id) or self._by_pid.get(pid)
        if worker is None:
            return None
        worker.to(WorkerEvent.EXITED)
        worker.returncode = returncode
        self._by_pid.pop(pid, None)
        del self.workers[worker.worker_id]
        self._free_slots.append(worker.slot)
        return worker

    def on_zygote_lost(self) -> list[Worker]:
        """The zygote died and its workers with it: every worker is gone."""
        return [w for w in list(self.workers.values())
                if self.on_exited(w.worker_id, w.pid, -signal.SIGKILL) is not None]

    def drain(self) -> int:
        """Handle what the workers sent, without blocking. Returns the hellos."""
        hellos = 0
        while True:
            try:
                _identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return hellos
            msg = msgpack.unpackb(frame, raw=False)
            if msg[0] == W_HELLO:
                hellos += self.on_hello(msg[1], msg[2]) is not None
            elif msg[0] == W_IDLE:
                self.on_idle(msg[1])

    # ---- actions -----------------------------------------------------------
    def reserve(self, call_id: str, attempt: int, token: int) -> Worker | None:
        for worker in self.workers.values():
            if worker.state is WorkerState.IDLE:
                worker.to(WorkerEvent.RESERVE)
                worker.call_id, worker.attempt, worker.token = call_id, attempt, token
                return worker
        return None

    def release(self, worker: Worker) -> None:
        """Give back a reserved worker whose attempt never started."""
        if worker.state is WorkerState.RESERVED:
            worker.to(WorkerEvent.RELEASE)
            worker.call_id, worker.attempt, worker.token = None, 0, 0

    def dispatch(self, worker: Worker, run: RunAttempt) -> bool:
        """Send the reserved `worker` its attempt. False: it is unreachable (killed
        after it reported idle, before the zygote reported its exit), and now
        being killed: the attempt never started."""
        worker.to(WorkerEvent.RUN)
        try:
            self.socket.send_multipart([worker.identity, encode_run(run)])
        except zmq.ZMQError as exc:
            log.warning("worker %d unreachable (%s); fencing the attempt", worker.worker_id, exc,
                        extra={"session_id": run.session_id, "call_id": run.call_id,
                               "attempt": run.attempt})
            self.kill(worker)
            return False
        return True

    def kill(self, worker: Worker) -> None:
        """SIGKILL; the zygote reaps it and reports `exited`."""
        if worker.state in (WorkerState.KILLING, WorkerState.DEAD):
            return
        worker.to(WorkerEvent.KILL)
        self.killed_total += 1
        if worker.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)

    def close(self) -> None:
        """At shutdown: release the liveness table (the daemon closes the socket)."""
        self._live.close()

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"worker_id": w.worker_id, "pid": w.pid, "state": w.state.value,
                 "call_id": w.call_id, "attempt": w.attempt,
                 "for_s": round(now - w.since, 3)}
                for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
