"""Cluster mode: what waits for the calls' logs (ARCHITECTURE §4.17, rule 3),
so that the sink's loop never waits for the cluster.

Each group commit hands the runs it accepted here (`take`, the commit's
hook) instead of to the transcript; per call, in order (`_Waiting`):

- `queued`: runs not yet appended. One append per call is in flight at a
  time (`flying`: each is conditional on the sequence the one before left);
  the runs queued meanwhile go together in the next. Answered, they are
  stored (a `done` row with its call's done mark) and committed (`settle`);
- `items`: the call's events, sent to its listeners once the runs before
  them are stored (durable before visible), and steps parked until then
  (`after_stored`: a final's verdict and ack, an authorize's epoch open, a
  finish's done, and any control op of the call that comes while one of
  those waits), run in order;
- `opening`: a question about the call in flight (`ask`: an epoch open, an
  adopt's, a rebind's, a follow's read), before whose answer nothing of the
  call is appended and no later step runs.

An append or open the cluster did not answer (a timeout, no node) is tried
again from the loop's timers (`due`, `retry`), 50 ms doubling to 1 s, for as
long as it takes: the same append (its id makes a stored one a duplicate).
Meanwhile the loop serves everything else: other calls' runs, fences,
stats, subscribers. A refused append (another host opened a later epoch)
drops the call's queued runs and events (never stored, never sent), the
sink is told (`on_lost`), and its parked steps run on, seeing the call lost.
The bytes waiting are bounded: past QUEUED_BYTES `has_room` is False and the
loop stops reading the workers until the cluster answers.
"""

from __future__ import annotations

import logging
import math
import select
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from streamfence.sink.calls import Calls
from streamfence.sink.cluster_log import Appended, ClusterLog, Row
from streamfence.sink.commits import Commits
from streamfence.sink.store import TranscriptStore

log = logging.getLogger("streamfence.sink")

QUEUED_BYTES = 64 * 1024 * 1024  # runs waiting for the cluster, beyond which input waits
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
REMIND_EVERY_S = 10.0  # a lasting outage is logged again this often

Step = Callable[[], None]
Event = tuple[set[bytes], list[bytes]]  # listeners, a run of encoded events


@dataclass(slots=True)
class _Waiting:
    """One call's runs, events and steps waiting for its log (module docstring).
    An item waits until `stored` reaches its mark (`queued_in` when it came)."""

    queued: list[Row] = field(default_factory=list)
    flying: list[Row] | None = None
    items: deque[tuple[int, Step | Event]] = field(default_factory=deque)
    opening: bool = False
    queued_in: int = 0  # rows queued so far
    stored: int = 0  # ... of which stored
    tries: int = 0
    steps: int = 0  # of `items`, the steps (the rest are events)

    def idle(self) -> bool:
        return not (self.queued or self.flying is not None or self.items or self.opening
                    or self.stored < self.queued_in)


