"""The warm worker pool, as seen from the supervisor.

Workers are forked by the zygote (workers/zygote.py); the pool tracks each
one's state, stops and kills a worker when its attempt is fenced, and
replaces it in the background. Every worker has a liveness slot
(workers/liveness.py), reused only after its previous holder was reaped.

How many workers it keeps (`Pool.target`): the recent peak of the load
(attempts running or authorizing, plus the calls queued for a worker),
decaying with a half-life of `peak_half_life_s` (`workers_peak_half_life_s`,
30 s), plus `spare` ready workers, so that a retry and the next call never
wait for a fork (`workers_spare`, default 2: a warmed idle worker costs
~11 MiB USS, so an idle daemon stays small). A burst larger than the spares
waits for its forks; the same burst again finds them: after a burst of 64
the pool keeps 64 + spare workers (within `max_workers`), 32 + spare a
half-life later, `spare` after a few minutes. Idle workers above the target
are retired (SIGKILL), the longest idle first, once idle for RETIRE_AFTER_S
(or the half-life if shorter: a dip of the load, such as a retry's backoff,
does not retire the worker the retry will want). Bounded by `max_workers`
(and the liveness slots) throughout.

Which forks go when: a call that waits for a worker gets its fork at once
(cold: it runs the call, no warm-up). The spares wait while attempts start
(one is authorizing, awaits its first chunk, or was fenced and its call
retries; or calls wait for forks), at most `refill_wait_s`
(`workers_refill_wait_s`, 1 s; 0: at once): the two cores go to a burst's
first requests, not to the workers a next burst may want.

A stale attempt's worker is stopped at once (SIGSTOP) and killed once no
attempt is starting, at most `refill_wait_s` later (0: at once): its exit,
2.5-5 ms of CPU, would take the cores its retry starts on (PERFORMANCE.md
"Issue 32: the pool"). Other kills (a cancel, a deadline) are at once:
their provider may still be sending.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from streamfence.protocol.internal.checks import BadFrame
from streamfence.protocol.internal.workers import (
    RunAttempt,
    SpawnWorker,
    WorkerHello,
    ZygoteCommand,
    drop_frame,
    encode_run,
    go_frame,
    parse_from_worker,
)
from streamfence.protocol.states import WorkerState
from streamfence.supervisor.worker_states import Worker, WorkerEvent
from streamfence.workers.liveness import LivenessTable

log = logging.getLogger("streamfence.pool")

PEAK_HALF_LIFE_S = 30.0
RETIRE_AFTER_S = 10.0
RETIRE_CHECK_S = 1.0  # how often a pool above its floor looks for workers to retire
REFILL_WAIT_S = 1.0  # spare forks wait for starting attempts at most this long
REFILL_POLL_S = 0.01  # how often a waiting refill looks at the starting attempts' first chunks
# Attempts that prepare while they are authorized, at most; in a burst the rest
# get their W_RUN with their W_GO, so that the burst's preparations do not take
# the cores the journal's and the sink's commits need (docs/PERFORMANCE.md).
PREPARE_AHEAD = 2


class Pool:
    """Owns the workers (their states, slots, pids), the supervisor's side of the
    `workers` socket (W_RUN, W_GO, W_DROP out; W_HELLO, W_IDLE in), the
    liveness table and the decaying peak of the load. Fork requests go to the zygote through
    `send_to_zygote`. `clock` (monotonic seconds) times the peak's decay."""

    def __init__(self, send_to_zygote: Callable[[ZygoteCommand], None],
                 workers_sock: zmq.Socket[bytes], live: LivenessTable, slots: int,
                 spare: int, max_workers: int, clock: Callable[[], float] = time.monotonic,
                 peak_half_life_s: float = PEAK_HALF_LIFE_S,
                 retire_after_s: float = RETIRE_AFTER_S,
                 refill_wait_s: float = REFILL_WAIT_S) -> None:
        self._send = send_to_zygote
        self.socket = workers_sock
        self._live = live
        self._free_slots = list(range(slots - 1, -1, -1))
        self.spare = spare
        self.max_workers = min(max_workers, slots)
        self.workers: dict[int, Worker] = {}
        self._by_pid: dict[int, Worker] = {}
        self._states: Counter[WorkerState] = Counter()  # workers by state (DEAD: none)
        # The idle workers, longest idle first: those that never ran an attempt, the others.
        self._idle_new: dict[int, Worker] = {}
        self._idle_used: dict[int, Worker] = {}
        self._clock = clock
        self._half_life_s = peak_half_life_s
        self._retire_after_s = min(retire_after_s, peak_half_life_s)
        self._peak = 0.0  # the load's peak, decayed to `_peak_at`
        self._peak_at = clock()
        self._demand = 0  # calls queued for a worker, as last told
        self._maintained_at = 0.0
        self._fenced: set[int] = set()  # killed by `kill`, not yet reaped: their calls retry
        self._stopped: dict[int, float] = {}  # worker id -> when `kill` stopped it (SIGKILL due)
        self._refill_wait_s = refill_wait_s
        self._unstarted: set[int] = set()  # busy, no first chunk seen yet
        self._preparing = 0  # reserved workers with their W_RUN sent (prepared)
        self._refill_since: float | None = None  # spare forks waiting since then
        # (call, token) of runs whose worker went idle without its final
        # accepted; the daemon hands them to the AttemptDriver after `drain`.
        self.unaccepted: list[tuple[str, int]] = []
        self._next_id = 1
        self.spawned_total = self.killed_total = self.retired_total = 0
        self.refills_deferred = 0  # times spare forks waited for starting attempts

    # ---- bookkeeping -------------------------------------------------------
    def get(self, worker_id: int | None) -> Worker | None:
        return None if worker_id is None else self.workers.get(worker_id)

    def liveness(self, worker: Worker) -> tuple[int, int, int, int]:
        """The worker's liveness row: (token, last chunk ns, chunks, bytes)."""
        return self._live.read(worker.slot)

    def stream_over(self, worker: Worker) -> bool:
        """The worker's provider stream has ended: it only waits for the sink."""
        return self._live.stream_over(worker.slot)

    def count(self, *states: WorkerState) -> int:
        return sum(self._states[state] for state in states)

    def live(self) -> int:
        return self.count(WorkerState.SPAWNING, WorkerState.IDLE, WorkerState.RESERVED,
                          WorkerState.BUSY, WorkerState.KILLING)

    def _to(self, worker: Worker, event: WorkerEvent) -> None:
        """Every transition of a pool worker: keeps the counts and the idle order."""
        before = worker.state
        worker.to(event)
        if worker.state is not before:
            self._states[before] -= 1
            self._states[worker.state] += 1
            if before is WorkerState.BUSY:
                self._unstarted.discard(worker.worker_id)
            if before is WorkerState.RESERVED:
                self._preparing -= worker.prepared
                worker.prepared, worker.held = False, None
            if before is WorkerState.IDLE:
                del (self._idle_used if worker.runs else self._idle_new)[worker.worker_id]
            if worker.state is WorkerState.IDLE:
                (self._idle_used if worker.runs else self._idle_new)[worker.worker_id] = worker
                worker.idle_at = self._clock()

    def _load(self) -> int:
        """Workers reserved or busy, those killed under an attempt and not yet
        reaped, and the queued demand last given to `maintain`."""
        return (self.count(WorkerState.RESERVED, WorkerState.BUSY) + len(self._fenced)
                + self._demand)

    def target(self) -> int:
        """How many workers (spawning, idle, reserved or busy) the pool wants now:
        the load's recent peak (decayed, rounded; at least the load now) plus `spare`,
        within `max_workers`. The load is the workers reserved or busy, those
        killed under an attempt and not yet reaped (their replacement is forked
        at the kill, not when the retry takes a spare), plus the queued demand
        last given to `maintain`."""
        now = self._clock()
        load = self._load()
        elapsed = max(0.0, now - self._peak_at)
        peak = self._peak * 0.5 ** (elapsed / self._half_life_s)
        self._peak, self._peak_at = max(peak, float(load)), now
        return min(self.max_workers, math.floor(self._peak + 0.5) + self.spare)

    def maintain(self, demand: int | None = None) -> None:
        """Fork what the target lacks: at once for the calls waiting, the spares
        once no attempt is starting (`_spares_wait`); retire the idle workers
        above it that have been idle for `retire_after_s` (the longest idle
        first, new ones before used ones). `demand`: the calls queued for a
        worker (None: as last given)."""
        if demand is not None:
            self._demand = demand
        now = self._maintained_at = self._clock()
        if self._stopped:
            self._kill_stopped(now)
        want = self.target()
        have = self.count(WorkerState.SPAWNING, WorkerState.IDLE, WorkerState.RESERVED,
                          WorkerState.BUSY)
        if have < want:
            room = min(want - have, self.max_workers - self.live(), len(self._free_slots))
            # Forks for calls already waiting go first and start cold; the rest
            # are spares, which warm up after their hello (workers/warmup.py).
            cold = min(room, max(0, self._demand - self.count(WorkerState.IDLE,
                                                              WorkerState.SPAWNING)))
            spares = room - cold
            for i in range(cold + (0 if spares and self._spares_wait(now) else spares)):
                self._spawn(warm=i >= cold)
            return
        self._refill_since = None
        if have > want and (self._idle_new or self._idle_used):
            since = now - self._retire_after_s
            old = itertools.chain.from_iterable(  # each ordered by idle_at
                itertools.takewhile(lambda w: w.idle_at <= since, ws.values())
                for ws in (self._idle_new, self._idle_used))
            for worker in list(itertools.islice(old, have - want)):
                self._retire(worker, want)

    def _spares_wait(self, now: float) -> bool:
        """Whether spare forks wait: some attempt is starting (reserved, busy
        without a first chunk, fenced and not reaped: its call retries) or calls
        wait for forks, and they have not waited `refill_wait_s` yet."""
        if not (self._refill_wait_s > 0 and self._starting()):
            self._refill_since = None
            return False
        if self._refill_since is None:
            self._refill_since = now
            self.refills_deferred += 1
            log.debug("spare forks wait: attempts are starting")
        waits = now - self._refill_since < self._refill_wait_s
        self._refill_since = self._refill_since if waits else None
        return waits

    def _kill_stopped(self, now: float) -> None:
        """SIGKILL those stopped REFILL_POLL_S ago if no attempt starts, else refill_wait_s."""
        wait = self._refill_wait_s
        if not self._attempts_starting():
            wait = min(wait, REFILL_POLL_S)
        for worker_id, stopped_at in list(self._stopped.items()):
            if now >= stopped_at + wait:
                del self._stopped[worker_id]
                self._signal(self.workers[worker_id], signal.SIGKILL)

    def _starting(self) -> bool:  # see _spares_wait
        return bool(self._fenced) or self._attempts_starting()

    def _attempts_starting(self) -> bool:
        """Calls wait for forks, or an attempt is authorizing or awaits its first chunk."""
        if self._demand or self.count(WorkerState.RESERVED):
            return True
        for worker_id in list(self._unstarted):
            worker = self.workers[worker_id]
            token, _, chunks, _ = self._live.read(worker.slot)
            if token == worker.token and (chunks or self._live.stream_over(worker.slot)):
                self._unstarted.discard(worker_id)
        return bool(self._unstarted)

    def next_due(self) -> float | None:
        """When `maintain` has something to do (monotonic seconds): while spare
        forks wait, every REFILL_POLL_S; while the pool holds more than its
        floor (`spare` plus the load now), about once a second as the peak
        decays (to retire an idle worker); while a stopped worker awaits its
        kill, every REFILL_POLL_S; else never."""
        dues = [self._retire_due() if self._refill_since is None else min(
            self._maintained_at + REFILL_POLL_S, self._refill_since + self._refill_wait_s)]
        if self._stopped:
            stopped_at = min(self._stopped.values())
            dues.append(min(max(self._maintained_at, stopped_at) + REFILL_POLL_S,
                            stopped_at + self._refill_wait_s))
        return min((due for due in dues if due is not None), default=None)

    def _retire_due(self) -> float | None:
        if not (self._idle_new or self._idle_used):
            return None
        have = self.count(WorkerState.SPAWNING, WorkerState.IDLE, WorkerState.RESERVED,
                          WorkerState.BUSY)
        if have <= min(self.max_workers, self._load() + self.spare):
            return None
        oldest = min(next(iter(ws.values())).idle_at  # each is ordered by idle_at
                     for ws in (self._idle_new, self._idle_used) if ws)
        return max(self._maintained_at + RETIRE_CHECK_S, oldest + self._retire_after_s)

    def _spawn(self, warm: bool) -> None:
        worker = Worker(worker_id=self._next_id, slot=self._free_slots.pop(),
                        since=time.monotonic())
        self._next_id += 1
        self.workers[worker.worker_id] = worker
        self._states[WorkerState.SPAWNING] += 1
        self.spawned_total += 1
        self._send(SpawnWorker(worker.worker_id, worker.slot, warm))

    def _retire(self, worker: Worker, target: int) -> None:
        """An idle worker the target no longer wants: SIGKILL (it runs nothing);
        the zygote reaps it and reports `exited`, which frees its slot."""
        log.debug("retiring idle worker %d (pid %d): the pool's target is %d workers",
                  worker.worker_id, worker.pid, target)
        self._to(worker, WorkerEvent.KILL)
        self.retired_total += 1
        self._signal(worker, signal.SIGKILL)

    def _signal(self, worker: Worker, signum: int) -> None:
        if worker.pid:  # 0: not forked yet (its hello finds it dead)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signum)

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
        self._to(worker, WorkerEvent.HELLO)
        return worker

    def on_idle(self, worker_id: int, final_accepted: bool = True) -> Worker | None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state is not WorkerState.BUSY:
            return None
        if not final_accepted and worker.call_id is not None:
            self.unaccepted.append((worker.call_id, worker.token))
        self._to(worker, WorkerEvent.IDLE)
        worker.call_id, worker.attempt, worker.token = None, 0, 0
        return worker

    def on_exited(self, worker_id: int, pid: int, returncode: int) -> Worker | None:
        worker = self.workers.get(worker_id) or self._by_pid.get(pid)
        if worker is None:
            return None
        self._to(worker, WorkerEvent.EXITED)
        self._states[WorkerState.DEAD] -= 1
        self._fenced.discard(worker.worker_id)
        self._stopped.pop(worker.worker_id, None)
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
            try:
                msg = parse_from_worker(frame)
            except BadFrame as exc:
                log.warning("unexpected message from a worker: %s", exc.reason)
                continue
            if isinstance(msg, WorkerHello):
                hellos += self.on_hello(msg.worker_id, msg.pid) is not None
            else:
                self.on_idle(msg.worker_id, msg.final_accepted)

    # ---- actions -----------------------------------------------------------
    def reserve(self, call_id: str, attempt: int, token: int) -> Worker | None:
        """An idle worker, reserved (None if none is): the most recently idle of
        those that ran an attempt (warm for certain, its pages still resident),
        else the longest idle of the new ones."""
        if self._idle_used:
            worker = next(reversed(self._idle_used.values()))
        elif self._idle_new:
            worker = next(iter(self._idle_new.values()))
        else:
            return None
        self._to(worker, WorkerEvent.RESERVE)
        worker.call_id, worker.attempt, worker.token = call_id, attempt, token
        return worker

    def release(self, worker: Worker) -> None:
        """Give back a reserved worker whose attempt never started (a prepared
        one is told W_DROP: it sent nothing and goes back to waiting)."""
        if worker.state is WorkerState.RESERVED:
            if worker.prepared and not self._tell(worker, drop_frame(worker.token)):
                return  # unreachable: being killed
            self._to(worker, WorkerEvent.RELEASE)
            worker.call_id, worker.attempt, worker.token = None, 0, 0

    def prepare(self, worker: Worker, run: RunAttempt) -> None:
        """The reserved `worker`'s attempt, as it is scheduled: sent now (W_RUN),
        so that the worker prepares it while it is authorized and sends nothing
        before `go` (workers/send_gate.py), unless PREPARE_AHEAD attempts
        prepare already: then it goes with its W_GO."""
        if worker.state is not WorkerState.RESERVED:
            return
        if self._preparing >= PREPARE_AHEAD:
            worker.held = run
        elif self._tell(worker, encode_run(run)):
            worker.prepared = True
            self._preparing += 1

    def go(self, worker: Worker) -> bool:
        """The reserved `worker`'s attempt is authorized: W_GO (after its W_RUN,
        if that was held). False: the worker is gone or unreachable (killed
        after it reported idle, before the zygote reported its exit), and now
        being killed: the attempt never started."""
        held = worker.held
        if worker.state is not WorkerState.RESERVED or not (worker.prepared or held):
            return False
        self._to(worker, WorkerEvent.RUN)
        worker.runs += 1
        self._unstarted.add(worker.worker_id)
        if held is not None and not self._tell(worker, encode_run(held)):
            return False
        return self._tell(worker, go_frame(worker.token))

    def _tell(self, worker: Worker, frame: bytes) -> bool:
        try:
            self.socket.send_multipart([worker.identity, frame])
        except zmq.ZMQError as exc:
            log.warning("worker %d unreachable (%s); its attempt never starts",
                        worker.worker_id, exc, extra={"call_id": worker.call_id,
                                                      "attempt": worker.attempt})
            self.kill(worker)
            return False
        return True

    def kill(self, worker: Worker, *, stalled: bool = False) -> None:
        """SIGKILL; `stalled` (its stream sends nothing): SIGSTOP now, SIGKILL
        later (`_kill_stopped`). The zygote reaps it."""
        if worker.state in (WorkerState.KILLING, WorkerState.DEAD):
            return
        if worker.state in (WorkerState.RESERVED, WorkerState.BUSY):
            self._fenced.add(worker.worker_id)
        self._to(worker, WorkerEvent.KILL)
        self.killed_total += 1
        if stalled and worker.pid and self._refill_wait_s > 0:
            self._stopped[worker.worker_id] = self._clock()
            self._signal(worker, signal.SIGSTOP)
        else:
            self._signal(worker, signal.SIGKILL)

    def close(self) -> None:
        """At shutdown: release the liveness table (the daemon closes the socket)."""
        self._live.close()

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"worker_id": w.worker_id, "pid": w.pid, "state": w.state.value,
                 "call_id": w.call_id, "attempt": w.attempt,
                 "for_s": round(now - w.since, 3)}
                for w in sorted(self.workers.values(), key=lambda w: w.worker_id)]
