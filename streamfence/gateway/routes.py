"""Which provider profile serves an HTTP request (README, "Use it from an
existing app"). In order:

1. the `X-Streamfence-Profile` header names it;
2. the model names a model group (`[groups.NAME]`): the group serves it;
3. `[http] routes` maps the request's model name to it;
4. the model is written `PROFILE/MODEL`: PROFILE serves MODEL;
5. the config has one profile of the endpoint's kind: that one; else, when
   it has one profile at all, that one.

A profile of any kind may serve either endpoint: the `Route` carries the
target's `kind`, and the gateway translates the request to that wire when
it differs from the endpoint's (gateway/translate.py). Whether the identity
may use the profile is the daemon's to say (`unknown_provider`).
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
    target: str  # the name submitted: a profile's, or a group's
    model: str  # the model name sent to the provider (a group's: replaced per deployment)
    kind: str  # the target's wire (openai, anthropic, bedrock): the request's, once translated


def route(http: HttpConfig, providers: dict[str, ProviderProfile], kind: str, model: str,
          header: str | None, groups: Mapping[str, ModelGroup] = NO_GROUPS) -> Route:
    """The Route of a request on the endpoint of `kind` naming `model`."""
    if header:
        return _to(providers, header, model, f"{PROFILE_HEADER}: {header}")
    group = groups.get(model)
    if group is not None:
        return Route(model, model, group.kind)
    if model in http.routes:
        return _to(providers, http.routes[model], model, f"route of {model!r}")
    profile, slash, rest = model.partition("/")
    if slash and profile in providers:
        return _to(providers, profile, rest, f"model {model!r}")
    of_kind = sorted(name for name, p in providers.items() if p.kind == kind)
    if len(of_kind) == 1:
        return _to(providers, of_kind[0], model, "")
    if not of_kind and len(providers) == 1:
        return _to(providers, next(iter(providers)), model, "")
    raise NoRoute(f"model {model!r}: no [http] route, not PROFILE/MODEL, and "
                  f"{len(of_kind)} {kind} profiles ({', '.join(of_kind) or 'none'}) of "
                  f"{len(providers)}; name one in the model (PROFILE/MODEL) or the "
                  f"{PROFILE_HEADER} header")


def _to(providers: dict[str, ProviderProfile], name: str, model: str, why: str) -> Route:
    profile = providers.get(name)
    if profile is None:
        raise NoRoute(f"{why}: no provider profile {name!r}")
    return Route(name, model, profile.kind)


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
