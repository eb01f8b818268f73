"""Calls and their attempts: the explicit state machine, why an attempt is
fenced, and the pure decision taken when an attempt ends.

    QUEUED ──START──► AUTHORIZING ──AUTHORIZED──► RUNNING ──(ended)──► decide
       ▲                                            │ stale / worker died /
       └──────BACKOFF_OVER── BACKOFF ◄──RETRY──┐    ▼ cancel / deadline
                                              FENCING ──(fenced)──► decide
    decide ──FINISH──► FINISHING ──FINISHED──► DONE

The sink is told "attempt N is the writer" before any worker gets attempt N
(AUTHORIZING), and an attempt that must stop is fenced at the sink before its
process is killed (FENCING): docs/ARCHITECTURE.md, "Invariants". `decide`
applies the rules of "Retries and error classes" and "Partial delivery".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from streamfence.config.groups import Deployment, ModelGroup
from streamfence.config.model import ProviderProfile
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal.control import AttemptStats, FinishMeta
from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome, ErrorClass
from streamfence.protocol.logs import request_model
from streamfence.protocol.messages import CallSpec, CallStatus, OnPartial
from streamfence.protocol.states import CallState, FenceReason
from streamfence.supervisor.timeouts import AttemptTimeouts


class CallEvent(Enum):
    START = "start"  # a worker is reserved; the sink is asked to authorize
    AUTHORIZED = "authorized"  # the sink's answer (then dispatched, or fenced at once)
    REFUSED = "refused"  # the sink refused or died: back to the queue
    FENCE = "fence"  # the attempt must stop
    RETRY = "retry"
    BACKOFF_OVER = "backoff_over"
    FINISH = "finish"  # the decision is sent to the sink
    FINISHED = "finished"  # the sink stored the done event


_TRANSITIONS: dict[CallState, dict[CallEvent, CallState]] = {
    CallState.QUEUED: {CallEvent.START: CallState.AUTHORIZING,
                       CallEvent.FINISH: CallState.FINISHING},
    CallState.AUTHORIZING: {CallEvent.AUTHORIZED: CallState.RUNNING,
                            CallEvent.FENCE: CallState.FENCING,
                            CallEvent.REFUSED: CallState.QUEUED},
    CallState.RUNNING: {CallEvent.FENCE: CallState.FENCING, CallEvent.RETRY: CallState.BACKOFF,
                        CallEvent.FINISH: CallState.FINISHING},
    CallState.FENCING: {CallEvent.RETRY: CallState.BACKOFF, CallEvent.FINISH: CallState.FINISHING},
    CallState.BACKOFF: {CallEvent.BACKOFF_OVER: CallState.QUEUED,
                        CallEvent.FINISH: CallState.FINISHING},
    CallState.FINISHING: {CallEvent.FINISHED: CallState.DONE},
    CallState.DONE: {},
}

# Calls with an attempt (or the done event) in flight at the sink.
BUSY_STATES = frozenset({CallState.AUTHORIZING, CallState.RUNNING, CallState.FENCING,
                         CallState.FINISHING})


class InvalidTransition(Exception):
    pass


MOVED = "moved"  # cluster mode: the journal's status of a call another host owns now


_FENCE_ERRORS: dict[FenceReason, tuple[str, str]] = {
    FenceReason.STALE: ("stream_stalled", "no chunk within the stale timeout ({stale_s:g}s)"),
    FenceReason.WORKER_DIED: ("worker_died", "the worker process died mid-attempt"),
    FenceReason.FINAL_REFUSED: ("final_refused", "the sink refused the attempt's final message"),
    FenceReason.CLUSTER_LOST: ("cluster_lost", "another host of the cluster owns the call now"),
    FenceReason.DEADLINE: ("deadline_exceeded", "the call's deadline passed"),
    FenceReason.SINK_RESTARTED: ("sink_restarted", "the sink restarted mid-attempt"),
    FenceReason.CANCELLED: ("cancelled", "cancelled by the client"),
}


def fence_error(reason: FenceReason, stale_s: float) -> AttemptError:
    """The (transient) error of an attempt the supervisor fenced."""
    code, message = _FENCE_ERRORS[reason]
    return AttemptError(ErrorClass.TRANSIENT, code, message.format(stale_s=stale_s))


@dataclass(slots=True)
class Call:
    """One accepted call, owned by the AttemptDriver (Front and recovery build it)."""

    call_id: str
    owner: str  # the identity that submitted it (docs/SECURITY.md)
    spec: CallSpec
    profile: ProviderProfile  # a group's call: its current (or next) deployment's
    timeouts: AttemptTimeouts
    max_attempts: int
    deadline: float | None  # monotonic seconds
    state: CallState = CallState.QUEUED
    epoch: int = 0  # the current (or last) attempt number
    content_from: int = 0  # the epoch whose authorize began the answer it writes (set
    # at every authorize; a rebind keeps it)
    attempts: int = 0  # attempts started in this call's life
    worker_id: int | None = None
    token: int = 0
    dispatched_ns: int = 0
    fence_reason: FenceReason | None = None
    ended: tuple[AttemptStats, AttemptOutcome] | None = None  # an accepted final, while fencing
    retry_at: float = 0.0
    cancel_requested: bool = False
    delivered: bool = False  # visible text of some attempt stands in the transcript
    notice: str | None = None  # the next attempt's first delta (a user-visible warning)
    finishing: Finish | None = None  # the decision being written by the sink
    probe_next: bool = False  # run the next attempt non-streaming, to learn a clear error
    traceback: str | None = None  # the last attempt's unexpected exception's (AttemptError)
    # The request's size, counted against the byte budgets while the call is
    # live (AttemptDriver): the Front sets it at submit; 0 means not measured
    # yet (a recovered call), and AttemptDriver.enqueue measures it then.
    request_bytes: int = 0
    # A large request's file (a stored submit frame: the worker reads it, so the
    # request is never encoded again here) and the fields the daemon set on it.
    request_file: str | None = None
    request_overrides: dict[str, Any] = field(default_factory=dict)
    # A group's call (spec.provider names the group): the group as accepted,
    # the profiles it was accepted with (a reload changes neither for it),
    # the current attempt's deployment and the indexes of those tried
    # (supervisor/deployments.py).
    group: ModelGroup | None = None
    profiles: dict[str, ProviderProfile] = field(default_factory=dict)
    deployment: Deployment | None = None
    tried: set[int] = field(default_factory=set)

    @property
    def model(self) -> str | None:
        """The model the current attempt asks for: its deployment's, else the request's."""
        if self.deployment is not None:
            return self.deployment.model
        return request_model(self.spec.request)

    def next_attempt(self, token: int, worker_id: int) -> None:
        """A worker is reserved for the call's next attempt (then START)."""
        self.epoch += 1
        self.attempts += 1
        self.token, self.worker_id = token, worker_id
        self.fence_reason, self.ended = None, None

    def to(self, event: CallEvent) -> None:
        nxt = _TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise InvalidTransition(f"call {self.call_id} in state {self.state.value} "
                                    f"got event {event.value!r}")
        self.state = nxt


