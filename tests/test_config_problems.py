"""A config's problems, all at once (issue 31, item 5): every problem of a
file and of the environment in one error, each naming the file, the key and
the reason; "did you mean" for a misspelt table, key or profile; the
STREAMFENCE_* variables known in one place; and README's configuration
blocks showing the code's defaults. Pure functions; the daemon's side
(`serve` printing each problem, the start's warning) is in
tests/test_config_daemon.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from streamfence.cli.status_view import status_header, uptime_text
from streamfence.config.environment import ENV_CONFIG, OTHERS, known_variables, unknown_variables
from streamfence.config.identities import _KEYS as IDENTITY_KEYS
from streamfence.config.identities import identity_named
from streamfence.config.model import (
    DAEMON_KEYS,
    ENV_PREFIX,
    ConfigError,
    DaemonConfig,
    ProviderProfile,
    load_config,
    parse_config,
)
from streamfence.config.problems import unknown

ROOT = Path(__file__).resolve().parent.parent
MANY = """\
endpoint = "tcp://127.0.0.1:7800"

[daemon]
log_levl = "debug"
workers_max = 0
stale_timeout_s = 30

[provders.extra]
kind = "openai"

[providers.openai]
kind = "opena"
stale_timout_s = 60
base_url = "api.openai.com/v1"

[identities.alice]
providers = ["opneai"]
max_in_flight = -1

