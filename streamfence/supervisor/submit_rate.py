"""The token buckets behind an identity's `submits_per_s` and
`submit_bytes_per_s` (config/identities.py; docs/SECURITY.md)."""

from __future__ import annotations

from collections.abc import Callable


class SubmitRate:
    """Token buckets per identity: `rate` per second (submits, or bytes with
    `cost`), bursts of a second's worth (or of one submit's cost, if more).
    `admit` is O(1) and needs no timer."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, at)

    def admit(self, name: str, rate: float, cost: float = 1.0) -> float | None:
        """None if a submit costing `cost` may go now (and take its tokens),
        else the seconds to wait."""
        if rate <= 0:
            return None
        tokens, now = self._tokens(name, rate, cost)
        if tokens >= cost:
            self._buckets[name] = (tokens - cost, now)
            return None
        self._buckets[name] = (tokens, now)
        return (cost - tokens) / rate

    def wait(self, name: str, rate: float, cost: float = 1.0) -> float | None:
        """What `admit` would answer, taking nothing."""
        if rate <= 0:
            return None
        tokens, _ = self._tokens(name, rate, cost)
        return None if tokens >= cost else (cost - tokens) / rate

    def _tokens(self, name: str, rate: float, cost: float) -> tuple[float, float]:
        burst = max(1.0, cost, rate)
        now = self._clock()
        tokens, at = self._buckets.get(name, (burst, now))
        return min(burst, tokens + (now - at) * rate), now
