"""Model groups: `[groups.NAME]` tables, each a public model name served by
an ordered or weighted list of deployments, each deployment a provider
profile and the model it is asked for (README, "Model groups"):

    [groups.smart]
    strategy = "ordered"        # or "weighted", "least_in_flight"
    max_attempts = 4            # default: the largest of its profiles', at
                                # least one attempt per deployment
    deployments = [
        {profile = "openai_a", model = "gpt-4o"},
        {profile = "openai_b", model = "gpt-4o", weight = 2},  # weighted only
    ]

A submit (or an HTTP model name) may name a group where a profile goes; the
supervisor picks a deployment per attempt (supervisor/deployments.py). The
request goes as it is to each deployment, its model replaced, so every
deployment of a group is of one provider kind. A group's name is no
profile's. Problems are added to the caller's list, each naming the file,
the key and the reason (model.py gathers them into one ConfigError).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from streamfence.config.problems import did_you_mean, unknown

STRATEGIES = ("ordered", "weighted", "least_in_flight")
GROUP_KEYS = ("strategy", "deployments", "max_attempts")
DEPLOYMENT_KEYS = ("profile", "model", "weight")


class _Profile(Protocol):
    """What a group needs of a provider profile (config.model.ProviderProfile)."""

    @property
    def kind(self) -> str: ...

    @property
    def max_attempts(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Deployment:
    profile: str  # a [providers.NAME] profile
    model: str  # the model name the request is sent with
    weight: int = 1  # a weighted group's share


@dataclass(frozen=True, slots=True)
class ModelGroup:
    name: str
    kind: str  # every deployment's profile's kind
    strategy: str
    deployments: tuple[Deployment, ...]
    max_attempts: int


def parse_groups(tables: Any, where: str, profiles: Mapping[str, _Profile],
                 declared: Collection[str], problems: list[str],
                 homes: Mapping[str, str]) -> dict[str, ModelGroup]:
    """The valid `[groups.NAME]` tables. `profiles`: the valid profiles;
    `declared`: every profile named in the file, valid or not (a reference to
    an invalid one is not named again: its own problem is)."""
    if not isinstance(tables, dict):
        problems.append(f"{where}: must be a table of tables ([groups.NAME])")
        return {}
    groups = {}
    for name, table in tables.items():
        group = _parse_group(name, table, f"{where}.{name}", profiles, declared, problems,
                             homes)
        if group is not None:
            groups[name] = group
    return groups


def _parse_group(name: str, table: Any, at: str, profiles: Mapping[str, _Profile],
                 declared: Collection[str], problems: list[str],
                 homes: Mapping[str, str]) -> ModelGroup | None:
    if not isinstance(table, dict):
        problems.append(f"{at}: must be a table")
        return None
    found = len(problems)
    if name in declared:
        problems.append(f"{at}: a provider profile is named {name!r} too; a group's name "
                        f"must differ from every profile's (a submit names either)")
    for key in sorted(set(table) - set(GROUP_KEYS)):
        problems.append(unknown(f"{at}.{key}", key, GROUP_KEYS, elsewhere=homes))
    strategy = table.get("strategy", STRATEGIES[0])
    if strategy not in STRATEGIES:
        hint = did_you_mean(strategy, STRATEGIES) if isinstance(strategy, str) else ""
        problems.append(f"{at}.strategy: must be one of {', '.join(STRATEGIES)}, "
                        f"got {strategy!r}{hint}")
    max_attempts = table.get("max_attempts")
    if max_attempts is not None and (isinstance(max_attempts, bool) or not isinstance(
            max_attempts, int) or not 1 <= max_attempts <= 100):
        problems.append(f"{at}.max_attempts: must be a whole number from 1 to 100, "
                        f"got {max_attempts!r}")
    deployments = _parse_deployments(table.get("deployments"), f"{at}.deployments",
                                     strategy == "weighted", declared, problems)
    if len(problems) > found or not all(d.profile in profiles for d in deployments):
        return None
    kinds = {d.profile: profiles[d.profile].kind for d in deployments}
    if len(set(kinds.values())) > 1:
        mixed = ", ".join(f"{p}: {k}" for p, k in kinds.items())
        problems.append(f"{at}.deployments: mixes provider kinds ({mixed}); a group's "
                        f"deployments must be of one kind (the request goes to each as it "
                        f"came, its model replaced)")
        return None
    if max_attempts is None:
        max_attempts = max(len(deployments), *(profiles[p].max_attempts for p in kinds))
    return ModelGroup(name, next(iter(kinds.values())), strategy, deployments, max_attempts)


def _parse_deployments(value: Any, at: str, weighted: bool, declared: Collection[str],
                       problems: list[str]) -> tuple[Deployment, ...]:
    if not isinstance(value, list) or not value:
        problems.append(f"{at}: must be a non-empty list of {{profile = \"NAME\", model = "
                        f"\"MODEL\"}} tables, got {value!r}")
        return ()
    out: list[Deployment] = []
    for i, item in enumerate(value):
        where = f"{at}[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where}: must be a table {{profile = \"NAME\", model = "
                            f"\"MODEL\"}}, got {item!r}")
            continue
        for key in sorted(set(item) - set(DEPLOYMENT_KEYS)):
            problems.append(unknown(f"{where}.{key}", key, DEPLOYMENT_KEYS))
        profile, model, weight = item.get("profile"), item.get("model"), item.get("weight", 1)
        if not isinstance(profile, str) or profile not in declared:
            hint = did_you_mean(profile, declared) if isinstance(profile, str) else ""
            problems.append(f"{where}.profile: no provider profile {profile!r}{hint}")
        if not isinstance(model, str) or not model:
            problems.append(f"{where}.model: must be a non-empty string (the model the "
                            f"deployment is asked for), got {model!r}")
        if "weight" in item and not weighted:
            problems.append(f"{where}.weight: only a weighted group (strategy = "
                            f"\"weighted\") uses weights")
        elif isinstance(weight, bool) or not isinstance(weight, int) or not \
                1 <= weight <= 1000:
            problems.append(f"{where}.weight: must be a whole number from 1 to 1000, "
                            f"got {weight!r}")
        if isinstance(profile, str) and isinstance(model, str) and model:
            deployment = Deployment(profile, model, weight if isinstance(weight, int) else 1)
            if any((d.profile, d.model) == (profile, model) for d in out):
                problems.append(f"{where}: repeats the deployment ({profile}, {model})")
            out.append(deployment)
    return tuple(out)


def may_use(providers: frozenset[str] | None, group: ModelGroup) -> bool:
    """An identity's `providers` allow-list (None: everything) lets it use a
    group it names, or one whose every deployment's profile it may use (the
    group gives it nothing it could not ask each profile for itself)."""
    return providers is None or group.name in providers or all(
        d.profile in providers for d in group.deployments)


P = TypeVar("P", bound=_Profile)


def resolve(name: str, profiles: Mapping[str, P], groups: Mapping[str, ModelGroup]
            ) -> tuple[P, ModelGroup | None] | None:
    """What a submit's `provider` names: a profile (and no group), or a group
    and its first deployment's profile (a call's until its first attempt
    chooses); None: neither."""
    profile = profiles.get(name)
    if profile is not None:
        return profile, None
    group = groups.get(name)
    if group is None:
        return None
    return profiles[group.deployments[0].profile], group
