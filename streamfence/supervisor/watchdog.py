"""When each live call is next looked at, and the stale watchdog
(docs/ARCHITECTURE.md §4.1).

A live call has at most one timer: a queued call's deadline, a backing-off
call's end of backoff, or a running attempt's next liveness check (its
stale or first-chunk limit, or its deadline if that is sooner). The
AttemptDriver arms them and acts on the calls whose timer came (it alone
moves a call's state); `check_running` says whether a running attempt is
to be fenced, from its worker's liveness row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from streamfence.protocol.states import FenceReason
from streamfence.supervisor.calls import Call
from streamfence.supervisor.livecalls import call_context
from streamfence.supervisor.pool import Pool
from streamfence.supervisor.timers import Deadlines

log = logging.getLogger("streamfence.attempts")


class Watchdog:
    """Owns each live call's next check (monotonic seconds, `clock`'s)."""

    def __init__(self, pool: Pool, clock: Callable[[], float]) -> None:
        self._pool = pool
        self._clock = clock
        self._due: Deadlines[str] = Deadlines()

    def next_due(self) -> float | None:
        return self._due.next_due()

    def pop_due(self, now: float) -> list[str]:
        return self._due.pop_due(now)

    def arm(self, call_id: str, when: float) -> None:
        self._due.arm(call_id, when)

    def clear(self, call_id: str) -> None:
        self._due.clear(call_id)

    def arm_deadline(self, call: Call) -> None:
        """A queued call's only timer is its deadline."""
        if call.deadline is not None:
            self._due.arm(call.call_id, call.deadline)
        else:
            self._due.clear(call.call_id)

    def arm_watch(self, call: Call, since_ns: int, limit_s: float) -> None:
        """A running attempt is next looked at when `limit_s` passes from
        `since_ns` without a chunk, or at its deadline if that is sooner;
        and within its stale timeout at most, so that an attempt still in
        a longer first-chunk budget that has its first chunks and then goes
        silent is looked at (and fenced) by the stale timeout, not at the
        budget's end (the liveness row has no event of its own)."""
        left_s = limit_s - (time.monotonic_ns() - since_ns) / 1e9  # liveness is in monotonic ns
        left_s = min(left_s, call.timeouts.stale_s)
        when = self._clock() + max(0.0, left_s)
        if call.deadline is not None:
            when = min(when, call.deadline)
        self._due.arm(call.call_id, when)

    def check_running(self, call: Call, now: float) -> FenceReason | None:
        """For one running attempt whose timer came: why it is to be fenced
        (stale, or its deadline passed), or None (its next check is armed, or
        its worker is gone: the exit report fences it). The liveness row says
        when its last chunk was."""
        worker = self._pool.get(call.worker_id)
        if worker is None:
            return None
        token, last_ns, chunks, _ = self._pool.liveness(worker)
        if token == call.token and worker.token == call.token and self._pool.stream_over(worker):
            # The provider has sent everything: the worker waits for the sink,
            # whose time is never the provider's stall (nor the breaker's).
            now_ns = time.monotonic_ns()
            log.info("the provider's stream is over; waiting for the sink (%.1fs since its "
                     "last chunk)", (now_ns - last_ns) / 1e9, extra=call_context(call))
            self.arm_watch(call, now_ns, call.timeouts.stale_s)
            return None
        if token == call.token and chunks > 0:
            since, limit = last_ns, call.timeouts.stale_s
        else:
            since, limit = call.dispatched_ns, call.timeouts.first_chunk_s
        now_ns = time.monotonic_ns()
        if now_ns - since >= limit * 1e9:
            log.warning("stale attempt: no chunk for %.1fs (limit %.1fs, chunks so far %d)",
                        (now_ns - since) / 1e9, limit, chunks if token == call.token else 0,
                        extra=call_context(call))
            return FenceReason.STALE
        if call.deadline is not None and now >= call.deadline:
            return FenceReason.DEADLINE
        self.arm_watch(call, since, limit)
        return None
