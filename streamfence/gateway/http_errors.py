"""streamfence error codes (docs/PROTOCOL.md §7) as the providers' own HTTP errors.

Contract:
- `openai_error(code, message, provider=None) -> (status, body)`: OpenAI's
  body, `{"error": {"message", "type", "param": null, "code"}}`. `code` is
  OpenAI's own code where one means the same (`context_length_exceeded`,
  `rate_limit_exceeded`, `model_not_found`, `invalid_api_key`), else the
  streamfence code, so `exc.code` tells an app what happened.
- `anthropic_error(code, message, provider=None) -> (status, body)`:
  Anthropic's body, `{"type": "error", "error": {"type", "message"}}`.
- Both bodies are also the in-stream error: OpenAI's SDK raises `APIError` on
  a `data:` chunk holding `error`, Anthropic's raises `APIStatusError` on an
  `event: error` frame (the renderers send them, gateway/openai_chat.py and
  gateway/anthropic_messages.py).
- `provider`: the provider's own error (`ProviderError`: its HTTP status,
  type and code, as a `provider_error` or `context_overflow` done carries
  them, PROTOCOL §6), passed through for those two codes only: the status
  (one outside 400..599 is ignored; without one a provider error is a 400),
  and, when the provider sent a type or code, its type and code in place of
  the table's (OpenAI's `error.code`, null if it gave none; Anthropic's
  `error.details.error_code`). The message is the provider's, once: an SDK
  pointed at the gateway shows what it shows pointed at the provider.
- `done_error(done)`: a failed or cancelled done's (code, message, provider).

`ERRORS` below is the table, the one place the statuses are decided. The
status picks the exception class the SDK raises: openai 3.57 maps 400
BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404
NotFoundError, 409 ConflictError, 422 UnprocessableEntityError, 429
RateLimitError, >= 500 InternalServerError, any other APIStatusError;
anthropic 2.15 has the same and also 413 ContentTooLargeError, 499
ClientClosedRequestError, 503 ServiceUnavailableError, 504 GatewayTimeoutError
and 529 OverloadedError (the last three subclasses of InternalServerError).
Both SDKs retry 408, 409, 429 and >= 500 by default (`max_retries`), unless
the response has the header `x-should-retry: false`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

PASSED_THROUGH = frozenset({"provider_error", "context_overflow"})  # the provider's own errors
# Answered with `x-should-retry: false`: the SDK's retries would meet the same
# answer until a UTC day or month ends.
NOT_RETRIED = frozenset({"budget_exceeded"})


@dataclass(frozen=True, slots=True)
class Row:
    """One code's answer on each wire."""

    status: int  # the HTTP status on the OpenAI endpoint
    anthropic_status: int  # on the Anthropic endpoint (they differ for overloaded only)
    openai_type: str
    anthropic_type: str
    openai_code: str | None = None  # None: the streamfence code itself


_BAD = Row(400, 400, "invalid_request_error", "invalid_request_error")
_UNAVAILABLE = Row(503, 503, "server_error", "overloaded_error")  # "retry later"
_UPSTREAM = Row(502, 502, "server_error", "api_error")  # the provider failed us

