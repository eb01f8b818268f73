"""Streaming fall-backs per provider profile (docs/ARCHITECTURE.md, "Streaming
fall-backs"), remembered for the daemon's run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome, ErrorClass

log = logging.getLogger("streamfence.attempts")

# Error codes that mean "this provider will not stream for this profile".
NON_STREAMING_CODES = frozenset({"streaming_unsupported", "empty_sse_frames"})
PROBE_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Adjusted:
    error: AttemptError  # what `decide` should see
    probe_next: bool  # run the call's next attempt non-streaming


class Fallbacks:
    """Owns what the daemon learnt per profile: profiles whose provider refused
    `stream_options`, profiles switched to non-streaming (streaming refused,
    keep-alive-only streams, the streaming action denied), and when each
    profile's last non-streaming probe after a 5xx went out."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._no_stream_options: set[str] = set()
        self._no_streaming: set[str] = set()
        self._last_probe: dict[str, float] = {}

    def streaming(self, profile: str) -> bool:
        return profile not in self._no_streaming

    def include_usage(self, profile: str) -> bool:
        return profile not in self._no_stream_options

    def learn(self, profile: str, outcome: AttemptOutcome) -> None:
        """An attempt's outcome (as its worker reported it) for `profile`."""
        if outcome.stream_options_rejected:
            self._no_stream_options.add(profile)
        if outcome.streaming_denied:
            self._no_streaming.add(profile)

    def adjust(self, profile: str, error: AttemptError, accepted: int,
               ctx: dict[str, Any]) -> Adjusted:
        """An attempt of `profile` failed with `error` after the sink accepted
        `accepted` deltas; `ctx` is the call's log context."""
        if error.code in NON_STREAMING_CODES and profile not in self._no_streaming:
            # The provider will not stream for this profile: switch it to
            # non-streaming (delivered as deltas) and try again at once.
            log.warning("profile %s switched to non-streaming: %s", profile, error.message,
                        extra=ctx)
            self._no_streaming.add(profile)
            return Adjusted(replace(error, error_class=ErrorClass.TRANSIENT, retry_after_s=0.0),
                            False)
        status = error.status or 0
        now = self._clock()
        if (status >= 500 and accepted == 0 and profile not in self._no_streaming
                and now - self._last_probe.get(profile, -PROBE_WINDOW_S) >= PROBE_WINDOW_S):
            # A 5xx killed the stream before any delta: one non-streaming probe
            # per window, whose 4xx (if any) replaces the opaque 5xx.
            self._last_probe[profile] = now
            return Adjusted(error, True)
        return Adjusted(error, False)
