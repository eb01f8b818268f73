"""When a dead sink or zygote is started again, and when the daemon gives up
(docs/ARCHITECTURE.md §4.14).

One `RestartPolicy` per child process. The daemon tells it when the child
started (`started`), when it served (`ready`: the sink answered its first
request, the zygote reported ready) and when it died (`died`); `died`
answers either a `Restart` at some time or a `GiveUp` with its reason. The
daemon starts the child again when `due` has come (its loop sleeps until
then, like every other deadline, and serves clients meanwhile).

The policy, as gunicorn treats a worker's boot failure and systemd a unit's
restarts:

- a child that died after it served is restarted with exponential back-off,
  FIRST_DELAY_S doubling to MAX_DELAY_S; the delay starts over once the
  child has served for STABLE_AFTER_S before it dies. Why not give up after
  a number of deaths (the old rule: more than 5 sink deaths in 60 s stopped
  the daemon): a storm of outside kills is not a broken sink, and a daemon
  that stops leaves every client without an answer until someone restarts it;
- a child that cannot start is given up on: an exit with one of the
  child's fatal codes (the sink's CANNOT_BIND: nothing will free the port),
  or START_FAILURES_MAX exits in a row before it served. A death by SIGKILL
  or SIGTERM before it served is not counted as one: someone killed it (an
  operator, the OOM killer), which says nothing of whether it can start;
- each restart is logged once, with its delay; once the delay has reached
  its cap, at most one line per LOG_EVERY_S (with the restarts not logged
  since), so a child that keeps dying cannot flood the log. The line is an
  ERROR, but INFO when the daemon is stopping: a stop signal sent to the
  whole process group (`kill -TERM -PGID`) stops the children with it, which
  is no failure (a child restarted then serves the drain: the sink stores
  the running calls' ends).

No I/O but logging; the clock is passed in.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from streamfence.supervisor.worker_states import exit_text

log = logging.getLogger("streamfence.supervisor")

FIRST_DELAY_S = 0.1
MAX_DELAY_S = 10.0
STABLE_AFTER_S = 30.0  # served this long: its next death restarts the back-off
START_FAILURES_MAX = 5  # exits in a row before serving: it cannot start
LOG_EVERY_S = 60.0  # at the delay's cap, the most often a restart is logged
# Deaths that someone else caused: never counted as failures to start.
_KILLED = frozenset({-signal.SIGKILL, -signal.SIGTERM})


@dataclass(frozen=True, slots=True)
class Restart:
    """Start the child again at `at` (monotonic seconds), `delay_s` after its death."""

    at: float
    delay_s: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The child cannot start: the daemon stops, with `reason` in one line."""

    reason: str


class RestartPolicy:
    """Owns one child's restart state: when it started, whether it served,
    its current back-off delay, its failures to start in a row, and the
    restart pending (if any)."""

    def __init__(self, name: str, clock: Callable[[], float],
                 fatal: Mapping[int, str] | None = None) -> None:
        self.name = name
        self._clock = clock
        self._fatal = dict(fatal or {})  # exit code -> why the child can never start
        self._started_at = clock()
        self._ready = False
        self._delay = 0.0  # the last restart's delay; 0: none since it was stable
        self._start_failures = 0
        self._due: float | None = None
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    @property
    def down(self) -> bool:
        """The child is dead and its restart pending."""
        return self._due is not None

    @property
    def serving(self) -> bool:
        """The child now running has served (it is up and answered)."""
        return self._ready and self._due is None

    def due(self) -> float | None:
        """When the pending restart is due (None: none is)."""
        return self._due

    def take_due(self, now: float) -> bool:
        """True once the pending restart is due (the caller starts the child now)."""
        if self._due is None or now < self._due:
            return False
        self._due = None
        return True

    def started(self) -> None:
        self._started_at = self._clock()
        self._ready = False

    def ready(self) -> None:
        """The child served: it can start."""
        self._ready = True
        self._start_failures = 0

    def died(self, returncode: int | None, stopping: bool = False) -> Restart | GiveUp:
        """The child died with `returncode` (None: unknown); `stopping`: while
        the daemon stops. Logs the decision (the give-up is the caller's to
        log, with whatever it adds)."""
        now = self._clock()
        code = -signal.SIGKILL if returncode is None else returncode
        if code in self._fatal:
            return GiveUp(f"the {self.name} cannot start: {self._fatal[code]}")
        if not self._ready and code not in _KILLED:
            self._start_failures += 1
            if self._start_failures >= START_FAILURES_MAX:
                return GiveUp(f"the {self.name} cannot start: it exited before it was ready "
                              f"{self._start_failures} times in a row (last: {exit_text(code)})")
        if self._ready and now - self._started_at >= STABLE_AFTER_S:
            self._delay = 0.0
        capped = self._delay >= MAX_DELAY_S  # the last restart's delay was at the cap
        self._delay = min(MAX_DELAY_S, self._delay * 2 if self._delay else FIRST_DELAY_S)
        self._due = now + self._delay
        if capped and now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
        else:
            self._log_restart(code, now, stopping)
        return Restart(self._due, self._delay)

    def _log_restart(self, code: int, now: float, stopping: bool) -> None:
        more = f"; {self._unlogged} more restart(s) since the last line" if self._unlogged else ""
        log.log(logging.INFO if stopping else logging.ERROR,
                "the %s exited with %s after %.1fs%s%s; restarting it in %.1fs%s", self.name,
                exit_text(code), now - self._started_at,
                "" if self._ready else ", before it was ready",
                " while the daemon stops" if stopping else "", self._delay, more)
        self._logged_at, self._unlogged = now, 0


class RestartedChild:
    """A child process the supervisor starts again when it dies (the sink,
    the gateway): its `process` (a multiprocessing.Process, None before its
    first start) and its `restarts` policy, set by the subclass."""

    process: Any
    restarts: RestartPolicy

    def pid(self) -> int | None:
        """None while it is down, awaiting its restart."""
        return None if self.restarts.down else int(self.process.pid)

    def reap(self) -> int | None:
        """It died: wait for it; its exit code."""
        self.process.join(timeout=1.0)
        code: int | None = self.process.exitcode
        return code
