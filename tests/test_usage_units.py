"""Usage and budgets without a daemon: the config's problems (file, key,
reason), the sums on a real journal.db across UTC days and months and a
reopen, the budgets' messages, and /metrics' bounded model labels."""

from __future__ import annotations

import calendar
from pathlib import Path
from typing import Any

import pytest

from streamfence.config.identities import Identity
from streamfence.config.model import ConfigError, parse_config
from streamfence.config.prices import Price
from streamfence.gateway.metrics_usage import usage_families
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.usage import MODEL_LABELS, OTHER, UsageBook

PROFILE = {"providers": {"oa": {"kind": "openai"}}}


def _problems(tables: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as info:
        parse_config({**PROFILE, **tables}, "f.toml")
    return info.value.problems


def test_bad_budgets_and_prices_are_named() -> None:
    problems = _problems({
        "identities": {"alice": {"tokens_per_day": -1, "tokens_per_month": 1.5},
                       "bob": {"spend_per_month": "lots"}},
        "prices": {"gpt-4o": {"input_per_mtok": 2.5},
                   "oa/": {"input_per_mtok": 1, "output_per_mtok": 2},
                   "m": {"input_per_mtok": -1, "output_per_mtok": True, "input_per_mtk": 1},
                   "n": 3}})
    assert set(problems) == {
        "f.toml: identities.alice.tokens_per_day: must be a number >= 0, got -1",
        "f.toml: identities.alice.tokens_per_month: must be a whole number, got 1.5",
        "f.toml: identities.bob.spend_per_month: must be a number >= 0, got 'lots'",
        "f.toml: prices.gpt-4o.output_per_mtok: is missing (the price per million tokens)",
        "f.toml: prices.oa/: names profile 'oa' but no model after the \"/\"",
        "f.toml: prices.m.input_per_mtok: must be a number >= 0, got -1",
        "f.toml: prices.m.output_per_mtok: must be a number >= 0, got True",
        "f.toml: prices.m.input_per_mtk: unknown key (did you mean 'input_per_mtok'?)",
        "f.toml: prices.n: must be a table with input_per_mtok and output_per_mtok",
    }, problems


def test_a_spend_budget_needs_prices() -> None:
    assert _problems({"identities": {"alice": {"spend_per_month": 5}}}) == (
        "f.toml: identities.alice.spend_per_month: needs prices: no [prices.\"MODEL\"] "
        "table is configured",)
    cfg = parse_config({**PROFILE, "identities": {"alice": {"spend_per_month": 5}},
                        "prices": {"oa/gpt-4o": {"input_per_mtok": 2, "output_per_mtok": 8}}})
    assert cfg.identities["alice"].spend_per_month == 5.0
    assert cfg.prices == {"oa/gpt-4o": Price(2.0, 8.0)}


def _at(day: str, hour: int = 12) -> float:
    y, m, d = (int(p) for p in day.split("-"))
    return float(calendar.timegm((y, m, d, hour, 0, 0)))


def test_sums_roll_over_days_and_months_and_outlive_a_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.db")
    now = [_at("2026-11-30")]
    journal = Journal(path)
    book = UsageBook(journal._db, journal._unit, wall=lambda: now[0])
    book.use({"gpt-4o": Price(2.0, 8.0)})
    alice = Identity("alice", tokens_per_day=1000, tokens_per_month=1500, spend_per_month=1.0)
    book.record("c1", "alice", "oa", "gpt-4o", False, 1,
                {"prompt_tokens": 900, "completion_tokens": 100})
    journal.commit()
    assert book.over_budget(alice) == (
        "'alice' has used 1000 tokens (input + output) of its tokens_per_day budget of "
        "1000 this UTC day; it resets at 2026-12-01T00:00:00Z")
    spender = Identity("carol", spend_per_month=0.002)
    book.record("c0", "carol", "oa", "gpt-4o", False, 1,
                {"prompt_tokens": 1_000_000, "completion_tokens": 300})
    assert book.over_budget(spender) == (
        "'carol' has used 2.0024 of its spend_per_month budget of 0.002 this UTC month; "
        "it resets at 2026-12-01T00:00:00Z")
    now[0] = _at("2026-11-30", 23) + 3599  # the last second of the month
    assert book.over_budget(alice) is not None
    now[0] = _at("2026-12-01", 0)  # a new day and a new month: both start again
    assert book.over_budget(alice) is None
    book.record("c2", "alice", "oa", "gpt-4o", True, 3,
                {"prompt_tokens": 500, "completion_tokens": "x"})  # not a count: 0
    journal.commit()
    now[0] = _at("2026-12-02")
    assert book.budgets(alice) == [
        {"budget": "tokens_per_day", "used": 0, "limit": 1000,
         "resets": "2026-12-03T00:00:00Z"},
        {"budget": "tokens_per_month", "used": 500, "limit": 1500,
         "resets": "2027-01-01T00:00:00Z"},
        {"budget": "spend_per_month", "used": 0.001, "limit": 1.0,
         "resets": "2027-01-01T00:00:00Z"}]
    journal.close()
    reopened = Journal(path)
    again = UsageBook(reopened._db, reopened._unit, wall=lambda: now[0])
    assert again.budgets(alice)[1]["used"] == 500  # the month's sums, read back
    assert again.query("alice", "", ("identity", "day")) == [
        {"identity": "alice", "day": "2026-11-30", "calls": 1, "failed": 0, "attempts": 1,
         "input_tokens": 900, "output_tokens": 100, "spend": 0.0026},
        {"identity": "alice", "day": "2026-12-01", "calls": 1, "failed": 1, "attempts": 3,
         "input_tokens": 500, "output_tokens": 0, "spend": 0.001}]
    assert again.query("bob", "", ("identity",)) == []
    assert again.query(None, "2026-12-01", ())[0]["calls"] == 1
    reopened.close()


def test_metrics_model_labels_are_bounded(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "journal.db"))
    book = journal.usage
    book.use({"priced": Price(1.0, 1.0)})
    for i in range(MODEL_LABELS + 5):
        book.record(f"c{i}", "alice", "oa", f"m{i}", False, 1,
                    {"prompt_tokens": 1, "completion_tokens": 2})
    book.record("p", "alice", "oa", "priced", False, 1, None)
    rows = book.totals()
    models = {r["model"] for r in rows}
    assert len(models) == MODEL_LABELS + 2 and OTHER in models and "priced" in models
    other = next(r for r in rows if r["model"] == OTHER)
    assert (other["calls"], other["input_tokens"], other["output_tokens"]) == (5, 5, 10)
    families = {f.name: f for f in usage_families(rows)}
    tokens = families["streamfence_usage_tokens"].samples
    assert len(tokens) == 2 * len(rows)
    journal.close()
