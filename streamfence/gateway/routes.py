"""Which provider profile serves an HTTP request (README, "Use it from an
existing app"). In order:

1. the `X-Streamfence-Profile` header names it;
2. `[http] routes` maps the request's model name to it;
3. the model is written `PROFILE/MODEL`: PROFILE serves MODEL;
4. the config has one profile of the endpoint's kind: that one; else, when
   it has one profile at all, that one.

A profile of any kind may serve either endpoint: the `Route` carries the
target's `kind`, and the gateway translates the request to that wire when
it differs from the endpoint's (gateway/translate.py). Whether the identity
may use the profile is the daemon's to say (`unknown_provider`).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamfence.config.model import HttpConfig, ProviderProfile

PROFILE_HEADER = "X-Streamfence-Profile"


class NoRoute(Exception):
    """No profile serves the request (the message says what was looked at)."""


@dataclass(frozen=True, slots=True)
class Route:
    target: str  # the name submitted: a profile's
    model: str  # the model name sent to the provider
    kind: str  # the target's wire (openai, anthropic, bedrock): the request's, once translated


def route(http: HttpConfig, providers: dict[str, ProviderProfile], kind: str, model: str,
          header: str | None) -> Route:
    """The Route of a request on the endpoint of `kind` naming `model`."""
    if header:
        return _to(providers, header, model, f"{PROFILE_HEADER}: {header}")
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
           may_use: set[str] | None) -> list[tuple[str, str]]:
    """(model id, profile) pairs that `GET /v1/models` lists: the routes, and
    `PROFILE/*` for each profile (`may_use`: the identity's profiles, None: all)."""
    usable = {n for n in providers if may_use is None or n in may_use}
    listed = [(model, p) for model, p in sorted(http.routes.items()) if p in usable]
    return listed + [(f"{name}/*", name) for name in sorted(usable)]
