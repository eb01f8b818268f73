"""Turn any exception an attempt can die of into an `AttemptError`.

Contract: `classify(exc)` never raises and returns an `AttemptError`
(protocol/internal/outcome.py). The supervisor decides retries from its `error_class`
alone and reads `code` for the special cases it handles
(`stream_options_rejected`, `streaming_unsupported`, `empty_sse_frames`, ...).
`message` is scrubbed of anything that looks like a credential and truncated,
because it reaches logs, the journal and clients; `attempt_error` is the one
place that builds an AttemptError, so the one place that scrubs.

A provider's error is passed on once, as its SDK shows it: `message` is the
body's `error.message` (not the SDK's str(), which prefixes "Error code: 400
- " and, in anthropic's, the whole body's repr), and `provider_type` /
`provider_code` its `error.type` and `error.code` (anthropic's
`error.details.error_code`; Bedrock's error code is its type), so the
gateway can answer with the provider's own body (gateway/http_errors.py).
Reading a provider's text, body and headers is workers/error_text.py's.

Rules (docs/ARCHITECTURE.md §4.3):
- transient: timeouts; connection drops (httpx2 connect/read/protocol errors
  raised raw while a body is read, the SDKs' APIConnectionError/APITimeoutError,
  botocore connection/read-timeout errors); SSE error texts such as "connection
  lost"; malformed stream data; empty streams; HTTP 408/409/429/5xx.
- context_overflow: a 400/422 (or an in-stream error) whose text says the
  prompt does not fit the context window.
- final: every other 4xx, and anything we do not recognise (a bug must not
  turn into a retry loop).
The SDKs (openai, anthropic, botocore, urllib3, anyio) are looked up in
sys.modules, never imported: an instance of their exception implies the module
is already loaded, and a worker imports only the SDKs of its profiles' kinds
(workers/registry.py).
"""

from __future__ import annotations

import json
import re
import ssl
import sys
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import httpx2

from streamfence.protocol.internal.outcome import AttemptError, ErrorClass
from streamfence.workers.error_text import (
    error_object,
    has_connection_phrase,
    is_context_overflow_text,
    names_stream_options,
    provider_type_and_code,
    rejects_streaming,
    retry_after_from_headers,
    status_from_value,
    status_message,
)

MESSAGE_LIMIT = 2000
TRACEBACK_LIMIT = 16_000  # characters of a traceback kept for the log (its end)

# The codes of an exception `classify` does not recognise: a bug or a case no
# rule knows yet, the only failures whose traceback reaches the log (ARCHITECTURE §4.9).
UNEXPECTED_CODES = frozenset({"unexpected_error", "unclassified"})


class StreamFailure(Exception):
    """A failure detected by our own stream decoding; carries its class and code."""

    error_class = ErrorClass.TRANSIENT
    code = "stream_failure"


class MalformedStreamError(StreamFailure):
    """An SSE data payload that is not a JSON object of the expected shape."""

    code = "malformed_stream"


# ---- scrubbing -------------------------------------------------------------

_SCRUBBERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=\-]{4,}"), r"\1 [redacted]"),
    (re.compile(r"(?i)\b(proxy-authorization|authorization|x-api-key|api-key|x-goog-api-key)"
                r"([\"']?\s*[:=]\s*[\"']?)(?!\[redacted)[^\s\"',;}]+"), r"\1\2[redacted]"),
    (re.compile(r"(?i)\b(api[_-]?key|access[_-]?token|secret[_-]?access[_-]?key|password|"
                r"client[_-]?secret|session[_-]?token)([\"']?\s*[:=]\s*[\"']?)[^\s\"',&;}]{4,}"),
     r"\1\2[redacted]"),
    (re.compile(r"(?i)([?&](?:key|api_key|apikey|token|access_token|sig)=)[^&\s\"']+"), r"\1[redacted]"),
    (re.compile(r"\b(?:sk|rk|pk)-[A-Za-z0-9_\-*.]{6,}"), "[redacted-key]"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "[redacted-aws-key]"),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), "[redacted-key]"),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|xox[abprs]-[A-Za-z0-9\-]{10,})"), "[redacted-key]"),
    (re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{4,}"), "[redacted-jwt]"),
)


def scrub(text: str, extra_secrets: Iterable[str] = ()) -> str:
    """Remove credentials from `text` and cap its length."""
    for secret in extra_secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "[redacted]")
    for pattern, repl in _SCRUBBERS:
        text = pattern.sub(repl, text)
    if len(text) > MESSAGE_LIMIT:
        text = text[:MESSAGE_LIMIT] + "…"
    return text