[http]
routes = { "gpt-4o" = "openia" }
"""


def _problems(text: str, tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    path = tmp_path / "f.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), env=env or {})
    assert str(caught.value) == "; ".join(caught.value.problems)  # one line, for a log
    return [p.removeprefix(f"{path}: ") for p in caught.value.problems]


def test_every_problem_of_a_file_is_named_at_once(tmp_path: Path) -> None:
    assert _problems(MANY, tmp_path) == [
        "endpoint: unknown table here (endpoint belongs in [daemon])",
        "provders: unknown table (did you mean 'providers'?)",
        "daemon.log_levl: unknown key (did you mean 'log_level'?)",
        "daemon.stale_timeout_s: unknown key here (stale_timeout_s belongs in "
        "[providers.NAME])",
        "daemon.workers_max: must be >= 1",
        "providers.openai.stale_timout_s: unknown key (did you mean 'stale_timeout_s'?)",
        "providers.openai.kind: must be one of openai, anthropic, bedrock, got 'opena' "
        "(did you mean 'openai'?)",
        "providers.openai.base_url: must be an http:// or https:// URL with a host, got "
        "'api.openai.com/v1'",
        "identities.alice.max_in_flight: must be a number >= 0, got -1",
        "identities.alice.providers: no provider profile 'opneai' (did you mean 'openai'?)",
        "http.routes.gpt-4o: no provider profile 'openia' (did you mean 'openai'?)",
    ]


def test_the_environments_problems_come_with_the_files(tmp_path: Path) -> None:
    env = {"STREAMFENCE_WORKERS_SPARE": "many", "STREAMFENCE_LOG_JSON": "maybe",
           "STREAMFENCE_AUTH": "CURVE", "STREAMFENCE_LOG_LEVEL": "loud"}
    found = _problems('[daemon]\nqueue_max = "10"\n', tmp_path, env)
    assert found == [
        "daemon.queue_max: expected int, got str",
        "environment STREAMFENCE_WORKERS_SPARE: expected int, got 'many'",
        "environment STREAMFENCE_LOG_LEVEL: must be one of DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL (any case), got 'loud'",
        "environment STREAMFENCE_LOG_JSON: expected a boolean (1, true, yes, on, 0, false, "
        "no, off), got 'maybe'",
        "environment STREAMFENCE_AUTH: must be one of curve, none, got 'CURVE'"]


def test_a_problem_is_named_once() -> None:
    """A key of the wrong type is not also judged on its value, and a profile
    with a problem is not also "no provider profile" where it is named."""
    data = {"providers": {"p": {"kind": 3}}, "identities": {"a": {"providers": ["p"]}},
            "cluster": {"urls": "nats://h:4222", "host": 7}}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "f.toml")
    assert list(caught.value.problems) == [
        "f.toml: providers.p.kind: expected str, got int",
        "f.toml: cluster.urls: expected list, got str",
        "f.toml: cluster.host: expected str, got int"]


def test_a_valid_file_loads_and_remembers_where_it_came_from(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text('[daemon]\nlog_level = "debug"\n[providers.p]\nkind = "openai"\n')
    cfg = load_config(str(path), env={"STREAMFENCE_LOG_JSON": "on"})
    assert (cfg.log_level, cfg.log_json, cfg.config_path) == ("DEBUG", True, str(path))
    assert load_config(None, env={}).config_path is None


def test_unknown_words_its_hint() -> None:
    assert unknown("f: daemon.x", "x", ("a", "b")) == "f: daemon.x: unknown key (one of a, b)"
    assert unknown("f: t", "tabel", ("table",), "table") == \
        "f: t: unknown table (did you mean 'table'?)"


# ---- STREAMFENCE_* variables ----------------------------------------------------------

def test_an_unknown_variable_is_named_with_the_one_it_resembles() -> None:
    cfg = parse_config({"providers": {"p": {"kind": "openai",
                                            "api_key_env": "STREAMFENCE_OPENAI_KEY"}}})
    env = {"STREAMFENCE_WORKER_MAX": "4", "STREAMFENCE_ZZZ": "1", "STREAMFENCE_OPENAI_KEY": "k",
           "STREAMFENCE_ENDPOINT": "tcp://127.0.0.1:7800", ENV_CONFIG: "x.toml",
           "PATH": "/bin", "OTHER_STREAMFENCE_X": "1"}
    assert unknown_variables(env, cfg) == [
        "environment STREAMFENCE_WORKER_MAX: streamfence reads no such variable (did you "
        "mean STREAMFENCE_WORKERS_MAX?); it is ignored",
        "environment STREAMFENCE_ZZZ: streamfence reads no such variable; it is ignored"]


# Names that are examples, not variables streamfence reads: a password_env
# value (known when the config names it) and the typo environment.py shows.
EXAMPLES = {"STREAMFENCE_NATS_PASSWORD", "STREAMFENCE_WORKER_MAX"}


def test_every_variable_the_code_and_docs_name_is_known() -> None:
    """The one list (config/environment.py) holds every STREAMFENCE_* name
    the code, the scripts and the docs use; the [daemon] keys' are all in it."""
    known = known_variables(DaemonConfig())
    assert {ENV_PREFIX + k.upper() for k in DAEMON_KEYS} | set(OTHERS) == known
    files = [*(ROOT / "streamfence").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"),
             ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    named: dict[str, str] = {}
    for path in files:
        for name in re.findall(r"STREAMFENCE_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            named.setdefault(name, str(path.relative_to(ROOT)))
    stray = {n: where for n, where in named.items() if n not in known | EXAMPLES}
    assert not stray, f"STREAMFENCE_* names that config/environment.py does not know: {stray}"


# ---- README's configuration section ---------------------------------------------------

def _readme_blocks() -> list[tuple[str, dict[str, Any]]]:
    """README's configuration section's TOML blocks: (text, parsed)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Configuration\n"):]
    section = section[:section.index("\n## ", 1)]
    return [(block, tomllib.loads(block))
            for block in re.findall(r"```toml\n(.*?)```", section, re.S)]


def test_readme_shows_the_defaults_as_defaults() -> None:
    """Its [daemon] block is every key at its default; its [identities.alice]
    block is the defaults of an identity (`providers` commented: all); in its
    provider examples, a key that has a default shows it."""
    blocks = _readme_blocks()
    daemon = next(parsed["daemon"] for _, parsed in blocks if "daemon" in parsed)
    assert set(daemon) == set(DAEMON_KEYS)
    cfg, defaults = parse_config({"daemon": daemon}), DaemonConfig()
    for key in DAEMON_KEYS:
        assert getattr(cfg, key) == getattr(defaults, key), key
    text, identities = next((t, p) for t, p in blocks if "identities" in p)
    cfg = parse_config({"providers": {"openai": {"kind": "openai"}}, **identities})
    assert cfg.identities["alice"] == identity_named("alice", {})
    for key in IDENTITY_KEYS:  # every key shown, set or commented
        assert re.search(rf"^(# )?{key} = ", text, re.M), key
    bare = ProviderProfile("x", "openai")
    shown = 0
    for _, parsed in blocks:
        for name, table in parsed.get("providers", {}).items():
            for key, value in table.items():
                if key != "kind" and getattr(bare, key) is not None:
                    assert value == getattr(bare, key), (name, key)
                    shown += 1
    assert shown >= 3  # max_attempts, connect_timeout_s, read_timeout_s


# ---- the status header ----------------------------------------------------------------

def test_the_status_header() -> None:
    reply = {"version": "1.2.3", "uptime_s": 3723.5, "config_path": "/etc/sf.toml",
             "state_dir": "/var/lib/sf"}
    assert status_header(reply) == ("streamfence 1.2.3, up 1h 02m 03s, config /etc/sf.toml, "
                                    "state dir /var/lib/sf")
    assert "config none (the built-in defaults)" in str(status_header(
        dict(reply, config_path=None)))
    assert status_header({"identity": "alice", "role": "client", "calls": {}}) is None
    assert [uptime_text(s) for s in (7.25, 306, 93784)] == ["7.2s", "5m 06s", "1d 02h 03m"]


def test_the_pools_half_life_must_be_above_zero(tmp_path: Path) -> None:
    text = "[daemon]\nworkers_peak_half_life_s = 0\nworkers_refill_wait_s = 0\n"
    assert _problems(text, tmp_path) == ["daemon.workers_peak_half_life_s: must be > 0"]
    assert _problems("", tmp_path, {"STREAMFENCE_WORKERS_PEAK_HALF_LIFE_S": "0"}) == [
        "environment STREAMFENCE_WORKERS_PEAK_HALF_LIFE_S: must be > 0"]
