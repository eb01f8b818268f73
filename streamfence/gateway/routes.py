"""Which provider profile serves an HTTP request (README, "Use it from an
existing app"). In order:

1. the `X-Streamfence-Profile` header names it;
2. the model names a model group (`[groups.NAME]`): the group serves it;
3. `[http] routes` maps the request's model name to it;
4. the model is written `PROFILE/MODEL`: PROFILE serves MODEL;
5. the config has one profile of the endpoint's kind: that one.

The profile must be of the endpoint's kind (/v1/chat/completions: openai,
/v1/messages: anthropic): the body goes to the provider as it came. Whether
the identity may use the profile is the daemon's to say (`unknown_provider`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from streamfence.config.groups import ModelGroup
from streamfence.config.groups import may_use as group_may_use
from streamfence.config.model import HttpConfig, ProviderProfile

PROFILE_HEADER = "X-Streamfence-Profile"
NO_GROUPS: Mapping[str, ModelGroup] = MappingProxyType({})


class NoRoute(Exception):
    """No profile serves the request (the message says what was looked at)."""


@dataclass(frozen=True, slots=True)
class Route:
    profile: str  # a profile's name, or a group's
    model: str  # the model name sent to the provider (a group's: replaced per deployment)


def route(http: HttpConfig, providers: dict[str, ProviderProfile], kind: str, model: str,
          header: str | None, groups: Mapping[str, ModelGroup] = NO_GROUPS) -> Route:
    if header:
        return Route(_of_kind(providers, kind, header, f"{PROFILE_HEADER}: {header}"), model)
    group = groups.get(model)
    if group is not None:
        if group.kind != kind:
            raise NoRoute(f"model {model!r}: group {model!r} is {group.kind}, this endpoint "
                          f"speaks {kind}")
        return Route(model, model)
    if model in http.routes:
        return Route(_of_kind(providers, kind, http.routes[model], f"route of {model!r}"),
                     model)
    profile, slash, rest = model.partition("/")
    if slash and profile in providers:
        return Route(_of_kind(providers, kind, profile, f"model {model!r}"), rest)
    of_kind = sorted(name for name, p in providers.items() if p.kind == kind)
    if len(of_kind) == 1:
        return Route(of_kind[0], model)
    raise NoRoute(f"model {model!r}: no [http] route, not PROFILE/MODEL, and "
                  f"{len(of_kind)} {kind} profiles ({', '.join(of_kind) or 'none'}); name one "
                  f"in the model (PROFILE/MODEL) or the {PROFILE_HEADER} header")


def _of_kind(providers: dict[str, ProviderProfile], kind: str, name: str, why: str) -> str:
    profile = providers.get(name)
    if profile is None:
        raise NoRoute(f"{why}: no provider profile {name!r}")
    if profile.kind != kind:
        raise NoRoute(f"{why}: profile {name!r} is {profile.kind}, this endpoint speaks {kind}")
    return name


def models(http: HttpConfig, providers: dict[str, ProviderProfile],
           may_use: frozenset[str] | None, groups: Mapping[str, ModelGroup] = NO_GROUPS
           ) -> list[tuple[str, str]]:
    """(model id, owner) pairs that `GET /v1/models` lists: the groups (owner
    "group"), the routes, and `PROFILE/*` for each profile (`may_use`: the
    identity's allow-list, None: all; a group as the daemon judges it,
    config/groups.py `may_use`)."""
    usable = {n for n in providers if may_use is None or n in may_use}
    listed = [(name, "group") for name, g in sorted(groups.items())
              if group_may_use(may_use, g)]
    listed += [(model, p) for model, p in sorted(http.routes.items()) if p in usable]
    return listed + [(f"{name}/*", name) for name in sorted(usable)]
