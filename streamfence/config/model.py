"""Daemon configuration: a TOML file with a [daemon] table and one
[providers.NAME] table per provider profile, overridable by environment
variables (STREAMFENCE_<KEY> for daemon keys, e.g. STREAMFENCE_ENDPOINT).

An invalid file fails at start with the file, the key and the reason
(`ConfigError`). Credentials are never in the file: a profile names the
environment variable that holds its key (`api_key_env`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlparse

from streamfence.cluster.settings import NatsAuth, NatsTls, parse_auth, parse_tls, shown_url
from streamfence.config.identities import Identity, parse_identities

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7755"
DEFAULT_IN_FLIGHT_BYTES_MAX = 256 * 1024 * 1024
KINDS = ("openai", "anthropic", "bedrock")


class ConfigError(Exception):
    pass


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


CLUSTER_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


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
    workers_spare: int = 32  # ready for a burst of 32 at an idle daemon (~9 MiB each)
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
    auth: str = "curve"  # "curve" (CURVE + ZAP) or "none" (ipc:// or loopback only)
    retention_days: float = 0.0  # finished calls older than this are pruned; 0: keep
    providers: dict[str, ProviderProfile] = field(default_factory=dict)
    identities: dict[str, Identity] = field(default_factory=dict)
    http: HttpConfig = field(default_factory=HttpConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

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
    "workers_spare": (int,), "queue_max": (int,), "in_flight_bytes_max": (int,),
    "max_connections": (int,),
    "backoff_base_s": (int, float), "backoff_max_s": (int, float), "breaker_threshold": (int,),
    "breaker_cooldown_s": (int, float), "stop_grace_s": (int, float), "log_level": (str,),
    "log_json": (bool,), "auth": (str,), "retention_days": (int, float),
}
AUTH_MODES = ("curve", "none")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_PROFILE_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,), "base_url": (str,), "endpoint_url": (str,), "api_key_env": (str,),
    "region": (str,), "stale_timeout_s": (int, float), "first_chunk_timeout_s": (int, float),
    "max_attempts": (int,), "connect_timeout_s": (int, float), "read_timeout_s": (int, float),
    "aws_credentials": (str,), "aws_profile": (str,),
}


def _check(where: str, key: str, value: Any, types: tuple[type, ...]) -> Any:
    if isinstance(value, bool) and bool not in types:
        raise ConfigError(f"{where}.{key}: expected {types[0].__name__}, got a boolean")
    if not isinstance(value, types):
        raise ConfigError(f"{where}.{key}: expected {types[0].__name__}, "
                          f"got {type(value).__name__}")
    if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
        raise ConfigError(f"{where}.{key}: must not be negative")
    if float in types:
        return float(cast(float, value))
    return value


def parse_config(data: dict[str, Any], source: str = "<config>") -> DaemonConfig:
    unknown = set(data) - {"daemon", "providers", "identities", "http", "cluster"}
    if unknown:
        raise ConfigError(f"{source}: unknown table(s) {sorted(unknown)}")
    daemon: dict[str, Any] = {}
    for key, value in data.get("daemon", {}).items():
        if key not in _DAEMON_TYPES:
            raise ConfigError(f"{source}: daemon.{key}: unknown key")
        daemon[key] = _check(f"{source}: daemon", key, value, _DAEMON_TYPES[key])
    profiles: dict[str, ProviderProfile] = {}
    for name, table in data.get("providers", {}).items():
        where = f"{source}: providers.{name}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: must be a table")
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in _PROFILE_TYPES:
                raise ConfigError(f"{where}.{key}: unknown key")
            values[key] = _check(where, key, value, _PROFILE_TYPES[key])
        if values.get("kind") not in KINDS:
            raise ConfigError(f"{where}.kind: must be one of {', '.join(KINDS)}")
        if values.get("max_attempts", 3) < 1:
            raise ConfigError(f"{where}.max_attempts: must be at least 1")
        for key in ("base_url", "endpoint_url"):
            if key in values:
                _check_url(f"{where}.{key}", values[key])
        profiles[name] = ProviderProfile(name=name, **values)
    identities = parse_identities(data.get("identities", {}), f"{source}: identities",
                                  ConfigError)
    for ident in identities.values():
        for profile in sorted(ident.providers or ()):
            if profile not in profiles:
                raise ConfigError(f"{source}: identities.{ident.name}.providers: no provider "
                                  f"profile {profile!r}")
    if "log_level" in daemon:
        daemon["log_level"] = _log_level(f"{source}: daemon.log_level", daemon["log_level"])
    if "auth" in daemon and daemon["auth"] not in AUTH_MODES:
        raise ConfigError(f"{source}: daemon.auth: must be one of {', '.join(AUTH_MODES)}, "
                          f"got {daemon['auth']!r}")
    http = _parse_http(data.get("http", {}), f"{source}: http", profiles)
    cluster = _parse_cluster(data.get("cluster", {}), f"{source}: cluster")
    cfg = DaemonConfig(providers=profiles, identities=identities, http=http, cluster=cluster,
                       **daemon)
    check_endpoint(f"{source}: daemon.endpoint", cfg.endpoint, cfg.auth)
    _check_http_port(f"{source}: http.listen", cfg)
    if cfg.workers_spare < 1 or cfg.workers_max < 1:
        raise ConfigError(f"{source}: daemon.workers_max and daemon.workers_spare must be >= 1")
    return cfg


def _parse_http(table: Any, where: str, profiles: dict[str, ProviderProfile]) -> HttpConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = set(table) - {"listen", "routes"}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown key")
    listen = table.get("listen")
    if listen is not None:
        if not isinstance(listen, str):
            raise ConfigError(f"{where}.listen: expected str, got {type(listen).__name__}")
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"{where}.listen: must be HOST:PORT, got {listen!r}")
        if not is_loopback(host.strip("[]")):
            raise ConfigError(f"{where}.listen: {listen} is reachable from other hosts; the "
                              f"gateway speaks plain HTTP, so it binds loopback only (put a "
                              f"TLS proxy in front of it for other hosts)")
    routes = table.get("routes", {})
    if not isinstance(routes, dict):
        raise ConfigError(f"{where}.routes: must be a table of model = \"profile\"")
    for model, profile in routes.items():
        if not isinstance(profile, str) or profile not in profiles:
            raise ConfigError(f"{where}.routes.{model}: no provider profile {profile!r}")
    return HttpConfig(listen=listen, routes=dict(routes))


def _parse_cluster(table: Any, where: str) -> ClusterConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table")
    if not table:
        return ClusterConfig()
    types: dict[str, tuple[type, ...]] = {"urls": (list,), "host": (str,), "replicas": (int,),
                                          "lease_s": (int, float), "timeout_s": (int, float)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "auth":
            values[key] = parse_auth(value, f"{where}.auth", ConfigError)
        elif key == "tls":
            values[key] = parse_tls(value, f"{where}.tls", ConfigError)
        elif key not in types:
            raise ConfigError(f"{where}.{key}: unknown key")
        else:
            values[key] = _check(where, key, value, types[key])
    urls = values.get("urls")
    if not urls or not all(isinstance(u, str) and urlparse(u).scheme in ("nats", "tls")
                           and urlparse(u).hostname for u in urls):
        raise ConfigError(f"{where}.urls: a list of the NATS servers' URLs "
                          f"(nats://HOST:PORT or tls://HOST:PORT), got "
                          f"{[shown_url(u) if isinstance(u, str) else u for u in urls or ()]!r}")
    host = values.get("host", "")
    if not CLUSTER_HOST_RE.match(host):
        raise ConfigError(f"{where}.host: this host's name, unique in the cluster (letters, "
                          f"digits, - and _, at most 64), got {host!r}")
    if not 1 <= values.get("replicas", 3) <= 5:
        raise ConfigError(f"{where}.replicas: JetStream allows 1 to 5, got {values['replicas']}")
    for key in ("lease_s", "timeout_s"):
        if key in values and values[key] <= 0:
            raise ConfigError(f"{where}.{key}: must be above 0, got {values[key]}")
    values["urls"] = tuple(urls)
    return ClusterConfig(**values)


def _check_http_port(where: str, cfg: DaemonConfig) -> None:
    """The gateway's port is neither the client endpoint's nor the events
    endpoint's (the next one: docs/PROTOCOL.md §1)."""
    if cfg.http.listen is None or not cfg.endpoint.startswith("tcp://"):
        return
    port = int(cfg.endpoint.rpartition(":")[2])
    if cfg.http.host_port[1] in (port, port + 1):
        raise ConfigError(f"{where}: port {cfg.http.host_port[1]} is the daemon's "
                          f"{'client' if cfg.http.host_port[1] == port else 'events'} "
                          f"endpoint ({cfg.endpoint}, events on port {port + 1}); pick "
                          f"another, e.g. {port + 2}")


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


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


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


