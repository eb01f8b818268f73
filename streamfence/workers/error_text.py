"""What a provider's error says, read from its text, body and headers (pure
functions; workers/errors.py classifies with them).

Contract:
- the text rules: `is_context_overflow_text`, `has_connection_phrase`,
  `names_stream_options`, `rejects_streaming` (a 4xx naming streaming);
- `retry_after_from_headers`: the seconds a `retry-after-ms` or
  `Retry-After` header asks for, None if none (or unreadable);
- an error body: `error_object` (its `error` map, or the body itself),
  `provider_type_and_code` (OpenAI's `type` and `code`, Anthropic's `type`
  and `details.error_code`), `status_message` (what a status error says:
  the body's message, once, not the SDK's "Error code: 400 - …" text),
  `status_from_value` (an HTTP status in a number or a text).
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Mapping
from typing import Any

_CONTEXT_RE = re.compile(
    r"context[_ ]length[_ ]exceeded|maximum context|context (?:length|window|size|limit)"
    r"|prompt is too long|prompt too long|input is too long|too many (?:input )?tokens"
    r"|exceeds? (?:the )?(?:model'?s? )?(?:context|max(?:imum)? (?:input|number of tokens|tokens))"
    r"|reduce the length of the messages|input length and `?max_tokens`? exceed"
    r"|maximum input length|prompt (?:length|tokens?) exceeds?", re.IGNORECASE)

# Proxies report an upstream drop as an SSE error event, not a status.
_CONN_PHRASES = ("connection lost", "connection reset", "connection closed", "connection terminated",
                 "connection aborted", "connection refused", "network error", "network connection",
                 "terminated", "peer closed", "broken pipe", "upstream connect error",
                 "incomplete chunked read", "server disconnected", "remote end closed",
                 "eof occurred", "timed out", "stream timeout")


# ---- text --------------------------------------------------------------------

def is_context_overflow_text(text: str) -> bool:
    return _CONTEXT_RE.search(text) is not None


def has_connection_phrase(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in _CONN_PHRASES)


def names_stream_options(status: int | None, text: str) -> bool:
    """A strict endpoint rejecting the usage extension (400/422 naming it)."""
    return status in (400, 422) and "stream_options" in text.lower()


def rejects_streaming(status: int | None, text: str) -> bool:
    low = text.lower()
    return (status is not None and 400 <= status < 500 and "stream" in low
            and ("not supported" in low or "unsupported" in low or "not allowed" in low
                 or "does not support" in low))


# ---- Retry-After -----------------------------------------------------------

def retry_after_from_headers(headers: Any, now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or HTTP date)."""
    if headers is None:
        return None
    try:
        ms = headers.get("retry-after-ms")
        raw = headers.get("retry-after")
    except Exception:
        return None
    for value, scale in ((ms, 1000.0), (raw, 1.0)):
        if value is None:
            continue
        try:
            delay = float(value) / scale
        except (TypeError, ValueError):
            continue
        return max(0.0, delay) if math.isfinite(delay) else None
    if isinstance(raw, str):
        parsed = email.utils.parsedate_tz(raw)
        if parsed is not None:
            try:
                when = float(email.utils.mktime_tz(parsed))
            except (OverflowError, ValueError):
                return None
            return max(0.0, when - (time.time() if now is None else now))
    return None


# ---- error bodies ------------------------------------------------------------

def status_from_value(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
        return value
    if isinstance(value, str):
        m = re.search(r"\b([1-5]\d\d)\b", value)
        if m:
            return int(m.group(1))
    return None


def _text_or_none(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def error_object(payload: Any) -> Mapping[str, Any]:
    """The error object of an error body or event: `error` if it is one, else the payload."""
    err = payload.get("error") if isinstance(payload, Mapping) else None
    if not isinstance(err, Mapping):
        err = payload if isinstance(payload, Mapping) else {}
    if isinstance(payload, Mapping) and isinstance(payload.get("error"), str) and not err.get("message"):
        err = {"message": payload["error"]}
    return err


def provider_type_and_code(err: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """An error object's type and code: OpenAI's `type` and `code`,
    Anthropic's `type` and `details.error_code`."""
    details = err.get("details")
    code = err.get("code")
    if code is None and isinstance(details, Mapping):
        code = details.get("error_code")
    return _text_or_none(err.get("type") or err.get("error_type")), _text_or_none(code)


def status_message(status: int, body: Any, err: Mapping[str, Any]) -> str:
    """What a status error says: its body's message, else the body itself (a
    proxy's HTML or text page), else that it said nothing."""
    message = err.get("message")
    if isinstance(message, str) and message:
        return message
    if isinstance(body, str) and body.strip():
        return body.strip()
    return f"the provider answered HTTP {status} with no error message"
