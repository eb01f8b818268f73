"""The supervisor's histograms of the admin `status` (their wire shape and
buckets: protocol/histograms.py): the first chunk of each attempt and the
duration of each call, observed once per attempt or call."""

from __future__ import annotations

from typing import Any

from streamfence.protocol.histograms import CALL_DURATION_BUCKETS, FIRST_CHUNK_BUCKETS, Histogram
from streamfence.protocol.internal.outcome import AttemptOutcome
from streamfence.protocol.states import FenceReason


def attempt_outcome(outcome: AttemptOutcome | None, fenced: FenceReason | None) -> str:
    """How an attempt ended, for `counters["attempts.<outcome>"]`: with its
    final accepted (which wins over a fence sent meanwhile), `ok` or `error`
    (the worker's failure); else the reason the supervisor fenced it
    (`stale`: a stale kill; calls.FenceReason)."""
    if outcome is not None:
        return "ok" if outcome.error is None else "error"
    return fenced.value if fenced is not None else "error"


class Histograms:
    """The supervisor's histograms, owned by the AttemptDriver, and the
    acceptance time of each live call (monotonic seconds)."""

    def __init__(self) -> None:
        self.first_chunk = Histogram(FIRST_CHUNK_BUCKETS)
        self.call_duration = Histogram(CALL_DURATION_BUCKETS)
        self._accepted: dict[str, float] = {}

    def accepted(self, call_id: str, now: float) -> None:
        self._accepted.setdefault(call_id, now)

    def attempt_ended(self, outcome: AttemptOutcome | None) -> None:
        if outcome is not None and outcome.diag.first_chunk_ms is not None:
            self.first_chunk.observe(outcome.diag.first_chunk_ms / 1000.0)

    def call_done(self, call_id: str, now: float) -> None:
        since = self._accepted.pop(call_id, None)
        if since is not None:
            self.call_duration.observe(max(0.0, now - since))

    def forget(self, call_id: str) -> None:
        self._accepted.pop(call_id, None)

    def to_map(self) -> dict[str, dict[str, Any]]:
        return {"attempt_first_chunk_seconds": self.first_chunk.to_map(),
                "call_duration_seconds": self.call_duration.to_map()}
