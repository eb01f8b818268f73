"""Model groups (issue 33, item 2), the pure parts: a `[groups.NAME]`
table's problems, each naming the file, the key and the reason; and the
choice of each attempt's deployment (supervisor/deployments.py) over real
breakers and live calls, with the clock passed in. The daemon's side is in
tests/test_groups_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamfence.config.groups import Deployment, ModelGroup
from streamfence.config.model import ConfigError, DaemonConfig, load_config
from streamfence.gateway.routes import Route, models, route
from streamfence.protocol.errors import ErrorCode
from streamfence.supervisor.admission import Admission
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call
from streamfence.supervisor.deployments import Router
from streamfence.supervisor.dispatch import run_attempt
from streamfence.supervisor.fallbacks import Fallbacks
from streamfence.supervisor.livecalls import LiveCalls
from streamfence.supervisor.recovery import make_call
from streamfence.supervisor.reload import compare

PROFILES = """
[providers.oa]
kind = "openai"
stale_timeout_s = 7
[providers.ob]
kind = "openai"
max_attempts = 5
[providers.an]
kind = "anthropic"
[providers.br]
kind = "bedrock"
"""


def _load(tmp_path: Path, groups: str) -> DaemonConfig:
    path = tmp_path / "f.toml"
    path.write_text(groups + "\n" + PROFILES)
    return load_config(str(path), env={})


def _problems(tmp_path: Path, groups: str) -> list[str]:
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, groups)
    return [p.removeprefix(f"{tmp_path / 'f.toml'}: ") for p in error.value.problems]


def test_a_group_parses_with_its_kind_and_default_attempts(tmp_path: Path) -> None:
    cfg = _load(tmp_path, """
[groups.smart]
deployments = [{profile = "oa", model = "gpt-4o"}, {profile = "ob", model = "gpt-4o"}]
[groups.spread]
strategy = "weighted"
max_attempts = 2
deployments = [{profile = "oa", model = "m"}, {profile = "ob", model = "m", weight = 3}]
[identities.alice]
providers = ["smart"]
""")
    assert cfg.groups["smart"] == ModelGroup(
        "smart", "openai", "ordered",
        (Deployment("oa", "gpt-4o"), Deployment("ob", "gpt-4o")), 5)  # ob's max_attempts
    assert cfg.groups["spread"].deployments[1].weight == 3
    assert cfg.groups["spread"].max_attempts == 2


@pytest.mark.parametrize("groups,problem", [
    ("[groups.mix]\ndeployments = [{profile = \"oa\", model = \"m\"}, "
     "{profile = \"an\", model = \"c\"}]",
     "groups.mix.deployments: mixes provider kinds (oa: openai, an: anthropic)"),
    ("[groups.oa]\ndeployments = [{profile = \"ob\", model = \"m\"}]",
     "groups.oa: a provider profile is named 'oa' too"),
    ("[groups.g]\ndeployments = [{profile = \"obb\", model = \"m\"}]",
     "groups.g.deployments[0].profile: no provider profile 'obb' (did you mean 'ob'?)"),
    ("[groups.g]\ndeployments = []", "groups.g.deployments: must be a non-empty list"),
    ("[groups.g]\ndeployments = [{profile = \"oa\"}]",
     "groups.g.deployments[0].model: must be a non-empty string"),
    ("[groups.g]\nstrategy = \"wieghted\"\ndeployments = [{profile = \"oa\", model = \"m\"}]",
     "groups.g.strategy: must be one of ordered, weighted, least_in_flight, got 'wieghted' "
     "(did you mean 'weighted'?)"),
    ("[groups.g]\ndeployments = [{profile = \"oa\", model = \"m\", weight = 2}]",
     "groups.g.deployments[0].weight: only a weighted group"),
    ("[groups.g]\nstrategy = \"weighted\"\ndeployments = [{profile = \"oa\", model = \"m\", "
     "weight = 0}]", "groups.g.deployments[0].weight: must be a whole number from 1 to 1000"),
    ("[groups.g]\ndeployments = [{profile = \"oa\", model = \"m\"}, "
     "{profile = \"oa\", model = \"m\"}]", "groups.g.deployments[1]: repeats the deployment"),
    ("[groups.g]\nmax_attempt = 2\ndeployments = [{profile = \"oa\", model = \"m\"}]",
     "groups.g.max_attempt: unknown key (did you mean 'max_attempts'?)"),
    ("[groups.g]\ndeployments = [{profile = \"oa\", model = \"m\"}]\n[identities.bob]\n"
     "providers = [\"gg\"]",
     "identities.bob.providers: no provider profile or group 'gg' (did you mean 'g'?)"),
    ("groups = 3", "groups: must be a table of tables"),
])
def test_a_bad_group_is_named_with_its_key_and_reason(tmp_path: Path, groups: str,
                                                      problem: str) -> None:
    problems = _problems(tmp_path, groups)
    assert any(p.startswith(problem) for p in problems), problems


def test_a_reload_names_a_changed_group(tmp_path: Path) -> None:
    old = _load(tmp_path, "[groups.g]\ndeployments = [{profile = \"oa\", model = \"m\"}]")
    new = _load(tmp_path, "[groups.g]\ndeployments = [{profile = \"ob\", model = \"m\"}]\n"
                          "[groups.h]\ndeployments = [{profile = \"br\", model = \"b\"}]")
    assert compare(old, new).lines() == ["reload: groups: added h; changed g (deployments, "
                                         "max_attempts)"]


# ---- the choice of each attempt's deployment ---------------------------------------------

class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(tmp_path: Path, strategy: str, weights: str = "") -> tuple[
        DaemonConfig, Breakers, LiveCalls, Router, Clock]:
    cfg = _load(tmp_path, f"""