def attempt_error(error_class: ErrorClass, code: str, message: str, status: int | None = None,
                  retry_after_s: float | None = None, extra_secrets: Iterable[str] = (), *,
                  provider_type: str | None = None, provider_code: str | None = None
                  ) -> AttemptError:
    """Build an AttemptError; the single place messages get scrubbed."""
    extra = tuple(extra_secrets)
    return AttemptError(error_class, code, scrub(message, extra), status, retry_after_s,
                        provider_type=_scrubbed(provider_type, extra),
                        provider_code=_scrubbed(provider_code, extra))


def _scrubbed(value: str | None, extra_secrets: tuple[str, ...]) -> str | None:
    return None if value is None else scrub(value, extra_secrets)[:200]


_CAUSE = "The above exception was the direct cause of the following exception"
_CONTEXT = "During handling of the above exception, another exception occurred"


def traceback_text(exc: BaseException) -> str:
    """Where `exc` (and each exception chained to it) was raised: the frames,
    with their source lines, and the exception types, but no exception text.
    Why no text: an exception's text may quote the request or a credential
    (botocore's ParamValidationError quotes the offending value), while the
    frames are only code; what the exception said is the AttemptError's
    message, scrubbed in one place (`attempt_error`). Bounded: a longer
    text keeps its last TRACEBACK_LIMIT characters (the frames nearest the
    raise, the exception that ended the attempt). No locals."""
    chain: list[tuple[BaseException, str]] = []  # outermost first, each with its link to
    # the one before it
    seen: set[int] = set()
    current: BaseException | None = exc
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, _CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, _CONTEXT
        else:
            current = None
    parts: list[str] = []
    for i, (item, _) in enumerate(reversed(chain)):
        if i:
            parts.append(f"\n{chain[len(chain) - i][1]}:\n\n")
        frames = traceback.extract_tb(item.__traceback__)
        parts.append("Traceback (most recent call last):\n")
        parts.extend(traceback.format_list(frames))
        kind = type(item)
        module = "" if kind.__module__ == "builtins" else kind.__module__ + "."
        parts.append(f"{module}{kind.__qualname__} (its text is left out)\n")
    text = "".join(parts).rstrip("\n")
    if len(text) > TRACEBACK_LIMIT:
        text = f"… ({len(text) - TRACEBACK_LIMIT} characters cut)\n" + text[-TRACEBACK_LIMIT:]
    return text


# ---- classification ----------------------------------------------------------

# Provider error types/codes that say "try again" rather than "your request is wrong".
_TRANSIENT_TYPES = ("server_error", "internal", "overloaded", "unavailable", "rate_limit",
                    "timeout", "api_error", "throttl", "too_many_requests", "capacity",
                    "modelstreamerror", "modelnotready", "bad_gateway", "gateway")

_STATUS_CODES = {400: "bad_request", 401: "auth_failed", 403: "permission_denied",
                 404: "not_found", 408: "request_timeout", 409: "conflict",
                 413: "payload_too_large", 422: "unprocessable", 429: "rate_limited",
                 503: "unavailable", 529: "overloaded"}


def classify_status(status: int, text: str, *, message: str | None = None,
                    retry_after_s: float | None = None, provider_type: str | None = None,
                    provider_code: str | None = None, extra_secrets: Iterable[str] = ()
                    ) -> AttemptError:
    """An HTTP status with the provider's error: `text` is what the rules read
    (the SDK's whole str()), `message` what the error says (default `text`),
    and its error type and code, if known."""
    def make(cls: ErrorClass, code: str) -> AttemptError:
        return attempt_error(cls, code, text if message is None else message, status,
                             retry_after_s, extra_secrets, provider_type=provider_type,
                             provider_code=provider_code)

    low_type = f"{provider_type or ''} {provider_code or ''}".lower()
    if status in (400, 413, 422) and is_context_overflow_text(text + " " + low_type):
        return make(ErrorClass.CONTEXT_OVERFLOW, "context_overflow")
    if names_stream_options(status, text):
        return make(ErrorClass.FINAL, "stream_options_rejected")
    if rejects_streaming(status, text):
        return make(ErrorClass.FINAL, "streaming_unsupported")
    if status == 429 and ("insufficient_quota" in text + low_type or "billing" in text.lower()):
        # OpenAI's quota exhaustion is a 429 that no retry can fix.
        return make(ErrorClass.FINAL, "quota_exhausted")
    if status in (408, 409, 425, 429) or status >= 500:
        return make(ErrorClass.TRANSIENT, _STATUS_CODES.get(status, "server_error" if status >= 500 else f"http_{status}"))
    return make(ErrorClass.FINAL, _STATUS_CODES.get(status, f"http_{status}"))