#  code                  HTTP  openai SDK            anthropic SDK
ERRORS: dict[str, Row] = {
    "bad_message": _BAD,  # 400  BadRequestError       BadRequestError
    "limit_exceeded": _BAD,
    "bad_frame": _BAD,
    "unsupported_version": _BAD,
    "unknown_op": _BAD,
    "context_overflow": Row(400, 400, "invalid_request_error", "invalid_request_error",
                            "context_length_exceeded"),
    # 401  AuthenticationError   AuthenticationError. credentials_missing: the daemon's
    # profile has no provider key, what a provider says of a missing key.
    "unauthenticated": Row(401, 401, "invalid_request_error", "authentication_error",
                           "invalid_api_key"),
    "credentials_missing": Row(401, 401, "invalid_request_error", "authentication_error"),
    # the gateway's own key was revoked or rotated under an events connection
    "key_revoked": Row(401, 401, "invalid_request_error", "authentication_error",
                       "invalid_api_key"),
    # 404  NotFoundError         NotFoundError (no profile or model by that name)
    "unknown_provider": Row(404, 404, "invalid_request_error", "not_found_error",
                            "model_not_found"),
    "unknown_call": Row(404, 404, "invalid_request_error", "not_found_error"),
    # 413  APIStatusError        ContentTooLargeError
    "too_large": Row(413, 413, "invalid_request_error", "request_too_large"),
    # 429  RateLimitError        RateLimitError
    "rate_limited": Row(429, 429, "requests", "rate_limit_error", "rate_limit_exceeded"),
    "too_many_calls": Row(429, 429, "requests", "rate_limit_error"),
    "too_many_subscriptions": Row(429, 429, "requests", "rate_limit_error"),
    # a token or spend budget used up (until its UTC day or month ends): OpenAI's
    # own code for a quota, so `exc.code` says it is not a rate to wait out
    "budget_exceeded": Row(429, 429, "insufficient_quota", "rate_limit_error",
                           "budget_exceeded"),
    # 499 (nginx's "client closed request": someone cancelled the call)
    #      APIStatusError        ClientClosedRequestError; neither SDK retries it
    "cancelled": Row(499, 499, "invalid_request_error", "api_error"),
    # 503 / 529  InternalServerError   OverloadedError (529)
    "overloaded": Row(503, 529, "server_error", "overloaded_error"),
    # 503  InternalServerError   ServiceUnavailableError
    "breaker_open": _UNAVAILABLE,
    "shutting_down": _UNAVAILABLE,
    "storage_full": _UNAVAILABLE,
    "storage_busy": _UNAVAILABLE,
    "cluster_unavailable": _UNAVAILABLE,
    "storage_error": _UNAVAILABLE,
    "reply_backlog": _UNAVAILABLE,  # the gateway's own replies wait unread: later
    # 502  InternalServerError   InternalServerError: every attempt failed transiently.
    # answer_restarted is the gateway's own: a `reset` (or a second attempt after
    # text) mid-stream, which the wires cannot express; only ever an in-stream error.
    "stream_stalled": _UPSTREAM,
    "retries_exhausted": _UPSTREAM,
    "answer_restarted": _UPSTREAM,
    # 504  InternalServerError   GatewayTimeoutError
    "deadline_exceeded": Row(504, 504, "server_error", "timeout_error"),
    # Never answered over HTTP: the gateway cancels only a call whose client went
    # away, and reads no answer. Here because a host did not answer in time.
    "cancel_unknown": Row(504, 504, "server_error", "timeout_error"),
    # 500  InternalServerError   InternalServerError (also any code not listed here)
    "internal": Row(500, 500, "server_error", "api_error"),
    # provider_error: the provider's own status (`http_status`), else 400; the types
    # follow the status (_by_status).
}
INTERNAL = ERRORS["internal"]

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    402: "billing_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


@dataclass(frozen=True, slots=True)
class ProviderError:
    """The provider's own error as a done carries it: each None if it gave none."""

    status: int | None = None
    type: str | None = None
    code: str | None = None

    @property
    def given(self) -> bool:
        """The provider sent an error object of its own (a type or a code)."""
        return self.type is not None or self.code is not None


def _by_status(status: int) -> Row:
    """The row of a provider's own error status."""
    openai_type = ("server_error" if status >= 500 else "requests" if status == 429
                   else "invalid_request_error")
    anthropic_type = _ANTHROPIC_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    return Row(status, status, openai_type, anthropic_type)


def row_of(code: str, http_status: int | None = None) -> Row:
    """The table's row for `code` (a provider's own error: by its status)."""
    status = http_status if isinstance(http_status, int) and 400 <= http_status <= 599 \
        else None
    if code == "provider_error":
        return _by_status(status or 400)
    row = ERRORS.get(code, INTERNAL)
    if code in PASSED_THROUGH and status is not None:
        return replace(row, status=status, anthropic_status=status)
    return row


def _provider(code: str, provider: ProviderError | None) -> ProviderError:
    return provider if provider is not None and code in PASSED_THROUGH else ProviderError()


def openai_error(code: str, message: str, provider: ProviderError | None = None
                 ) -> tuple[int, dict[str, Any]]:
    """OpenAI's HTTP status and error body for a streamfence error code."""
    given = _provider(code, provider)
    row = row_of(code, given.status)
    if given.given:
        return row.status, {"error": {"message": message,
                                      "type": given.type or row.openai_type,
                                      "param": None, "code": given.code}}
    return row.status, {"error": {"message": message, "type": row.openai_type, "param": None,
                                  "code": row.openai_code or code}}


def anthropic_error(code: str, message: str, provider: ProviderError | None = None
                    ) -> tuple[int, dict[str, Any]]:
    """Anthropic's HTTP status and error body for a streamfence error code."""
    given = _provider(code, provider)
    row = row_of(code, given.status)
    error: dict[str, Any] = {"type": given.type or row.anthropic_type, "message": message}
    if given.code is not None:
        error["details"] = {"error_code": given.code}
    return row.anthropic_status, {"type": "error", "error": error}


def done_error(done: dict[str, Any]) -> tuple[str, str, ProviderError | None]:
    """(code, message, provider) of a failed or cancelled done: `provider` is
    the provider's own error, which a `provider_error` or `context_overflow`
    carries (`provider_status`, `provider_type`, `provider_code`)."""
    error = done.get("error") or {}
    status = str(done.get("status"))
    code = str(error.get("code") or ("cancelled" if status == "cancelled" else "internal"))
    message = str(error.get("message") or f"the call ended {status}")
    http_status, etype, ecode = (error.get(f"provider_{k}") for k in ("status", "type", "code"))
    provider = ProviderError(http_status if isinstance(http_status, int) else None,
                             etype if isinstance(etype, str) else None,
                             ecode if isinstance(ecode, str) else None)
    return code, message, provider if provider != ProviderError() else None