[groups.g]
strategy = "{strategy}"
deployments = [{{profile = "oa", model = "m1" {weights and ", weight = 1"}}},
               {{profile = "ob", model = "m2" {weights and ", weight = 2"}}},
               {{profile = "oa", model = "m3" {weights and ", weight = 1"}}}]
""")
    clock = Clock()
    breakers = Breakers(1, 60.0, clock)
    calls = LiveCalls(0)
    return cfg, breakers, calls, Router(breakers, calls), clock


def _call(cfg: DaemonConfig, n: int = 0, session: str | None = None) -> Call:
    return make_call(f"c{n}", "local", "g", cfg.providers, cfg.groups,
                     {"model": "g", "messages": []}, {}, session, None, None, 0, 0)


def _attempts(router: Router, call: Call, n: int) -> list[str | None]:
    picked = []
    for _ in range(n):
        router.choose(call)
        picked.append(call.model)
    return picked


def test_ordered_moves_to_the_next_and_skips_an_open_breaker(tmp_path: Path) -> None:
    cfg, breakers, _, router, clock = _setup(tmp_path, "ordered")
    call = _call(cfg)
    assert call.profile.name == "oa" and call.timeouts.stale_s == 7.0  # before any choice
    assert _attempts(router, call, 2) == ["m1", "m2"]
    assert call.profile.name == "ob" and call.timeouts.stale_s == 180.0  # ob's own timeouts
    assert _attempts(router, call, 2) == ["m3", "m1"]  # a new round, from the top
    breakers.on_stale(("-", "oa"))  # threshold 1: open for 60 s
    assert _attempts(router, _call(cfg, 1), 2) == ["m2", "m2"]  # oa's two are skipped
    assert _attempts(router, _call(cfg, 2, session="other"), 1) == ["m1"]  # per session
    clock.now = 61.0  # half-open: one probe goes to oa, and it takes the probe
    assert _attempts(router, _call(cfg, 3), 1) == ["m1"]
    assert _attempts(router, _call(cfg, 4), 1) == ["m2"]
    breakers.on_stale(("-", "ob"))  # every one blocked: the group goes on as a profile would
    assert _attempts(router, _call(cfg, 5), 1) == ["m1"]


def test_weighted_is_smooth_round_robin_exactly(tmp_path: Path) -> None:
    cfg, _, _, router, _ = _setup(tmp_path, "weighted", weights="yes")
    picked = [_attempts(router, _call(cfg, n), 1)[0] for n in range(8)]
    assert picked == ["m2", "m1", "m3", "m2"] * 2


def test_least_in_flight_counts_calls_per_deployment_until_they_end(tmp_path: Path) -> None:
    cfg, _, calls, router, _ = _setup(tmp_path, "least_in_flight")
    first, second, third = (_call(cfg, n) for n in range(3))
    for call in (first, second, third):
        calls.add(call)
        router.choose(call)
    assert [c.model for c in (first, second, third)] == ["m1", "m2", "m3"]
    calls.remove(second)  # done: m2 has none now
    fourth = _call(cfg, 4)
    calls.add(fourth)
    router.choose(fourth)
    assert fourth.model == "m2"
    router.choose(first)  # its retry: away from m1, to the least loaded untried
    assert first.model == "m2" and calls.on_deployment(Deployment("oa", "m1")) == 0


def test_the_request_goes_with_the_deployments_model(tmp_path: Path) -> None:
    cfg, _, _, router, _ = _setup(tmp_path, "ordered")
    call = _call(cfg)
    router.choose(call)
    call.token = 1
    run = run_attempt(call, Fallbacks(Clock()))
    assert run.request["model"] == "m1" and run.profile["name"] == "oa"
    assert call.spec.request["model"] == "g"  # the call's own request is untouched


def test_the_gateway_routes_a_group_from_either_endpoint_and_lists_it(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "[groups.g]\ndeployments = [{profile = \"oa\", model = \"m\"}, "
                          "{profile = \"ob\", model = \"m\"}]")
    assert route(cfg.http, cfg.providers, "openai", "g", None, cfg.groups) == Route(
        "g", "g", "openai")
    # From the other endpoint too: the gateway translates to the group's kind.
    assert route(cfg.http, cfg.providers, "anthropic", "g", None, cfg.groups) == Route(
        "g", "g", "openai")
    assert ("g", "group") in models(cfg.http, cfg.providers, None, cfg.groups)
    assert ("g", "group") in models(cfg.http, cfg.providers, frozenset({"oa", "ob"}), cfg.groups)
    assert ("g", "group") in models(cfg.http, cfg.providers, frozenset({"g"}), cfg.groups)
    assert ("g", "group") not in models(cfg.http, cfg.providers, frozenset({"oa"}), cfg.groups)


def test_a_group_is_refused_breaker_open_only_when_every_profile_is(tmp_path: Path) -> None:
    cfg, breakers, _, _, _ = _setup(tmp_path, "ordered")
    admission = Admission(cfg, None, None, breakers, Clock(), lambda owner, key: None)  # type: ignore[arg-type]
    spec = _call(cfg, session="s").spec
    breakers.on_stale(("s", "oa"))
    assert admission._breaker_open(spec) is None  # ob's is closed
    breakers.on_stale(("s", "ob"))
    refusal = admission._breaker_open(spec)
    assert refusal is not None and refusal.code is ErrorCode.BREAKER_OPEN
    assert "session 's' on every profile of group 'g' (oa, ob)" in refusal.message