@dataclass(frozen=True, slots=True)
class Retry:
    retry_after_s: float | None  # a provider's Retry-After, if it gave one


@dataclass(frozen=True, slots=True)
class Finish:
    status: CallStatus
    error: dict[str, Any] | None  # the public `done` error: {"code", "message"}
    meta: FinishMeta


def call_error(code: ErrorCode, message: str, provider: AttemptError | None = None
               ) -> dict[str, Any]:
    """A done's `error`; `provider`: the provider's error, whose HTTP status,
    type and code it carries when the provider gave them (the gateway answers
    with them: docs/PROTOCOL.md §6)."""
    error: dict[str, Any] = {"code": code.value, "message": message}
    if provider is not None:
        for key, value in (("provider_status", provider.status),
                           ("provider_type", provider.provider_type),
                           ("provider_code", provider.provider_code)):
            if value is not None:
                error[key] = value
    return error


def deadline_passed() -> Finish:
    """A queued call's end when its deadline passed before an attempt could start."""
    return Finish(CallStatus.FAILED, call_error(
        ErrorCode.DEADLINE_EXCEEDED, "the call's deadline passed before an attempt could start"),
        FinishMeta())


def meta_of(outcome: AttemptOutcome | None) -> FinishMeta:
    if outcome is None:
        return FinishMeta()
    return FinishMeta(outcome.finish_reason, outcome.usage, outcome.model,
                      outcome.provider_response_id, False, outcome.dropped_tool_names,
                      outcome.dropped_tool_indexes)


def decide(call: Call, stats: AttemptStats, outcome: AttemptOutcome | None,
           error: AttemptError | None, now: float) -> Retry | Finish:
    """What to do after attempt `call.epoch` ended.

    `stats` is the sink's view of the attempt (what it accepted), `outcome` the
    worker's, if the sink accepted its final; `error` the attempt's error (the
    outcome's, or the fence's) or None for a clean end.
    """
    meta = meta_of(outcome)
    if call.cancel_requested:
        return Finish(CallStatus.CANCELLED,
                      call_error(ErrorCode.CANCELLED, "cancelled by the client"), meta)
    if error is None:
        return Finish(CallStatus.COMPLETED, None, meta)
    visible = stats.visible_chars > 0
    restart = call.spec.options.on_partial is OnPartial.RESTART
    if error.error_class is ErrorClass.CONTEXT_OVERFLOW:
        return Finish(CallStatus.FAILED,
                      call_error(ErrorCode.CONTEXT_OVERFLOW, error.message, error), meta)
    if visible and not restart:
        # Retrying would duplicate text the caller already has: end partial,
        # finish_reason "length", so the caller can ask for a continuation.
        return Finish(CallStatus.PARTIAL, None, replace(meta, partial=True, finish_reason="length"))
    if error.error_class is not ErrorClass.TRANSIENT:
        code = (ErrorCode.CREDENTIALS_MISSING if error.code == "credentials_missing"
                else ErrorCode.PROVIDER_ERROR)
        return Finish(CallStatus.FAILED, call_error(code, error.message, error), meta)
    out_of_time = call.deadline is not None and now >= call.deadline
    if call.attempts >= call.max_attempts or out_of_time:
        code = (ErrorCode.DEADLINE_EXCEEDED if out_of_time
                else ErrorCode.STREAM_STALLED if error.code == "stream_stalled"
                else ErrorCode.RETRIES_EXHAUSTED)
        return Finish(CallStatus.FAILED, call_error(
            code, f"{call.attempts} attempt(s) failed; last: {error.described}"), meta)
    # Under on_partial="restart" the next attempt voids this one's text
    # (`call.delivered` makes its authorize a reset).
    return Retry(retry_after_s=error.retry_after_s)
