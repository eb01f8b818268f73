"""The usage families of `/metrics` (docs/METRICS.md): status `usage`, the
daemon's all-time sums per (identity, provider, model) kept in journal.db
(supervisor/usage.py), as counters labelled `identity`, `provider`,
`model`. They survive restarts and prunes, as the sums do, so a counter
never goes back.

The labels are bounded: identities are the registered keys, providers the
configured profiles, and a model has its own label only when the price
table names it or it is among the first 50 seen (the supervisor folds the
rest into "other").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

LABELS = ["identity", "provider", "model"]
_COUNTERS = (  # status `usage` field -> (metric, help)
    ("calls", "streamfence_usage_calls_total", "Calls ended"),
    ("failed", "streamfence_usage_errors_total", "Calls ended failed"),
    ("attempts", "streamfence_usage_attempts_total", "Attempts of the calls ended"),
    ("spend", "streamfence_usage_spend_total", "Spend of the calls ended, priced by [prices] "
     "at each call's end (0 without a price)"),
)


def _count(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else 0.0


def usage_families(rows: Any) -> list[Metric]:
    """The families of status `usage` (a list of maps; anything else: none)."""
    if not isinstance(rows, list):
        return []
    tokens = CounterMetricFamily(
        "streamfence_usage_tokens", "Tokens of the calls ended, from the providers' usage "
        "fields, by direction (input: prompt; output: completion)",
        labels=[*LABELS, "direction"])
    families = {key: CounterMetricFamily(name, doc, labels=LABELS)
                for key, name, doc in _COUNTERS}
    for row in rows:
        if not isinstance(row, Mapping):
            continue
        labels = [str(row.get(k)) for k in ("identity", "provider", "model")]
        tokens.add_metric([*labels, "input"], _count(row.get("input_tokens")))
        tokens.add_metric([*labels, "output"], _count(row.get("output_tokens")))
        for key, family in families.items():
            family.add_metric(labels, _count(row.get(key)))
    return [tokens, *families.values()]
