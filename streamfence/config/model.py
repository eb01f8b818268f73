"""Daemon configuration: a TOML file with a [daemon] table, one
[providers.NAME] table per provider profile and one [groups.NAME] table
per model group (config/groups.py), overridable by environment
variables (STREAMFENCE_<KEY> for daemon keys, e.g. STREAMFENCE_ENDPOINT).

An invalid file fails at start with every problem it has, each naming the
file, the key and the reason (`ConfigError`): the parsers gather problems
in a list rather than stop at the first. Credentials are never in the file: a profile names the
environment variable that holds its key (`api_key_env`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlparse

from streamfence.cluster.settings import NatsAuth, NatsTls
from streamfence.config.groups import GROUP_KEYS, ModelGroup, parse_groups
from streamfence.config.identities import _KEYS as IDENTITY_KEYS
from streamfence.config.identities import Identity, parse_identities
from streamfence.config.prices import Price, parse_prices
from streamfence.config.problems import did_you_mean, typed, unknown
from streamfence.config.sections import (
    CLUSTER_TYPES,
    HTTP_KEYS,
    http_port_problem,
    is_loopback,
    parse_cluster,
    parse_http,
)
from streamfence.config.tracing import TRACING_TYPES, TracingConfig, parse_tracing

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7755"
DEFAULT_IN_FLIGHT_BYTES_MAX = 256 * 1024 * 1024
KINDS = ("openai", "anthropic", "bedrock")


P = ParamSpec("P")
T = TypeVar("T")


class ConfigError(Exception):
    """One or more problems of a config, each naming the file, the key and
    the reason: `problems` one by one (a terminal shows one a line), `str()`
    all on one line (for a log line)."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ProviderProfile:
    name: str
    kind: str
    base_url: str | None = None
    endpoint_url: str | None = None
    api_key_env: str | None = None
    region: str | None = None
    stale_timeout_s: float | None = None  # None: the implicit default (see timeouts.py)
    first_chunk_timeout_s: float | None = None
    max_attempts: int = 3
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 120.0
    aws_credentials: str | None = None  # bedrock: "chain" (default) or "dummy" (test endpoints)
    aws_profile: str | None = None  # bedrock: a named profile of the AWS config files

    @property
    def is_local(self) -> bool:
        return is_loopback(urlparse(self.base_url or self.endpoint_url or "").hostname or "")

    def to_map(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The `[cluster]` table: hosts sharing a NATS JetStream cluster
    (docs/ARCHITECTURE.md §4.17). No `urls`: single-host mode."""

    urls: tuple[str, ...] = ()  # the NATS servers (nats:// or tls://), any of the cluster's
    host: str = ""  # this host's name: unique in the cluster
    replicas: int = 3  # JetStream replicas of every stream and bucket
    lease_s: float = 5.0  # a host silent this long has lost its calls
    timeout_s: float = 5.0  # per JetStream request; bounds the first connect too
    auth: NatsAuth = field(default_factory=NatsAuth)  # [cluster.auth]
    tls: NatsTls = field(default_factory=NatsTls)  # [cluster.tls]

    @property
    def enabled(self) -> bool:
        return bool(self.urls)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The `[http]` table: the gateway's OpenAI- and Anthropic-compatible
    endpoints (docs/ARCHITECTURE.md §4.16). No `listen`: no gateway."""

    listen: str | None = None  # "HOST:PORT", loopback only (the gateway speaks plain HTTP)
    routes: dict[str, str] = field(default_factory=dict)  # model name -> profile

    @property
    def host_port(self) -> tuple[str, int]:
        assert self.listen is not None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    endpoint: str = DEFAULT_ENDPOINT
    state_dir: str = "./streamfence-state"
    max_frame_bytes: int = 16 * 1024 * 1024
    workers_max: int = 64
    workers_spare: int = 2  # warm idle workers beyond the load's recent peak (~11 MiB each)
    # Spare forks wait (at most this long) while attempts start: a burst's
    # first requests get the cores (supervisor/pool.py). 0: forked at once.
    workers_refill_wait_s: float = 1.0
    # After a burst the pool keeps its workers, their number above
    # workers_spare halving every this many seconds.
    workers_peak_half_life_s: float = 30.0
    queue_max: int = 10_000
    # Client connections at once (curve: past it, new handshakes are refused
    # at ZAP; a connection that never finishes its handshake is closed by
    # libzmq after 30 s). 0: no cap.
    max_connections: int = 10_000
    # Total size of the requests of the calls accepted and not done (queued
    # or running); a submit that would pass it is refused `overloaded`. 0: no limit.
    in_flight_bytes_max: int = DEFAULT_IN_FLIGHT_BYTES_MAX
    backoff_base_s: float = 1.0
    backoff_max_s: float = 4.0
    breaker_threshold: int = 5
    breaker_cooldown_s: float = 60.0
    stop_grace_s: float = 30.0
    log_level: str = "INFO"
    log_json: bool = False
    # The log's file instead of stderr ("": stderr); a new file once it holds
    # log_file_max_bytes (0: never), keeping log_file_backups old ones.
    log_file: str = ""
    log_file_max_bytes: int = 50 * 1024 * 1024
    log_file_backups: int = 5
    auth: str = "curve"  # "curve" (CURVE + ZAP) or "none" (ipc:// or loopback only)
    retention_days: float = 0.0  # finished calls older than this are pruned; 0: keep
    providers: dict[str, ProviderProfile] = field(default_factory=dict)
    groups: dict[str, ModelGroup] = field(default_factory=dict)
    identities: dict[str, Identity] = field(default_factory=dict)
    prices: dict[str, Price] = field(default_factory=dict)  # config/prices.py
    http: HttpConfig = field(default_factory=HttpConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Not a key: the file this was loaded from (absolute); None: the defaults.
    config_path: str | None = None

    def runtime_dir(self) -> str:
        """Where the ipc sockets live: `run/` under state_dir when the path is
        short enough for a unix socket (~107 bytes), else one directory per
        state dir under the temp dir, named for the state dir's path (so a
        restart, or a tool, finds the same one). A path only: the supervisor
        makes and checks it (streamfence.supervisor.runtimedir)."""
        state_dir = os.path.abspath(self.state_dir)
        candidate = os.path.join(state_dir, "run")
        if len(candidate) + len("/sink.ctl") < 100:
            return candidate
        digest = hashlib.sha256(state_dir.encode(errors="surrogateescape")).hexdigest()[:16]
        name = f"streamfence-{os.geteuid()}-{digest}"
        base = tempfile.gettempdir()
        if len(os.path.join(base, name, "sink.stream")) >= 100:
            base = "/tmp"  # a $TMPDIR too long for a unix socket under it
        return os.path.join(base, name)


_DAEMON_TYPES: dict[str, tuple[type, ...]] = {
    "endpoint": (str,), "state_dir": (str,), "max_frame_bytes": (int,), "workers_max": (int,),
    "workers_spare": (int,), "workers_refill_wait_s": (int, float),
    "workers_peak_half_life_s": (int, float), "queue_max": (int,), "in_flight_bytes_max": (int,),
    "max_connections": (int,),
    "backoff_base_s": (int, float), "backoff_max_s": (int, float), "breaker_threshold": (int,),
    "breaker_cooldown_s": (int, float), "stop_grace_s": (int, float), "log_level": (str,),
    "log_json": (bool,), "log_file": (str,), "log_file_max_bytes": (int,),
    "log_file_backups": (int,), "auth": (str,), "retention_days": (int, float),
}
_AT_LEAST_ONE = ("workers_max", "workers_spare", "log_file_backups")  # 0 is not a value
_ABOVE_ZERO = ("workers_peak_half_life_s",)  # a half-life of 0 divides by it
DAEMON_KEYS = tuple(_DAEMON_TYPES)  # the [daemon] table's keys
ENV_PREFIX = "STREAMFENCE_"  # ENV_PREFIX + KEY.upper() overrides a [daemon] key
AUTH_MODES = ("curve", "none")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_PROFILE_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,), "base_url": (str,), "endpoint_url": (str,), "api_key_env": (str,),
    "region": (str,), "stale_timeout_s": (int, float), "first_chunk_timeout_s": (int, float),
    "max_attempts": (int,), "connect_timeout_s": (int, float), "read_timeout_s": (int, float),
    "aws_credentials": (str,), "aws_profile": (str,),
}
TABLES = ("daemon", "providers", "groups", "identities", "prices", "http", "cluster", "tracing")
# Where each key belongs, for a key written in the wrong table (problems.unknown).
_HOMES: dict[str, str] = {
    **{k: "[cluster]" for k in CLUSTER_TYPES}, **{k: "[tracing]" for k in TRACING_TYPES},
    **{k: "[http]" for k in HTTP_KEYS},
    **{k: "[identities.NAME]" for k in IDENTITY_KEYS}, **{k: "[groups.NAME]" for k in GROUP_KEYS},
    **{k: "[providers.NAME]" for k in _PROFILE_TYPES}, **{k: "[daemon]" for k in DAEMON_KEYS}}