def apply_env(cfg: DaemonConfig, env: dict[str, str]) -> DaemonConfig:
    """STREAMFENCE_<DAEMON_KEY>=value overrides a [daemon] key."""
    changes: dict[str, Any] = {}
    for key, types in _DAEMON_TYPES.items():
        raw = env.get("STREAMFENCE_" + key.upper())
        if raw is None:
            continue
        kind = types[0]
        try:
            if kind is bool:
                changes[key] = raw.lower() in ("1", "true", "yes", "on")
            else:
                changes[key] = kind(raw)
        except ValueError:
            raise ConfigError(f"environment STREAMFENCE_{key.upper()}: expected "
                              f"{kind.__name__}, got {raw!r}") from None
    if not changes:
        return cfg
    if "log_level" in changes:
        changes["log_level"] = _log_level("environment STREAMFENCE_LOG_LEVEL",
                                          changes["log_level"])
    # As in the file: a typo such as "CURVE" must not turn authentication off.
    if "auth" in changes and changes["auth"] not in AUTH_MODES:
        raise ConfigError(f"environment STREAMFENCE_AUTH: must be one of "
                          f"{', '.join(AUTH_MODES)}, got {changes['auth']!r}")
    for key, value in changes.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"environment STREAMFENCE_{key.upper()}: must not be negative")
    cfg = replace(cfg, **changes)
    check_endpoint("environment STREAMFENCE_ENDPOINT", cfg.endpoint, cfg.auth)
    if cfg.workers_spare < 1 or cfg.workers_max < 1:
        raise ConfigError("environment STREAMFENCE_WORKERS_MAX/SPARE: both must be >= 1")
    return cfg


def load_config(path: str | None, env: dict[str, str] | None = None) -> DaemonConfig:
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
    return apply_env(parse_config(data, source), dict(os.environ) if env is None else env)
