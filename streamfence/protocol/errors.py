"""Error codes of the public protocol and the one exception the decoder raises.

Every code is documented in docs/PROTOCOL.md; a client can rely on the code,
the message is for people.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    BAD_FRAME = "bad_frame"  # undecodable, trailing bytes, or not exactly one frame
    TOO_LARGE = "too_large"  # frame over the configured limit
    BAD_MESSAGE = "bad_message"  # not a map, or a field missing / of the wrong type
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    UNKNOWN_PROVIDER = "unknown_provider"
    UNKNOWN_CALL = "unknown_call"
    BREAKER_OPEN = "breaker_open"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    OVERLOADED = "overloaded"
    LIMIT_EXCEEDED = "limit_exceeded"  # a field over the submitter's cap (e.g. max_tokens)
    TOO_MANY_CALLS = "too_many_calls"  # the submitter's max_in_flight calls are not done yet
    RATE_LIMITED = "rate_limited"  # over the submitter's submits_per_s
    # The submitter has used up a token or spend budget (tokens_per_day, ...).
    BUDGET_EXCEEDED = "budget_exceeded"
    # A subscribe past the subscriber's max_listeners or max_subscriptions.
    TOO_MANY_SUBSCRIPTIONS = "too_many_subscriptions"
    # On the events socket: the key this connection was made with was revoked
    # or rotated; nothing more is sent on it.
    KEY_REVOKED = "key_revoked"
    CANCELLED = "cancelled"
    SHUTTING_DOWN = "shutting_down"
    # The daemon could not store the request: not accepted. Full: its disk is
    # full; busy: another process holds a lock on its journal; error: an I/O
    # error (or a large request's file could not be written).
    STORAGE_ERROR = "storage_error"
    STORAGE_FULL = "storage_full"
    STORAGE_BUSY = "storage_busy"
    # Cluster mode: the NATS cluster did not store the call at its replication in time.
    CLUSTER_UNAVAILABLE = "cluster_unavailable"
    # Cluster mode: the host running the call was asked to cancel it and did not
    # answer in time; it may still act on the cancel (docs/PROTOCOL.md §7).
    CANCEL_UNKNOWN = "cancel_unknown"
    # The connection's earlier replies are not read yet (more than the daemon
    # queues to one connection, or to all): this reply was not queued.
    REPLY_BACKLOG = "reply_backlog"
    # Outcomes of a call, carried in the `error` of a `done` event.
    PROVIDER_ERROR = "provider_error"  # the provider answered with a non-retryable error
    CREDENTIALS_MISSING = "credentials_missing"  # the profile's api_key_env is not set
    RETRIES_EXHAUSTED = "retries_exhausted"  # every attempt failed transiently
    STREAM_STALLED = "stream_stalled"  # the last attempt went silent past its stale timeout
    CONTEXT_OVERFLOW = "context_overflow"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message from outside that cannot be accepted. `code` goes on the wire."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