def classify_payload(payload: Any, *, status: int | None = None, text: str | None = None,
                     extra_secrets: Iterable[str] = ()) -> AttemptError:
    """A provider error object (in-stream `{"error": {...}}`, an error event, a body)."""
    err = error_object(payload)
    ptype, pcode = provider_type_and_code(err)
    etype = " ".join(v for v in (ptype, pcode) if v)
    message = str(err.get("message") or err.get("error_message") or text or str(payload))
    if status is None:
        for cand in (payload.get("status_code") if isinstance(payload, Mapping) else None,
                     err.get("status_code"), err.get("status"), err.get("http_status"), err.get("code")):
            status = status_from_value(cand)
            if status is not None:
                break
    if status is not None and status >= 400:
        return classify_status(status, message, provider_type=ptype, provider_code=pcode,
                               extra_secrets=extra_secrets)
    low = (etype + " " + message).lower()
    if is_context_overflow_text(low):
        error_class, code = ErrorClass.CONTEXT_OVERFLOW, "context_overflow"
    elif any(t in etype.lower() for t in _TRANSIENT_TYPES) or has_connection_phrase(message):
        error_class, code = ErrorClass.TRANSIENT, "provider_error"
    else:
        error_class, code = ErrorClass.FINAL, "provider_error"
    return attempt_error(error_class, code, message, status, None, extra_secrets,
                         provider_type=ptype, provider_code=pcode)


def classify_error_text(text: str) -> AttemptError:
    """Error text streamed as content with finish_reason "error": SSE fields or JSON."""
    status, data = None, []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if name == "data" and sep:
            data.append(value.strip())
        elif sep and name in ("", "status", "status_code", "http_status") and status is None:
            status = status_from_value(value)
    for candidate in ("\n".join(data), text):
        try:
            payload = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(payload, dict):
            return classify_payload(payload, status=status)
    message = text.strip() or "the provider ended the stream with finish_reason 'error'"
    return classify_payload({"error": {"message": message}}, status=status)


def _mod(name: str) -> Any:
    return sys.modules.get(name)


def _types(module: str, *names: str) -> tuple[type[BaseException], ...]:
    mod = _mod(module)
    if mod is None:
        return ()
    return tuple(t for t in (getattr(mod, n, None) for n in names) if isinstance(t, type))


