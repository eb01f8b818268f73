"""Words for the problem most often made by hand in a config: a misspelt
or misplaced name. `unknown` names the known name it resembles ("did you
mean", by difflib), or the table it belongs in; `typed` keeps a table's
keys of the right type. Both add problems, as text, to a list: the parsers
gather every problem of a file into one `ConfigError` (model.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any, cast


def closest(name: str, known: Collection[str]) -> str | None:
    """The known name `name` is most likely a misspelling of, if any is close."""
    found = difflib.get_close_matches(name, sorted(known), n=1)
    return found[0] if found else None


def did_you_mean(name: str, known: Collection[str]) -> str:
    """" (did you mean 'x'?)" for the closest known name, else ""."""
    match = closest(name, known)
    return f" (did you mean {match!r}?)" if match else ""


def unknown(at: str, name: str, known: Collection[str], what: str = "key",
            elsewhere: Mapping[str, str] | None = None) -> str:
    """The problem of an unknown `name` at `at` (e.g. "f.toml: daemon.x"):
    the table it belongs in when it is another table's (`elsewhere`: name ->
    "[table]"); else the known name it resembles; else the names known here."""
    home = (elsewhere or {}).get(name)
    if home is not None:
        return f"{at}: unknown {what} here ({name} belongs in {home})"
    match = closest(name, known)
    if match is not None:
        return f"{at}: unknown {what} (did you mean {match!r}?)"
    return f"{at}: unknown {what} (one of {', '.join(sorted(known))})"


Types = dict[str, tuple[type, ...]]  # a table's keys -> the types each may have


def typed(table: dict[str, Any], where: str, types: Types, problems: list[str],
          homes: Mapping[str, str]) -> dict[str, Any]:
    """The keys of `table` that are known, of their type and not negative
    (an int given for a float made a float); the problem of each other added
    to `problems`. `where`: "FILE: TABLE"; `homes`: see `unknown`."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key not in types:
            problems.append(unknown(f"{where}.{key}", key, types, elsewhere=homes))
            continue
        kinds = types[key]
        expected = kinds[0].__name__
        if kinds[0] is dict and not isinstance(value, dict):
            problems.append(f"{where}.{key}: must be a table")
        elif isinstance(value, bool) and bool not in kinds:
            problems.append(f"{where}.{key}: expected {expected}, got a boolean")
        elif not isinstance(value, kinds):
            problems.append(f"{where}.{key}: expected {expected}, got {type(value).__name__}")
        elif isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            problems.append(f"{where}.{key}: must not be negative")
        else:
            out[key] = float(cast(float, value)) if float in kinds else value
    return out
