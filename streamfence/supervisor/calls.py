"""Calls and their attempts: the explicit state machine, and the pure
decision taken when an attempt ends.

    QUEUED ──start──► AUTHORIZING ──authorized──► RUNNING ──ended──► (decide)
       ▲                                            │ stale / worker died /
       └──────backoff over── BACKOFF ◄──retry──┐    ▼ cancel / deadline
                                              FENCING ──fenced──► (decide)
    (decide) ──finish──► FINISHING ──finished──► DONE

The sink is told "attempt N is the writer" before any worker gets attempt N
(AUTHORIZING), and an attempt that must stop is fenced at the sink before its
process is killed (FENCING). `decide` applies the delivery rules of SPEC §3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.messages import CallSpec, CallStatus, OnPartial
from streamfence.supervisor.config import ProviderProfile
from streamfence.supervisor.timeouts import AttemptTimeouts


class CallState(Enum):
    QUEUED = "queued"
    AUTHORIZING = "authorizing"
    RUNNING = "running"
    FENCING = "fencing"
    BACKOFF = "backoff"
    FINISHING = "finishing"
    DONE = "done"


_TRANSITIONS: dict[CallState, dict[str, CallState]] = {
    CallState.QUEUED: {"start": CallState.AUTHORIZING, "finish": CallState.FINISHING},
    CallState.AUTHORIZING: {"authorized": CallState.RUNNING, "fence": CallState.FENCING,
                            "refused": CallState.QUEUED},
    CallState.RUNNING: {"fence": CallState.FENCING, "retry": CallState.BACKOFF,
                        "finish": CallState.FINISHING},
    CallState.FENCING: {"retry": CallState.BACKOFF, "finish": CallState.FINISHING},
    CallState.BACKOFF: {"backoff_over": CallState.QUEUED, "finish": CallState.FINISHING},
    CallState.FINISHING: {"finished": CallState.DONE},
    CallState.DONE: {},
}


class InvalidTransition(Exception):
    pass


@dataclass(slots=True)
class Call:
    call_id: str
    spec: CallSpec
    profile: ProviderProfile
    timeouts: AttemptTimeouts
    max_attempts: int
    deadline: float | None  # monotonic seconds
    state: CallState = CallState.QUEUED
    epoch: int = 0  # the current (or last) attempt number
    attempts: int = 0  # attempts started in this call's life
    worker_id: int | None = None
    token: int = 0
    dispatched_ns: int = 0
    fence_reason: str | None = None
    ended: tuple[dict[str, Any], dict[str, Any]] | None = None  # (stats, final) from the sink
    retry_at: float = 0.0
    cancel_requested: bool = False
    delivered: bool = False  # visible text of some attempt stands in the transcript
    last_error: dict[str, Any] | None = None
    notice: str | None = None  # the next attempt's first delta (a user-visible warning)
    finishing: Finish | None = None  # the decision being written by the sink
    probe_next: bool = False  # run the next attempt non-streaming, to learn a clear error
    waiters: list[tuple[bytes, str, float]] = field(default_factory=list)

    def to(self, event: str) -> None:
        nxt = _TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise InvalidTransition(f"call {self.call_id} in state {self.state.value} "
                                    f"got event {event!r}")
        self.state = nxt


@dataclass(frozen=True, slots=True)
class Retry:
    retry_after_s: float | None
    reset: bool  # the next attempt must void what this one delivered


@dataclass(frozen=True, slots=True)
class Finish:
    status: CallStatus
    error: dict[str, Any] | None
    meta: dict[str, Any]


def _meta(final: dict[str, Any] | None) -> dict[str, Any]:
    final = final or {}
    return {"finish_reason": final.get("finish_reason"), "usage": final.get("usage"),
            "model": final.get("model"),
            "provider_response_id": final.get("provider_response_id"),
            "dropped_tool_names": list(final.get("dropped_tool_names") or []),
            "dropped_tool_indexes": list(final.get("dropped_tool_indexes") or []),
            "partial": False}


def _error(code: ErrorCode | str, message: str) -> dict[str, Any]:
    return {"code": str(code), "message": message}


def decide(call: Call, stats: dict[str, Any], final: dict[str, Any] | None,
           error: dict[str, Any] | None, now: float) -> Retry | Finish:
    """What to do after attempt `call.epoch` ended, by the delivery rules.

    `stats` is the sink's view of the attempt (what it accepted), `final` the
    worker's final message if the sink accepted one, `error` the attempt's
    error (class/code/message) or None for a clean end.
    """
    meta = _meta(final)
    if call.cancel_requested:
        return Finish(CallStatus.CANCELLED, _error(ErrorCode.CANCELLED, "cancelled by the client"),
                      meta)
    if error is None:
        return Finish(CallStatus.COMPLETED, None, meta)
    visible = int(stats.get("visible_chars", 0)) > 0
    restart = call.spec.options.on_partial is OnPartial.RESTART
    if error.get("class") == "context_overflow":
        return Finish(CallStatus.FAILED, _error(ErrorCode.CONTEXT_OVERFLOW, error["message"]),
                      meta)
    if visible and not restart:
        # Retrying would duplicate text the caller already has: end partial,
        # finish_reason "length", so the caller can ask for a continuation.
        meta.update(partial=True, finish_reason="length")
        return Finish(CallStatus.PARTIAL, None, meta)
    if error.get("class") != "transient":
        return Finish(CallStatus.FAILED, _error(ErrorCode.PROVIDER_ERROR, error["message"]), meta)
    out_of_time = call.deadline is not None and now >= call.deadline
    if call.attempts >= call.max_attempts or out_of_time:
        code = (ErrorCode.DEADLINE_EXCEEDED if out_of_time
                else ErrorCode.STREAM_STALLED if error.get("code") == "stream_stalled"
                else ErrorCode.RETRIES_EXHAUSTED)
        return Finish(CallStatus.FAILED,
                      _error(code, f"{call.attempts} attempt(s) failed; last: {error['message']}"),
                      meta)
    return Retry(retry_after_s=error.get("retry_after_s"), reset=visible and restart)