def _describe(exc: BaseException) -> str:
    """`Type: message`, plus the cause the SDKs hide behind "Connection error."."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and isinstance(exc, _sdk_types("APIConnectionError")):
        text += f" ({type(cause).__name__}: {cause})"
    return text


def _sdk_types(name: str) -> tuple[type[BaseException], ...]:
    """The exception type `name` of the openai and anthropic SDKs loaded."""
    return _types("openai", name) + _types("anthropic", name)


def _transport_code(exc: BaseException) -> str | None:
    """Code for a timeout or connection error of any transport we use, else None."""
    if isinstance(exc, httpx2.ConnectTimeout | httpx2.PoolTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx2.ReadTimeout | TimeoutError):
        return "read_timeout"
    if isinstance(exc, httpx2.TimeoutException):
        return "timeout"
    if isinstance(exc, _sdk_types("APITimeoutError")):
        return "timeout"
    if isinstance(exc, _types("botocore.exceptions", "ReadTimeoutError", "ConnectTimeoutError")
                  + _types("urllib3.exceptions", "TimeoutError")):
        return "read_timeout" if "Read" in type(exc).__name__ else "connect_timeout"
    if isinstance(exc, _sdk_types("APIConnectionError")):
        cause = exc.__cause__ or exc.__context__
        return "connect_error" if isinstance(cause, httpx2.ConnectError) else "connection_error"
    if isinstance(exc, httpx2.ConnectError | ConnectionRefusedError):
        return "connect_error"
    if isinstance(exc, httpx2.NetworkError | httpx2.RemoteProtocolError | httpx2.ProxyError
                  | httpx2.DecodingError | ConnectionError | ssl.SSLError | EOFError):
        return "connection_error"
    if isinstance(exc, _types("anyio", "EndOfStream", "BrokenResourceError", "ClosedResourceError")
                  + _types("botocore.exceptions", "ConnectionError", "HTTPClientError", "IncompleteReadError")
                  + _types("urllib3.exceptions", "ProtocolError", "NewConnectionError")
                  + _types("http.client", "IncompleteRead")):
        return "connection_error"
    return None


def _classify_botocore(exc: BaseException, extra: Iterable[str]) -> AttemptError:
    response = getattr(exc, "response", None)
    response = response if isinstance(response, Mapping) else {}
    err = response.get("Error") or {}
    code = str(err.get("Code") or "")
    message = str(err.get("Message") or exc)
    text = f"{code}: {message}"  # what the rules read; Bedrock's type is its error code
    meta = response.get("ResponseMetadata") or {}
    status = status_from_value(meta.get("HTTPStatusCode"))
    headers = meta.get("HTTPHeaders")
    low = code.lower()
    if "accessdenied" in low and ("stream" in text.lower()):
        return attempt_error(ErrorClass.FINAL, "streaming_unsupported", message, status, None,
                             extra, provider_type=code or None)
    if status is not None and status >= 400 and not any(t in low for t in _TRANSIENT_TYPES):
        return classify_status(status, text, message=message, provider_type=code or None,
                               retry_after_s=retry_after_from_headers(headers), extra_secrets=extra)
    result = classify_payload({"error": {"type": code, "message": str(err.get("Message") or exc)}},
                              status=None, extra_secrets=extra)
    return replace(result, status=status, retry_after_s=retry_after_from_headers(headers))


def classify(exc: BaseException, extra_secrets: Iterable[str] = ()) -> AttemptError:
    """The AttemptError for `exc`. Never raises.

    `extra_secrets`: literal values (the profile's API key) to scrub as well.
    """
    extra = tuple(extra_secrets)
    try:
        return _classify(exc, extra)
    except Exception as inner:  # a classifier bug (or a str() that raises) must not hide the failure
        return attempt_error(ErrorClass.FINAL, "unclassified", f"{type(exc).__name__} [classifier: {type(inner).__name__}]",
                          extra_secrets=extra)


class CredentialsMissing(Exception):
    """The profile names an environment variable that is not set (final: a
    retry cannot set it)."""


def _classify(exc: BaseException, extra: tuple[str, ...]) -> AttemptError:
    if isinstance(exc, CredentialsMissing):
        return attempt_error(ErrorClass.FINAL, "credentials_missing", str(exc),
                             extra_secrets=extra)
    if isinstance(exc, StreamFailure):
        return attempt_error(exc.error_class, exc.code, str(exc), extra_secrets=extra)
    status = getattr(exc, "status_code", None)
    response = getattr(exc, "response", None)
    if isinstance(exc, httpx2.HTTPStatusError):
        status = exc.response.status_code
    if isinstance(status, int) and not isinstance(status, bool) and response is not None \
            and not isinstance(response, Mapping):
        body = getattr(exc, "body", None)
        headers = getattr(response, "headers", None)
        if status < 400:  # anthropic: an in-stream error event is an APIStatusError on a 200
            info = classify_payload(body, text=str(exc), extra_secrets=extra)
        else:
            err = error_object(body)
            ptype, pcode = provider_type_and_code(err)
            info = classify_status(status, str(exc), message=status_message(status, body, err),
                                   provider_type=ptype, provider_code=pcode,
                                   retry_after_s=retry_after_from_headers(headers), extra_secrets=extra)
        return replace(info, status=status)
    if isinstance(exc, _types("botocore.exceptions", "ClientError")):
        return _classify_botocore(exc, extra)
    text = _describe(exc)
    if "certificate verify failed" in text.lower():
        return attempt_error(ErrorClass.FINAL, "tls_verify_failed", text, extra_secrets=extra)
    code = _transport_code(exc)
    if code is not None:
        return attempt_error(ErrorClass.TRANSIENT, code, text, extra_secrets=extra)
    if isinstance(exc, _sdk_types("APIError")):
        # An SSE error event the SDK raised without a status (e.g. OpenRouter's
        # {"error": {"message": "Network connection lost."}}).
        body = getattr(exc, "body", None)
        return classify_payload(body if isinstance(body, Mapping) else {"error": {"message": str(exc)}},
                                text=str(exc), extra_secrets=extra)
    if has_connection_phrase(str(exc)):
        return attempt_error(ErrorClass.TRANSIENT, "connection_error", text, extra_secrets=extra)
    return attempt_error(ErrorClass.FINAL, "unexpected_error", text, extra_secrets=extra)

