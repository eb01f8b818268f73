"""Usage sums and budgets (docs/ARCHITECTURE.md §4.19).

Each call's end adds its usage to one row of journal.db's `usage` table,
keyed by (identity, UTC day, profile, model), in the same transaction as
the call's `finish_call`: the sums hold exactly the calls the journal
holds as finished, across crashes and restarts. A prune of finished calls
(the daemon's or `streamfence prune`'s) deletes `calls`, `attempts` and
`requests` rows only, never these: the sums outlive the calls they count.

What a call adds: 1 call; 1 failed if it ended `failed`; its attempts; the
input and output tokens of its done's normalized `usage` (`prompt_tokens`,
`completion_tokens`: every worker fills them from its provider's own
fields, PROTOCOL §6), which are the answering attempt's (an attempt killed
mid-stream never got the provider's usage, so it adds none); its spend, by
the price table then in force (config/prices.py; 0 without a price).

`answered_by` says which profile and model a call's usage counts against:
the one place that decides it.

Budgets are judged from sums kept in memory (loaded once at open, then
added to at each call's end), so a submit costs no read: tokens per UTC day
and per UTC calendar month (input + output), spend per UTC month. A submit
is refused once a sum has reached its budget; calls already accepted run
to their end, so a budget can be passed by what those calls use.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, timedelta
from typing import TYPE_CHECKING, Any

from streamfence.config.identities import Identity
from streamfence.config.prices import Price, price_of
from streamfence.protocol.logs import request_model
from streamfence.protocol.queries import USAGE_BY

if TYPE_CHECKING:
    from streamfence.supervisor.calls import Call
    from streamfence.supervisor.journal_unit import WriteUnit

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    identity TEXT NOT NULL,
    day TEXT NOT NULL,  -- UTC, YYYY-MM-DD
    profile TEXT NOT NULL,
    model TEXT NOT NULL,
    calls INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    spend REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (identity, day, profile, model)
) WITHOUT ROWID;
"""
_ADD = ("INSERT INTO usage (identity, day, profile, model, calls, failed, attempts, "
        "input_tokens, output_tokens, spend) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?) "
        "ON CONFLICT (identity, day, profile, model) DO UPDATE SET calls = calls + 1, "
        "failed = failed + excluded.failed, attempts = attempts + excluded.attempts, "
        "input_tokens = input_tokens + excluded.input_tokens, "
        "output_tokens = output_tokens + excluded.output_tokens, "
        "spend = spend + excluded.spend")
SUMS = ("calls", "failed", "attempts", "input_tokens", "output_tokens", "spend")
# /metrics labels a model by name for the models the price table names and
# the first MODEL_LABELS others seen; the rest are "other" (bounded cardinality).
MODEL_LABELS = 50
OTHER = "other"


def answered_by(call: Call) -> tuple[str, str]:
    """The (profile, model) a call's usage counts against: the deployment of
    its last attempt (a group's call), else its profile and the model its
    request names."""
    return call.profile.name, call.model or "-"


def model_of(request: Mapping[str, Any]) -> str:
    """The model a request names (Bedrock's `modelId`), "-" if none."""
    return request_model(request) or "-"


def tokens_of(usage: Any) -> tuple[int, int]:
    """(input, output) tokens of a done's normalized usage; 0 for a field
    missing or not a count."""
    if not isinstance(usage, Mapping):
        return 0, 0
    return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def _amount(value: float) -> str:
    """A count as it is (1234567), a spend to 4 decimals at most (12.5)."""
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}".rstrip("0").rstrip(".")


def utc_day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def _next_day(day: str) -> str:
    return (date.fromisoformat(day) + timedelta(days=1)).isoformat()


def _next_month(month: str) -> str:
    year, mon = int(month[:4]), int(month[5:7])
    return f"{year + mon // 12:04d}-{mon % 12 + 1:02d}-01"


@dataclass(slots=True)
class _Spent:
    """An identity's sums in the current UTC day and month."""

    day: str
    day_tokens: int = 0
    month_tokens: int = 0
    month_spend: float = 0.0


