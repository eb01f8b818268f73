"""The price table (`[prices]`): what a model's tokens cost, for the spend
budgets (`[identities.NAME] spend_per_month`) and the spend `streamfence
usage` shows.

    [prices."gpt-4o"]              # this model on every profile
    input_per_mtok = 2.5           # per million input (prompt) tokens
    output_per_mtok = 10           # per million output (completion) tokens
    [prices."azure/gpt-4o"]        # on profile `azure` only: wins over the line above

A key is "PROFILE/MODEL" when the part before its first "/" names a
declared profile, else a model name (which may hold a "/" itself, as
OpenRouter's do). Prices have no currency: a spend budget is in the
table's unit. A call is priced once, at its end, with the prices then in
force (a reload changes the price of later calls, never of sums stored).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from streamfence.config.problems import unknown

PER = 1_000_000  # prices are per million tokens


@dataclass(frozen=True, slots=True)
class Price:
    input_per_mtok: float
    output_per_mtok: float

    def of(self, input_tokens: int, output_tokens: int) -> float:
        """The spend of these tokens."""
        return (input_tokens * self.input_per_mtok + output_tokens * self.output_per_mtok) / PER


_KEYS = ("input_per_mtok", "output_per_mtok")


def parse_prices(table: Any, where: str, profiles: Collection[str], problems: list[str]
                 ) -> dict[str, Price]:
    """`[prices."KEY"]` tables; each problem is added to `problems`, naming
    `where` (the file) and the key. `profiles`: the profiles declared."""
    if not isinstance(table, dict):
        problems.append(f"{where}: must be a table of tables ([prices.\"MODEL\"])")
        return {}
    prices = {}
    for key, entry in table.items():
        at = f"{where}.{key}"
        if not isinstance(entry, dict):
            problems.append(f"{at}: must be a table with input_per_mtok and output_per_mtok")
            continue
        for name in sorted(set(entry) - set(_KEYS)):
            problems.append(unknown(f"{at}.{name}", name, _KEYS))
        values = []
        for name in _KEYS:
            value = entry.get(name)
            if value is None:
                problems.append(f"{at}.{name}: is missing (the price per million tokens)")
            elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                problems.append(f"{at}.{name}: must be a number >= 0, got {value!r}")
            else:
                values.append(float(value))
        profile, slash, model = key.partition("/")
        if slash and profile in profiles and not model:
            problems.append(f"{at}: names profile {profile!r} but no model after the \"/\"")
        elif len(values) == len(_KEYS):
            prices[key] = Price(*values)
    return prices


def price_of(prices: Mapping[str, Price], profile: str, model: str) -> Price | None:
    """The price of `model` on `profile`: its "PROFILE/MODEL" entry, else its
    model's, else None."""
    return prices.get(f"{profile}/{model}") or prices.get(model)