def gather(problems: list[str], check: Callable[P, T], *args: P.args,
           **kwargs: P.kwargs) -> T | None:
    """`check(*args, **kwargs)`; None, with its problems added to `problems`,
    if it raised ConfigError: so that one load names every problem."""
    try:
        return check(*args, **kwargs)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def _table(data: dict[str, Any], name: str, where: str, problems: list[str]) -> dict[str, Any]:
    table = data.get(name, {})
    if isinstance(table, dict):
        return table
    problems.append(f"{where}: must be a table ([{name}])")
    return {}


def parse_config(data: dict[str, Any], source: str = "<config>") -> DaemonConfig:
    """The config a TOML document holds; ConfigError names every problem
    found, each with `source` (the file), the key and the reason."""
    problems: list[str] = []
    for name in data:
        if name not in TABLES:
            problems.append(unknown(f"{source}: {name}", name, TABLES, "table", _HOMES))
    daemon = _parse_daemon(_table(data, "daemon", f"{source}: daemon", problems), source,
                           problems)
    declared = _table(data, "providers", f"{source}: providers", problems)
    profiles = {name: parsed for name, table in declared.items()
                if (parsed := _parse_profile(name, table, f"{source}: providers.{name}",
                                             problems)) is not None}
    # References are judged against the profiles declared, valid or not: a
    # profile's own problem is named once, not again at each reference to it.
    groups = parse_groups(data.get("groups", {}), f"{source}: groups", profiles, declared,
                          problems, _HOMES)
    identities = parse_identities(data.get("identities", {}), f"{source}: identities",
                                  problems, _HOMES)
    named: dict[str, Any] = data["groups"] if isinstance(data.get("groups"), dict) else {}
    usable, what = {*declared, *named}, "provider profile or group" if named else \
        "provider profile"
    for ident in identities.values():
        for profile in sorted(ident.providers or ()):
            if profile not in usable:
                problems.append(f"{source}: identities.{ident.name}.providers: no {what} "
                                f"{profile!r}{did_you_mean(profile, usable)}")
    prices = parse_prices(data.get("prices", {}), f"{source}: prices", declared, problems)
    for ident in identities.values():
        if ident.spend_per_month and not prices:
            problems.append(f"{source}: identities.{ident.name}.spend_per_month: needs "
                            f"prices: no [prices.\"MODEL\"] table is configured")
    listen, routes = parse_http(_table(data, "http", f"{source}: http", problems),
                                f"{source}: http", declared, problems, _HOMES)
    cluster = parse_cluster(_table(data, "cluster", f"{source}: cluster", problems),
                            f"{source}: cluster", problems, _HOMES, ConfigError)
    tracing = parse_tracing(_table(data, "tracing", f"{source}: tracing", problems),
                            f"{source}: tracing", problems, _HOMES)
    cfg = DaemonConfig(providers=profiles, groups=groups, identities=identities, prices=prices,
                       http=HttpConfig(listen, routes), cluster=ClusterConfig(**cluster),
                       tracing=tracing, **daemon)
    found = len(problems)
    if "endpoint" in daemon:
        gather(problems, check_endpoint, f"{source}: daemon.endpoint", cfg.endpoint, cfg.auth)
    if len(problems) == found and (problem := http_port_problem(f"{source}: http.listen",
                                                                listen, cfg.endpoint)):
        problems.append(problem)
    if problems:
        raise ConfigError(*problems)
    return cfg


