"""The attempt outcome: how one attempt ended, as its worker saw it, and its
wire form (T_FINAL worker -> sink, E_ENDED sink -> supervisor)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# ---- the attempt outcome (worker -> sink -> supervisor) ---------------------


class ErrorClass(StrEnum):
    """How the supervisor treats a failed attempt."""

    TRANSIENT = "transient"  # retry with backoff
    FINAL = "final"  # no retry: the call fails
    CONTEXT_OVERFLOW = "context_overflow"  # no retry, the call fails with empty content


@dataclass(frozen=True, slots=True)
class AttemptError:
    """Why an attempt failed, already scrubbed of secrets (workers.errors builds it).

    `traceback`: only for an exception the worker did not expect (one that
    `workers.errors.classify` does not recognise), where it was raised
    (`workers.errors.traceback_text`: frames and exception types, no
    exception text), for the one log line of the call's final failure
    (ARCHITECTURE §4.9). It goes to the log only: never to a client or the
    journal.

    `message`, `provider_type`, `provider_code`: what the provider's error
    said, as its SDK shows them (`message` once, without the SDK's "Error
    code: 400 - " prefix); the type and code are None where the provider
    gave none (a timeout, our own stream checks): the gateway answers with
    them as the provider would (gateway/http_errors.py)."""

    error_class: ErrorClass
    code: str
    message: str
    status: int | None = None
    retry_after_s: float | None = None
    traceback: str | None = None
    provider_type: str | None = None
    provider_code: str | None = None

    @property
    def described(self) -> str:
        """The message with the provider's HTTP status, worded as the SDKs
        word it (an in-stream error, with no status: with its type), for the
        log and a retries_exhausted message."""
        if self.status is not None and self.status >= 400:
            return f"Error code: {self.status} - {self.message}"
        if self.provider_type and self.provider_type not in self.message:
            return f"{self.provider_type}: {self.message}"
        return self.message


@dataclass(frozen=True, slots=True)
class AttemptDiag:
    """What the worker measured of its attempt (reported in `result`'s diagnostics)."""

    first_chunk_ms: float | None = None
    chunks: int = 0
    bytes: int = 0
    deltas: int = 0
    duration_ms: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """How one attempt ended, as its worker saw it: built once by the adapter
    (or from the exception that ended it), sent to the sink in T_FINAL and
    forwarded to the supervisor in E_ENDED.

    `stream_options_rejected` / `streaming_denied`: the provider refused
    `stream_options` / the streaming action, so the supervisor remembers the
    fall-back for the profile."""

    ok: bool
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    provider_response_id: str | None = None
    dropped_tool_names: tuple[str, ...] = ()
    dropped_tool_indexes: tuple[int, ...] = ()
    error: AttemptError | None = None
    diag: AttemptDiag = AttemptDiag()
    stream_options_rejected: bool = False
    streaming_denied: bool = False



# ---- the attempt outcome on the wire (T_FINAL, E_ENDED) ---------------------


def outcome_to_wire(o: AttemptOutcome) -> list[Any]:
    """The msgpack-ready form of `o` (a positional array, in field order)."""
    e, d = o.error, o.diag
    return [o.ok, o.finish_reason, o.usage, o.model, o.provider_response_id,
            list(o.dropped_tool_names), list(o.dropped_tool_indexes),
            None if e is None else [e.error_class.value, e.code, e.message, e.status,
                                    e.retry_after_s, e.traceback, e.provider_type,
                                    e.provider_code],
            [d.first_chunk_ms, d.chunks, d.bytes, d.deltas, d.duration_ms],
            o.stream_options_rejected, o.streaming_denied]


class BadOutcome(ValueError):
    """A T_FINAL outcome that does not have the shape of `outcome_to_wire`."""


def _error_from_wire(error_class: Any, code: Any, message: Any, status: Any,
                     retry_after_s: Any, traceback: Any, provider_type: Any,
                     provider_code: Any) -> AttemptError:
    return AttemptError(ErrorClass(error_class), str(code), str(message), status,
                        retry_after_s, traceback, provider_type, provider_code)


def outcome_from_wire(raw: Any) -> AttemptOutcome:
    """Parse `outcome_to_wire`'s form. It crosses a process boundary (a worker runs
    provider code), so a bad shape raises BadOutcome, never anything else."""
    try:
        (ok, finish, usage, model, response_id, names, indexes, err, diag,
         so_rejected, denied) = raw
        error = None if err is None else _error_from_wire(*err)
        outcome = AttemptOutcome(
            bool(ok), finish, usage, model, response_id, tuple(str(n) for n in names),
            tuple(int(i) for i in indexes), error, AttemptDiag(*diag), bool(so_rejected),
            bool(denied))
    except (TypeError, ValueError, IndexError) as exc:
        raise BadOutcome(f"malformed attempt outcome: {exc}") from None
    if not (finish is None or isinstance(finish, str)) or not (
            usage is None or isinstance(usage, dict)):
        raise BadOutcome("malformed attempt outcome: finish_reason or usage")
    if error is not None and not all(v is None or isinstance(v, str) for v in (
            error.traceback, error.provider_type, error.provider_code)):
        raise BadOutcome("malformed attempt outcome: error traceback, type or code")
    return outcome
