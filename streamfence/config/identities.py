"""Who a client is, and what it may do (docs/SECURITY.md).

A client's identity is the name its CURVE key is registered under
(`protocol/keys.py`); the front learns it from ZeroMQ's ZAP for every
message, never from the message. `[identities.NAME]` tables in the config
limit what each identity may do:

    [identities.alice]
    role = "client"            # "admin" also sees every call and the whole status
    providers = ["openai"]     # profiles it may use (default: all)
    max_in_flight = 8          # calls accepted and not yet done (0: no limit)
    max_in_flight_bytes = 67108864  # their requests' bytes (default 64 MiB; 0: no limit)
    submits_per_s = 5          # sustained submit rate, bursts of as many (0: no limit)
    submit_bytes_per_s = 4194304  # request bytes per second (default 4 MiB/s; bursts of
                               # a second's worth or one request; 0: no limit)
    max_tokens = 4096          # cap on the wire's output-token limit (0: none)
    n = 1                      # cap on OpenAI's `n` (0: none)
    max_listeners = 64         # events connections with a subscription at once (0: no limit)
    max_subscriptions = 1024   # subscriptions (listener, call) at once (0: no limit)
    tokens_per_day = 1000000   # input + output tokens per UTC day (0: no budget)
    tokens_per_month = 0       # input + output tokens per UTC calendar month (0: none)
    spend_per_month = 50.0     # spend per UTC month, priced by [prices] (0: none)

A registered key without a table gets the defaults (role "client", no
limits but `max_in_flight_bytes`, 64 MiB, `submit_bytes_per_s`, 4 MiB/s,
`max_listeners`, 64, and `max_subscriptions`, 1024). The daemon's own user's
identity, `local`, is an admin unless a table says otherwise. The two
listener caps are the sink's to enforce: the supervisor hands them over with
each subscribe (`ListenerOwner`, protocol/internal/control.py). The three
budgets are the supervisor's (supervisor/usage.py): a submit is refused
`budget_exceeded` once the identity's sums reach one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from streamfence.config.problems import unknown
from streamfence.protocol.credentials import LOCAL_NAME

DEFAULT_MAX_IN_FLIGHT_BYTES = 64 * 1024 * 1024
# Request bytes an identity may submit per second: the supervisor decodes,
# checks and journals (with an fsync) every byte in its one loop, so one
# client's giant requests must not take it from the others.
DEFAULT_SUBMIT_BYTES_PER_S = 4 * 1024 * 1024
# Every listener and subscription costs the sink a share of each commit's
# sends and of its replays: one identity's are capped (too_many_subscriptions).
DEFAULT_MAX_LISTENERS = 64
DEFAULT_MAX_SUBSCRIPTIONS = 1024
_DEFAULTS = {"max_in_flight_bytes": DEFAULT_MAX_IN_FLIGHT_BYTES,
             "submit_bytes_per_s": DEFAULT_SUBMIT_BYTES_PER_S,
             "max_listeners": DEFAULT_MAX_LISTENERS,
             "max_subscriptions": DEFAULT_MAX_SUBSCRIPTIONS}


class Role(StrEnum):
    CLIENT = "client"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Identity:
    name: str
    role: Role = Role.CLIENT
    providers: frozenset[str] | None = None  # None: every profile
    max_in_flight: int = 0
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES
    submits_per_s: float = 0.0
    submit_bytes_per_s: float = DEFAULT_SUBMIT_BYTES_PER_S
    max_listeners: int = DEFAULT_MAX_LISTENERS
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    caps: Mapping[str, int] = field(default_factory=dict)  # request field caps
    tokens_per_day: int = 0  # budgets (supervisor/usage.py); 0: none
    tokens_per_month: int = 0
    spend_per_month: float = 0.0

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    def may_use(self, provider: str) -> bool:
        return self.providers is None or provider in self.providers


_NUMBERS = ("max_in_flight", "max_in_flight_bytes", "submits_per_s", "submit_bytes_per_s",
            "max_tokens", "n", "max_listeners", "max_subscriptions", "tokens_per_day",
            "tokens_per_month", "spend_per_month")
_FRACTIONAL = ("submits_per_s", "submit_bytes_per_s", "spend_per_month")
_KEYS = {"role", "providers", *_NUMBERS}


def parse_identities(tables: Any, where: str, problems: list[str],
                     elsewhere: Mapping[str, str] | None = None) -> dict[str, Identity]:
    """The `[identities.NAME]` tables; each problem is added to `problems`
    (for the caller to refuse the config: a key with a problem gets a
    stand-in value, so that the rest of the file is still checked).
    `elsewhere`: the other tables' keys, for an unknown key's message."""
    if not isinstance(tables, dict):
        problems.append(f"{where}: must be a table of tables")
        return {}
    return {name: _parse_identity(name, table, f"{where}.{name}", problems, elsewhere)
            for name, table in tables.items()}


def _parse_identity(name: str, table: Any, at: str, problems: list[str],
                    elsewhere: Mapping[str, str] | None) -> Identity:
    if not isinstance(table, dict):
        problems.append(f"{at}: must be a table")
        return Identity(name)
    for key in sorted(set(table) - _KEYS):
        problems.append(unknown(f"{at}.{key}", key, _KEYS, elsewhere=elsewhere))
    role = table.get("role", Role.ADMIN.value if name == LOCAL_NAME else Role.CLIENT.value)
    if role not in (r.value for r in Role):
        problems.append(f"{at}.role: must be \"client\" or \"admin\", got {role!r}")
        role = Role.CLIENT.value
    providers = table.get("providers")
    if providers is not None and (not isinstance(providers, list) or not all(
            isinstance(p, str) for p in providers)):
        problems.append(f"{at}.providers: must be a list of profile names")
        providers = None
    numbers: dict[str, float] = {}
    for key in _NUMBERS:
        value = table.get(key, _DEFAULTS.get(key, 0))
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            problems.append(f"{at}.{key}: must be a number >= 0, got {value!r}")
            value = 0
        elif key not in _FRACTIONAL and not isinstance(value, int):
            problems.append(f"{at}.{key}: must be a whole number, got {value!r}")
        numbers[key] = value
    return Identity(
        name=name, role=Role(role),
        providers=None if providers is None else frozenset(providers),
        max_in_flight=int(numbers["max_in_flight"]),
        max_in_flight_bytes=int(numbers["max_in_flight_bytes"]),
        submits_per_s=float(numbers["submits_per_s"]),
        submit_bytes_per_s=float(numbers["submit_bytes_per_s"]),
        max_listeners=int(numbers["max_listeners"]),
        max_subscriptions=int(numbers["max_subscriptions"]),
        caps={k: int(numbers[k]) for k in ("max_tokens", "n") if numbers[k]},
        tokens_per_day=int(numbers["tokens_per_day"]),
        tokens_per_month=int(numbers["tokens_per_month"]),
        spend_per_month=float(numbers["spend_per_month"]))


def identity_named(name: str, configured: Mapping[str, Identity]) -> Identity:
    """The identity for a registered key's name: its table, or the defaults."""
    found = configured.get(name)
    if found is not None:
        return found
    return Identity(name, Role.ADMIN if name == LOCAL_NAME else Role.CLIENT)