class LogQueue:
    """Owns, per call, what waits for its log; counts the tries again."""

    def __init__(self, cluster: ClusterLog, store: TranscriptStore, calls: Calls,
                 commits: Commits, on_lost: Callable[[str], None]) -> None:
        self._cluster = cluster
        self._store = store
        self._calls = calls
        self._commits = commits
        self._on_lost = on_lost
        self._waiting: dict[str, _Waiting] = {}
        # Runs the cluster stored, for the next `settle`; calls whose items may move then.
        self._answered: list[Row] = []
        self._settled: set[str] = set()
        # The appends and opens the cluster did not answer: when to try each again.
        # Only these, not every call waiting: the loop asks `due` every turn.
        self._redo: dict[str, tuple[float, Step]] = {}
        self.bytes = 0  # of the rows queued and flying
        self.retries = 0  # appends and opens tried again
        self._failing_since: float | None = None
        self._reminded = 0.0
        self._batch = cluster.bridge.batch

    # ---- what the sink's operations ask ---------------------------------------------

    def has_room(self) -> bool:
        return self.bytes < QUEUED_BYTES

    def waits(self, call_id: str) -> bool:
        """Something of the call waits for its log."""
        return call_id in self._waiting

    def parked(self, call_id: str) -> bool:
        """A step of the call waits (an open, a parked op): the call's next control
        op waits behind it, in order."""
        waiting = self._waiting.get(call_id)
        return waiting is not None and (waiting.opening or waiting.steps > 0)

    def after_stored(self, call_id: str, step: Step) -> None:
        """`step()` once every run of the call accepted so far is stored and every
        step before it ran: at once if nothing waits."""
        waiting = self._waiting.get(call_id)
        if waiting is None:
            step()
            return
        waiting.items.append((waiting.queued_in, step))
        waiting.steps += 1
        self._move(call_id)

    def ask(self, call_id: str, start: Callable[[Callable[[Any], None]], None],
            then: Callable[[Any], object], again: bool = True) -> None:
        """Once every run of the call is stored: `start(answer)` asks the cluster
        something about the call without waiting (an epoch open, a follow), and
        nothing later of the call moves until its `answer(result)`; then
        `then(result)`. A result that is an exception (the cluster did not
        answer) is asked again from the loop's timers, with `again`; else it
        goes to `then` too."""
        def begin() -> None:
            self._waiting.setdefault(call_id, _Waiting()).opening = True
            start(answered)

        def answered(result: Any) -> None:
            waiting = self._waiting[call_id]
            if isinstance(result, BaseException) and again:
                self._failed(call_id, waiting, result, begin)
                return
            self._answered_ok(waiting)
            waiting.opening = False
            then(result)
            self._move(call_id)
        self.after_stored(call_id, begin)

    def open(self, call_id: str, attempt: int, read_before: bool,
             then: Callable[[list[Row] | str], object]) -> None:
        """`attempt`'s epoch opened in the call's log (ClusterLog.open_soon), asked
        until the cluster answers: `then(the rows before it, or why not)`. Runs
        of the call queued meanwhile wait for it; refused, they go (`_drop`)."""
        def opened(result: list[Row] | str) -> object:
            if isinstance(result, str):
                self._drop(call_id, self._waiting[call_id])
            return then(result)
        self.ask(call_id, lambda answer: self._cluster.open_soon(call_id, attempt, read_before,
                                                                  answer), opened)

    def take(self) -> None:
        """The commit's hook (Commits.replicate): the runs the store buffered
        and the events in the outbox wait here for their calls' logs; calls
        this sink has not opened (rows after its restart, before any
        authorize) are lost at once, never written blind."""
        rows = self._store.take_unreplicated()
        if rows:
            with self._batch():  # the commit's appends go to NATS together
                self._queue(rows)

    def _queue(self, rows: list[Row]) -> None:
        outbox = self._commits.outbox
        by_call: dict[str, list[Row]] = {}
        for row in rows:
            by_call.setdefault(row[0], []).append(row)
        lives = self._calls.lives
        owner = {id(lives[c].subs): c for c in by_call if c in lives}
        waiting = self._waiting
        lost = [c for c in by_call  # (a call whose open is in flight: its runs wait for it)
                if not self._cluster.holds(c) and not (c in waiting and waiting[c].opening)]
        for call_id in lost:
            del by_call[call_id]
        for call_id, runs in by_call.items():
            entry = waiting.setdefault(call_id, _Waiting())
            entry.queued += runs
            entry.queued_in += len(runs)
            self.bytes += sum(len(r[6]) for r in runs)
        now: list[Event] = []
        for subs, event in outbox:
            of = owner.get(id(subs))
            held = self._waiting.get(of) if of is not None else None
            if held is not None:
                held.items.append((held.queued_in, (subs, event)))
            elif of is None:  # not one of this commit's calls (never expected)
                now.append((subs, event))
        outbox[:] = now  # in place: the hot path holds a bound append
        for call_id in by_call:
            self._send(call_id)
        for call_id in lost:
            self._on_lost(call_id)

    # ---- answers ------------------------------------------------------------------

    def settle(self) -> None:
        """After the bridge's callbacks ran: the runs the cluster stored go to the
        transcript in one commit, then each call's items that may move, move."""
        with self._batch():  # the appends the answers let go, together
            self._settle()

    def _settle(self) -> None:
        answered, self._answered = self._answered, []
        if answered:
            store = self._store
            store.add_replicated(answered)
            for row in answered:
                if row[4] == "done":  # the done mark goes with its row (Fencing.finish)
                    store.set_done(row[0], row[3], msgpack.unpackb(row[6])["status"], row[1])
            self._commits.commit()
            for row in answered:  # stored now: what waits for them may move
                waiting = self._waiting.get(row[0])
                if waiting is not None:
                    waiting.stored += 1
        settled, self._settled = self._settled, set()
        for call_id in settled:
            self._move(call_id)

    def _appended(self, call_id: str, result: Appended) -> None:
        waiting = self._waiting[call_id]
        if isinstance(result, BaseException):
            self._failed(call_id, waiting, result, lambda: self._send(call_id, again=True))
            return
        rows = waiting.flying or []
        waiting.flying = None
        self.bytes -= sum(len(r[6]) for r in rows)
        self._answered_ok(waiting)
        if result is None:
            self._answered += rows  # stored, and counted in `stored`, at `settle`
        else:  # refused: the call is another host's; nothing queued is stored or sent
            self._drop(call_id, waiting)
            self._on_lost(call_id)
        self._settled.add(call_id)

    def _drop(self, call_id: str, waiting: _Waiting) -> None:
        """The call's log is another host's: its queued runs and their events go
        (never stored, never sent); its steps run on, seeing the call lost."""
        self.bytes -= sum(len(r[6]) for r in waiting.queued)
        waiting.queued = []
        waiting.stored = waiting.queued_in - sum(1 for r in self._answered if r[0] == call_id)
        waiting.items = deque(i for i in waiting.items if not isinstance(i[1], tuple))

    def _send(self, call_id: str, again: bool = False) -> None:
        """The call's queued runs, appended (one append in flight per call)."""
        waiting = self._waiting[call_id]
        if not again:
            if waiting.flying is not None or waiting.opening or not waiting.queued:
                return
            waiting.flying, waiting.queued = waiting.queued, []
        assert waiting.flying is not None
        self._cluster.append_soon(call_id, waiting.flying,
                                  lambda result: self._appended(call_id, result))

    def _move(self, call_id: str) -> None:
        """The call's items whose runs are stored: events sent, steps run, in order."""
        waiting = self._waiting.get(call_id)
        if waiting is None:
            return
        events: list[Event] = []
        items = waiting.items
        while items and items[0][0] <= waiting.stored and not waiting.opening:
            _, item = items.popleft()
            if isinstance(item, tuple):
                events.append(item)
                continue
            if events:
                self._commits.deliver(events)
                events = []
            waiting.steps -= 1
            item()  # may queue runs, open an epoch, park more steps
        if events:
            self._commits.deliver(events)
        self._send(call_id)
        if waiting.idle() and self._waiting.get(call_id) is waiting:
            del self._waiting[call_id]

    # ---- the cluster not answering ----------------------------------------------------

    def _failed(self, call_id: str, waiting: _Waiting, failure: BaseException,
                redo: Step) -> None:
        waiting.tries += 1
        wait_s = min(RETRY_FIRST_S * 2 ** (waiting.tries - 1), RETRY_MAX_S)
        self._redo[call_id] = (time.monotonic() + wait_s, redo)
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = self._reminded = now
            log.warning("sink: the cluster did not answer call %s's append or open (%s: %s); "
                        "its runs wait and are tried again; the loop goes on", call_id,
                        type(failure).__name__, failure)
        elif now - self._reminded >= REMIND_EVERY_S:
            self._reminded = now
            log.warning("sink: the cluster has not answered for %.0f s: %d call(s), %d bytes "
                        "wait (%s)", now - self._failing_since, len(self._waiting), self.bytes,
                        failure)

    def _answered_ok(self, waiting: _Waiting) -> None:
        waiting.tries = 0
        if self._failing_since is not None:
            log.warning("sink: the cluster answers again after %.1f s",
                        time.monotonic() - self._failing_since)
            self._failing_since = None

    def due(self) -> float:
        """When the next try again is due (monotonic; inf: none)."""
        return min((at for at, _ in self._redo.values()), default=math.inf)

    def retry(self) -> None:
        now = time.monotonic()
        with self._batch():
            for call_id, (at, redo) in list(self._redo.items()):
                if at <= now:
                    del self._redo[call_id]
                    self.retries += 1
                    redo()

    def drain(self, timeout_s: float) -> int:
        """At a stop: wait up to `timeout_s` for the appends in flight; the rows
        still waiting after it (given up: never stored here, and their
        attempts never acked, so they run again)."""
        bridge = self._cluster.bridge
        deadline = time.monotonic() + timeout_s
        while any(w.flying is not None or w.queued for w in self._waiting.values()):
            left = min(deadline, self.due()) - time.monotonic()
            if time.monotonic() >= deadline:
                break
            select.select([bridge.fd], [], [], max(0.0, left))
            bridge.run_done()
            self.retry()
            self.settle()
        return sum(len(w.queued) + len(w.flying or ()) for w in self._waiting.values())

    def stats(self) -> dict[str, int]:
        waiting = self._waiting.values()
        return {"cluster_waiting_calls": sum(1 for w in waiting if w.queued or w.flying),
                "cluster_waiting_rows": sum(len(w.queued) + len(w.flying or ()) for w in waiting),
                "cluster_waiting_bytes": self.bytes,
                "cluster_parked_steps": sum(w.steps for w in waiting),
                "cluster_append_retries": self.retries}