def _parse_daemon(table: dict[str, Any], source: str, problems: list[str]) -> dict[str, Any]:
    """The valid keys of `[daemon]`."""
    daemon = typed(table, f"{source}: daemon", _DAEMON_TYPES, problems, _HOMES)
    if "log_level" in daemon:
        level = gather(problems, _log_level, f"{source}: daemon.log_level", daemon.pop("log_level"))
        if level is not None:
            daemon["log_level"] = level
    if daemon.get("auth", AUTH_MODES[0]) not in AUTH_MODES:
        problems.append(f"{source}: daemon.auth: must be one of {', '.join(AUTH_MODES)}, "
                        f"got {daemon.pop('auth')!r}")
    for key in _AT_LEAST_ONE:
        if daemon.get(key) == 0:
            problems.append(f"{source}: daemon.{key}: must be >= 1")
            del daemon[key]
    for key in _ABOVE_ZERO:
        if daemon.get(key) == 0:
            problems.append(f"{source}: daemon.{key}: must be > 0")
            del daemon[key]
    return daemon


def _parse_profile(name: str, table: Any, where: str,
                   problems: list[str]) -> ProviderProfile | None:
    """`[providers.NAME]`; None (its problems added) if it has any."""
    if not isinstance(table, dict):
        problems.append(f"{where}: must be a table")
        return None
    found = len(problems)
    values = typed(table, where, _PROFILE_TYPES, problems, _HOMES)
    kind = values.get("kind")
    if kind not in KINDS and (kind is not None or "kind" not in table):  # else: its type
        problems.append(f"{where}.kind: must be one of {', '.join(KINDS)}" + (
            "" if kind is None else f", got {kind!r}{did_you_mean(kind, KINDS)}"))
    if values.get("max_attempts", 3) < 1:
        problems.append(f"{where}.max_attempts: must be at least 1")
    for key in ("base_url", "endpoint_url"):
        if key in values:
            gather(problems, _check_url, f"{where}.{key}", values[key])
    if len(problems) > found:
        return None
    return ProviderProfile(name=name, **values)


