"""The two read-only queries of protocol v1 (docs/PROTOCOL.md): `usage`
(the usage sums, supervisor/usage.py) and `calls` (a page of the calls an
identity may see, supervisor/calls_view.py); `parse_request`
(protocol/messages.py) hands each its map.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from streamfence.protocol.fields import MAX_REF_LEN, bad_field, field_of, ref_field

USAGE_BY = ("identity", "profile", "model", "day")  # what usage sums may be grouped by
_DAY_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass(frozen=True, slots=True)
class Usage:
    """The usage sums (supervisor/usage.py) from UTC day `since` ("": all),
    grouped by `by`."""

    ref: str
    by: tuple[str, ...] = USAGE_BY[:3]
    since: str = ""




# `calls`' state filter: live (not done), done, or a done call's status.
CALLS_STATES = ("live", "done", "completed", "partial", "failed", "cancelled")
CALLS_LIMIT_MAX = 500


@dataclass(frozen=True, slots=True)
class Calls:
    """List calls, newest first (docs/PROTOCOL.md "calls"). `call_id`: that
    one call, with its attempts and request."""

    ref: str
    state: str | None = None
    identity: str | None = None
    provider: str | None = None
    search: str | None = None  # a prefix of the call id or of the session id
    limit: int = 50
    before: tuple[float, str] | None = None  # the cursor: the last row's (created, call_id)
    call_id: str | None = None


def parse_usage(obj: dict[str, Any]) -> Usage:
    ref = ref_field(obj)
    by = field_of(obj, "by", list, "", required=False)
    if by is not None and (not all(isinstance(b, str) and b in USAGE_BY for b in by)
                           or len(set(by)) != len(by)):
        raise bad_field("by", f"must be a list of distinct names among {', '.join(USAGE_BY)}")
    since = field_of(obj, "since", str, "", required=False) or ""
    if since and not _DAY_RE.fullmatch(since):
        raise bad_field("since", "must be a UTC day, YYYY-MM-DD")
    return Usage(ref, USAGE_BY[:3] if by is None else tuple(by), since)


def parse_calls(m: dict[str, Any]) -> Calls:
    text = {key: field_of(m, key, str, "", required=False)
            for key in ("state", "identity", "provider", "search", "call_id", "before")}
    for key, value in text.items():
        if value is not None and len(value) > MAX_REF_LEN:
            raise bad_field(key, f"is longer than {MAX_REF_LEN} characters")
    if text["state"] is not None and text["state"] not in CALLS_STATES:
        raise bad_field("state", "must be one of " + ", ".join(CALLS_STATES))
    limit = field_of(m, "limit", int, "", required=False)
    if limit is not None and not 1 <= limit <= CALLS_LIMIT_MAX:
        raise bad_field("limit", f"must be between 1 and {CALLS_LIMIT_MAX}")
    before = None
    if text["before"] is not None:
        created, _, call_id = text["before"].partition("/")
        try:
            before = (float(created), call_id)
        except ValueError:
            raise bad_field("before", "must be a reply's `next`") from None
    return Calls(ref=ref_field(m), state=text["state"], identity=text["identity"],
                 provider=text["provider"], search=text["search"] or None,
                 limit=limit or 50, before=before, call_id=text["call_id"])


def calls_cursor(created: float, call_id: str) -> str:
    """A `calls` reply's `next`: where its next page starts (`before`)."""
    return f"{created!r}/{call_id}"
