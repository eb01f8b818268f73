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

log = logging.getLogger("streamfence.pool")


class WorkerState(Enum):
    SPAWNING = "spawning"  # fork requested, no hello yet
    IDLE = "idle"  # ready for an attempt
    RESERVED = "reserved"  # picked for an attempt that awaits its authorization
    BUSY = "busy"  # running an attempt
    KILLING = "killing"  # SIGKILL sent, not yet reaped
    DEAD = "dead"


# state -> event -> next state; anything else is a bug and raises.
_TRANSITIONS: dict[WorkerState, dict[str, WorkerState]] = {
    WorkerState.SPAWNING: {"hello": WorkerState.IDLE, "kill": WorkerState.KILLING,
                           "exited": WorkerState.DEAD},
    WorkerState.IDLE: {"reserve": WorkerState.RESERVED, "kill": WorkerState.KILLING,
                       "exited": WorkerState.DEAD},
    WorkerState.RESERVED: {"run": WorkerState.BUSY, "release": WorkerState.IDLE,
                           "kill": WorkerState.KILLING, "exited": WorkerState.DEAD},
    WorkerState.BUSY: {"idle": WorkerState.IDLE, "kill": WorkerState.KILLING,
                       "exited": WorkerState.DEAD},
    WorkerState.KILLING: {"exited": WorkerState.DEAD, "kill": WorkerState.KILLING,
                          "idle": WorkerState.KILLING, "hello": WorkerState.KILLING},
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

    def to(self, event: str) -> None:
        nxt = _TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise InvalidTransition(f"worker {self.worker_id} in state {self.state.value} "
                                    f"got event {event!r}")
        self.state = nxt
        self.since = time.monotonic()


class Pool:
    def __init__(self, send_to_zygote: Callable[[list[Any]], None], slots: int,
                 spare: int, max_workers: int) -> None:
        self._send = send_to_zygote
        self._free_slots = list(range(slots - 1, -1, -1))
        self.spare = spare
        self.max_workers = min(max_workers, slots)
        self.workers: dict[int, Worker] = {}
        self._by_pid: dict[int, Worker] = {}
        self._next_id = 1
        self.spawned_total = 0
        self.killed_total = 0

    # ---- bookkeeping -------------------------------------------------------
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
        self._send(["spawn", worker.worker_id, worker.slot])

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
        worker.to("hello")
        return worker

    def on_idle(self, worker_id: int) -> Worker | None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state is not WorkerState.BUSY:
            return None
        worker.to("idle")
        worker.call_id, worker.attempt, worker.token = None, 0, 0
        return worker

    def on_exited(self, worker_id: int, pid: int, returncode: int) -> Worker | None:
        worker = self.workers.get(worker_id) or self._by_pid.get(pid)
        if worker is None:
            return None
        worker.to("exited")
        worker.returncode = returncode
        self._by_pid.pop(pid, None)
        del self.workers[worker.worker_id]
        self._free_slots.append(worker.slot)
        return worker

    # ---- actions -----------------------------------------------------------
    def reserve(self, call_id: str, attempt: int, token: int) -> Worker | None:
        for worker in self.workers.values():
            if worker.state is WorkerState.IDLE:
                worker.to("reserve")
                worker.call_id, worker.attempt, worker.token = call_id, attempt, token
                return worker
        return None

    def release(self, worker: Worker) -> None:
        """Give back a reserved worker whose attempt never started."""
        if worker.state is WorkerState.RESERVED:
            worker.to("release")
            worker.call_id, worker.attempt, worker.token = None, 0, 0

    def kill(self, worker: Worker) -> None:
        """SIGKILL; the zygote reaps it and reports `exited`."""
        if worker.state in (WorkerState.KILLING, WorkerState.DEAD):
            return
        worker.to("kill")
        self.killed_total += 1
        if worker.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"worker_id": w.worker_id, "pid": w.pid, "state": w.state.value,
                 "call_id": w.call_id, "attempt": w.attempt,
                 "for_s": round(now - w.since, 3)}
                for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
