"""What an ended attempt means for its call: the streaming fall-backs and the
circuit breakers learn from it, `calls.decide` says finish or retry, and a
retry gets its backoff, or a finish when the call's deadline leaves no time
for it.

The AttemptDriver asks and moves the call (every transition stays in
attempts.py); this module sets only the fields of the call that its next
attempt or its end reads (delivered, traceback, probe_next, notice).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from streamfence.config.model import DaemonConfig
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal.control import AttemptStats, FinishMeta
from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.protocol.messages import CallStatus
from streamfence.protocol.states import FenceReason
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call, Finish, call_error, decide
from streamfence.supervisor.fallbacks import Fallbacks
from streamfence.supervisor.livecalls import call_context
from streamfence.supervisor.timeouts import backoff_delay


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry at `retry_at` (monotonic seconds), `delay` from now; `why`: the
    ended attempt's error message."""

    retry_at: float
    delay: float
    why: str | None


def _breaker_key(call: Call) -> tuple[str, str]:
    return (call.spec.session_id or "-", call.profile.name)


class Verdicts:
    """The rules, over state owned elsewhere: the fall-backs (the driver's),
    the breakers (shared with the Front's admission), the backoff settings."""

    def __init__(self, config: DaemonConfig, fallbacks: Fallbacks, breakers: Breakers,
                 clock: Callable[[], float], rng: random.Random) -> None:
        self._config = config
        self._fallbacks = fallbacks
        self._breakers = breakers
        self._clock = clock
        self._rng = rng

    def stale(self, call: Call) -> None:
        """The call's attempt was fenced as stale (once per attempt: fenced once)."""
        self._breakers.on_stale(_breaker_key(call))

    def judge(self, call: Call, stats: AttemptStats, outcome: AttemptOutcome | None,
              error: AttemptError | None) -> Finish | Backoff:
        """Attempt `call.epoch` ended: `stats` the sink's view of it, `outcome`
        the worker's if the sink accepted its final, `error` its error (None:
        a clean end)."""
        if stats.visible_chars > 0:
            call.delivered = True
        # An unexpected exception's traceback, for the call's last line if this
        # attempt is its last (logged once, in `_log_end`).
        call.traceback = error.traceback if error is not None else None
        if error is not None:
            adjusted = self._fallbacks.adjust(call.profile.name, error, stats.accepted,
                                              call_context(call))
            error = adjusted.error
            if adjusted.probe_next:
                call.probe_next = True
        decision = decide(call, stats, outcome, error, self._clock())
        if error is None and outcome is not None:
            self._breakers.on_success(_breaker_key(call))
        elif call.fence_reason is not FenceReason.STALE:
            self._breakers.on_probe_ended(_breaker_key(call))
        if isinstance(decision, Finish):
            return decision
        cfg = self._config
        delay = backoff_delay(call.attempts, cfg.backoff_base_s, cfg.backoff_max_s,
                              decision.retry_after_s, self._rng)
        now = self._clock()
        if call.deadline is not None and now + delay >= call.deadline:
            return Finish(CallStatus.FAILED, call_error(
                ErrorCode.DEADLINE_EXCEEDED,
                "the deadline leaves no time for the next attempt's backoff"), FinishMeta())
        message = error.message if error is not None else None
        if stats.tool_fragments > 0:
            call.notice = (f"The connection dropped in the middle of a tool call "
                           f"({message}); the request is retried "
                           f"and the tool call starts over.")
        return Backoff(now + delay, delay, message)
