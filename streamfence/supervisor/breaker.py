"""Circuit breakers per (session_id, provider profile), on stale attempts.

Counts consecutive stale attempts of a pair (each attempt once, however often
its timer would fire: the supervisor fences an attempt once). A success
closes it. At `threshold` the breaker opens: new calls of the pair fail fast
with `breaker_open`, no network attempt. After `cooldown_s` it lets one call
through (half-open): its success closes the breaker, a stale attempt opens it
again for another cool-down. A model group's call asks the breaker of each
deployment's profile per attempt (`blocks`), and skips one that blocks
(supervisor/deployments.py). Pure: the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"  # one probe call is allowed through


@dataclass(slots=True)
class _Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_stale: int = 0
    opened_at: float = 0.0
    probe_out: bool = False


Key = tuple[str, str]  # (session_id or "-", profile name)


class Breakers:
    """Owns one breaker per (session, profile) pair with a stale streak. The Front
    asks `admit`; the AttemptDriver reports stale, success and probe ends."""

    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float]) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._pairs: dict[Key, _Breaker] = {}

    def admit(self, key: Key) -> str | None:
        """None if a new call of the pair may run, else the reason it may not."""
        b = self._pairs.get(key)
        if b is None or b.state is BreakerState.CLOSED:
            return None
        waited = self._clock() - b.opened_at
        if b.state is BreakerState.OPEN and waited >= self.cooldown_s:
            b.state = BreakerState.HALF_OPEN
        if b.state is BreakerState.HALF_OPEN and not b.probe_out:
            b.probe_out = True
            return None
        retry_in = max(0.0, self.cooldown_s - waited)
        return (f"circuit breaker open for session {key[0]!r} on provider {key[1]!r}: "
                f"{b.consecutive_stale} consecutive attempts went stale (threshold "
                f"{self.threshold}); the provider looks wedged for this session. New calls "
                f"fail fast; one probe call is let through in {retry_in:.0f}s. Check the "
                f"provider's status, or use another profile.")

    def blocks(self, key: Key) -> bool:
        """Whether `admit` would refuse the pair now; changes nothing (a
        group's choice asks this of each deployment, then `admit`s the one
        it takes, which may be the half-open breaker's probe)."""
        b = self._pairs.get(key)
        if b is None or b.state is BreakerState.CLOSED:
            return False
        if b.state is BreakerState.OPEN:
            return self._clock() - b.opened_at < self.cooldown_s
        return b.probe_out

    def on_stale(self, key: Key) -> None:
        b = self._pairs.setdefault(key, _Breaker())
        b.consecutive_stale += 1
        b.probe_out = False
        if b.state is BreakerState.HALF_OPEN or b.consecutive_stale >= self.threshold:
            b.state = BreakerState.OPEN
            b.opened_at = self._clock()

    def on_success(self, key: Key) -> None:
        self._pairs.pop(key, None)

    def on_probe_ended(self, key: Key) -> None:
        """A probe call ended without a verdict (neither stale nor success)."""
        b = self._pairs.get(key)
        if b is not None:
            b.probe_out = False

    def snapshot(self) -> list[dict[str, Any]]:
        """Every pair with a stale streak, open or not (a success clears it)."""
        return [{"session_id": k[0], "provider": k[1], "state": b.state.value,
                 "consecutive_stale": b.consecutive_stale}
                for k, b in self._pairs.items()]