def _log_level(where: str, value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"{where}: must be one of {', '.join(LOG_LEVELS)} (any case), "
                          f"got {value!r}")
    return level


def _check_url(where: str, url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{where}: must be an http:// or https:// URL with a host, got {url!r}")


def check_endpoint(where: str, endpoint: str, auth: str) -> None:
    """`tcp://HOST:PORT` (PORT 1-65535) or `ipc://PATH`; a TCP bind to anything
    but loopback needs CURVE (docs/SECURITY.md)."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ConfigError(f"{where}: ipc:// needs a path")
        return
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{where}: must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: needs a port from 1 to 65535, got {endpoint!r}")
    if auth != "curve" and not is_loopback(host):
        raise ConfigError(f"{where}: {endpoint} is reachable from other hosts; set "
                          f"daemon.auth = \"curve\" (the default) or bind to 127.0.0.1")


def env_overrides(env: dict[str, str], problems: list[str]) -> dict[str, Any]:
    """The [daemon] keys `env` overrides (ENV_PREFIX + KEY, e.g.
    STREAMFENCE_ENDPOINT), each checked as in the file; the problems of the
    others added to `problems`."""
    changes: dict[str, Any] = {}
    for key, types in _DAEMON_TYPES.items():
        name = ENV_PREFIX + key.upper()
        raw = env.get(name)
        if raw is None:
            continue
        where, kind = f"environment {name}", types[0]
        value: Any = None
        if kind is bool:
            value = _BOOLS.get(raw.lower())
            if value is None:
                problems.append(f"{where}: expected a boolean ({', '.join(_BOOLS)}), "
                                f"got {raw!r}")
        else:
            try:
                value = kind(raw)
            except ValueError:
                problems.append(f"{where}: expected {kind.__name__}, got {raw!r}")
        if key == "log_level" and value is not None:
            value = gather(problems, _log_level, where, value)
        elif key == "auth" and value not in (None, *AUTH_MODES):
            # As in the file: a typo such as "CURVE" must not turn authentication off.
            problems.append(f"{where}: must be one of {', '.join(AUTH_MODES)}, got {value!r}")
            value = None
        elif isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            problems.append(f"{where}: must not be negative")
            value = None
        elif key in _AT_LEAST_ONE and value == 0:
            problems.append(f"{where}: must be >= 1")
            value = None
        elif key in _ABOVE_ZERO and value == 0:
            problems.append(f"{where}: must be > 0")
            value = None
        if value is not None:
            changes[key] = value
    return changes


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _with_env(cfg: DaemonConfig, changes: dict[str, Any], problems: list[str]) -> DaemonConfig:
    if not changes:
        return cfg
    cfg = replace(cfg, **changes)
    gather(problems, check_endpoint, f"environment {ENV_PREFIX}ENDPOINT", cfg.endpoint,
           cfg.auth)
    return cfg


def apply_env(cfg: DaemonConfig, env: dict[str, str]) -> DaemonConfig:
    """`cfg` with the [daemon] keys `env` overrides (`env_overrides`)."""
    problems: list[str] = []
    cfg = _with_env(cfg, env_overrides(env, problems), problems)
    if problems:
        raise ConfigError(*problems)
    return cfg


def load_config(path: str | None, env: dict[str, str] | None = None) -> DaemonConfig:
    """The config in the file at `path` (None: the defaults) with the
    environment's overrides; ConfigError names every problem of both."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{source}: file not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    problems: list[str] = []
    cfg = gather(problems, parse_config, data, source)
    changes = env_overrides(dict(os.environ) if env is None else env, problems)
    if cfg is not None:
        cfg = _with_env(cfg, changes, problems)
    if cfg is None or problems:
        raise ConfigError(*problems)
    return replace(cfg, config_path=None if path is None else os.path.abspath(path))