class UsageBook:
    """Owns the `usage` table's writes (through the journal's unit) and the
    sums kept in memory: all-time per (identity, profile, model), for
    `status` and /metrics, and each identity's current day and month, for
    its budgets. `wall`: the wall clock (UTC days)."""

    def __init__(self, db: sqlite3.Connection, unit: WriteUnit,
                 wall: Callable[[], float] = time.time) -> None:
        self._db = db
        self._unit = unit
        self._wall = wall
        self._prices: Mapping[str, Price] = {}
        db.executescript(SCHEMA)
        self._totals: dict[tuple[str, str, str], list[float]] = {}
        for row in db.execute(f"SELECT identity, profile, model, "
                              f"{', '.join(f'SUM({s})' for s in SUMS)} FROM usage "
                              "GROUP BY identity, profile, model ORDER BY MIN(day)"):
            self._totals[row[0], row[1], row[2]] = list(row[3:])
        today = utc_day(wall())
        self._spent: dict[str, _Spent] = {}
        for name, day_tokens, month_tokens, spend in db.execute(
                "SELECT identity, SUM(CASE WHEN day = ? THEN input_tokens + output_tokens "
                "ELSE 0 END), SUM(input_tokens + output_tokens), SUM(spend) FROM usage "
                "WHERE day >= ? GROUP BY identity", (today, today[:8] + "01")):
            self._spent[name] = _Spent(today, int(day_tokens), int(month_tokens), float(spend))

    def use(self, prices: Mapping[str, Price]) -> None:
        """The price table (at start, and at each reload) for the calls that end next."""
        self._prices = prices

    def priced(self, profile: str, model: str) -> bool:
        return price_of(self._prices, profile, model) is not None

    # ---- a call's end --------------------------------------------------------
    def record(self, call_id: str, identity: str, profile: str, model: str, failed: bool,
               attempts: int, usage: Any) -> None:
        """Add one finished call to the sums, in the journal's current unit
        (the transaction of its `finish_call`)."""
        input_tokens, output_tokens = tokens_of(usage)
        price = price_of(self._prices, profile, model)
        spend = price.of(input_tokens, output_tokens) if price is not None else 0.0
        now = self._wall()
        self._unit.write(call_id, _ADD, (identity, utc_day(now), profile, model, int(failed),
                                         attempts, input_tokens, output_tokens, spend))
        total = self._totals.setdefault((identity, profile, model), [0, 0, 0, 0, 0, 0.0])
        for i, value in enumerate((1, int(failed), attempts, input_tokens, output_tokens,
                                   spend)):
            total[i] += value
        spent = self._period(identity, now)
        spent.day_tokens += input_tokens + output_tokens
        spent.month_tokens += input_tokens + output_tokens
        spent.month_spend += spend

    def _period(self, identity: str, now: float) -> _Spent:
        """`identity`'s sums of the current UTC day and month (a new day or
        month starts them again)."""
        today = utc_day(now)
        spent = self._spent.get(identity)
        if spent is not None and spent.day == today:
            return spent
        fresh = _Spent(today)
        if spent is not None and spent.day[:7] == today[:7]:  # a new day of the same month
            fresh.month_tokens, fresh.month_spend = spent.month_tokens, spent.month_spend
        self._spent[identity] = fresh
        return fresh

    # ---- budgets -------------------------------------------------------------
    def budgets(self, user: Identity) -> list[dict[str, Any]]:
        """`user`'s budgets: each one's name, what is used of it, its limit,
        and when it starts again (UTC, ISO 8601)."""
        spent = self._period(user.name, self._wall())
        day, month = spent.day, spent.day[:7]
        found = []
        for name, used, limit, resets in (
                ("tokens_per_day", spent.day_tokens, user.tokens_per_day, _next_day(day)),
                ("tokens_per_month", spent.month_tokens, user.tokens_per_month,
                 _next_month(month)),
                ("spend_per_month", round(spent.month_spend, 6), user.spend_per_month,
                 _next_month(month))):
            if limit:
                found.append({"budget": name, "used": used, "limit": limit,
                              "resets": f"{resets}T00:00:00Z"})
        return found

    def over_budget(self, user: Identity) -> str | None:
        """Why `user` may not submit now (a budget it has used up), or None."""
        if not (user.tokens_per_day or user.tokens_per_month or user.spend_per_month):
            return None
        for b in self.budgets(user):
            if b["used"] >= b["limit"]:
                unit = "" if b["budget"] == "spend_per_month" else " tokens (input + output)"
                period = "UTC day" if b["budget"] == "tokens_per_day" else "UTC month"
                return (f"{user.name!r} has used {_amount(b['used'])}{unit} of its "
                        f"{b['budget']} budget of {_amount(b['limit'])} this {period}; it "
                        f"resets at {b['resets']}")
        return None

    # ---- what is read ----------------------------------------------------------
    def totals(self) -> list[dict[str, Any]]:
        """The all-time sums per (identity, provider, model), for `status`
        and /metrics: a model outside the price table and the first
        MODEL_LABELS others seen is folded into "other"."""
        named = {key.partition("/")[2] or key for key in self._prices} | set(self._prices)
        seen: dict[str, None] = {}
        folded: dict[tuple[str, str, str], list[float]] = {}
        for (identity, profile, model), sums in self._totals.items():
            if model not in named and model not in seen:
                if len(seen) < MODEL_LABELS:
                    seen[model] = None
                else:
                    model = OTHER
            row = folded.setdefault((identity, profile, model), [0, 0, 0, 0, 0, 0.0])
            for i, value in enumerate(sums):
                row[i] += value
        return [{"identity": i, "provider": p, "model": m,
                 **{s: (round(v, 6) if s == "spend" else int(v))
                    for s, v in zip(SUMS, sums, strict=True)}}
                for (i, p, m), sums in folded.items()]

    def query(self, identity: str | None, since: str, by: tuple[str, ...]
              ) -> list[dict[str, Any]]:
        """The stored sums from UTC day `since` on, grouped by `by` (a subset
        of messages.USAGE_BY); only `identity`'s when given. A storage fault or damage is
        raised as a ProtocolError with its code."""
        assert set(by) <= set(USAGE_BY), by  # names, never text from a client, in the SQL
        cols = ", ".join(by) if by else "'all'"
        where, params = "day >= ?", [since]
        if identity is not None:
            where, params = where + " AND identity = ?", [since, identity]
        sql = (f"SELECT {cols}, {', '.join(f'SUM({s})' for s in SUMS)} FROM usage "
               f"WHERE {where} GROUP BY {cols} ORDER BY {cols}")
        try:
            rows = self._db.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._unit.read_failed(exc) from None
        width = len(by)
        return [{**dict(zip(by, row[:width], strict=True)),
                 **{s: (round(v or 0.0, 6) if s == "spend" else int(v or 0))
                    for s, v in zip(SUMS, row[max(width, 1):], strict=True)}}
                for row in rows]

