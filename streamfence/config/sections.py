"""The checks of the `[http]` and `[cluster]` tables: what of each table
is valid, as the values model.py builds `HttpConfig` and `ClusterConfig`
from; the problem of everything else added to the caller's list (so that
one load names every problem, problems.py).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import urlparse

from streamfence.cluster.settings import parse_auth, parse_tls, shown_url
from streamfence.config.problems import Types, did_you_mean, typed, unknown

HTTP_KEYS = ("listen", "routes")
CLUSTER_TYPES: Types = {
    "urls": (list,), "host": (str,), "replicas": (int,), "lease_s": (int, float),
    "timeout_s": (int, float), "auth": (dict,), "tls": (dict,)}  # auth, tls: settings.py
CLUSTER_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def parse_http(table: dict[str, Any], where: str, profiles: Collection[str],
               problems: list[str], homes: Mapping[str, str]) -> tuple[str | None, dict[str, str]]:
    """`[http]`'s `listen` (None: no gateway) and `routes` (model -> a profile
    of `profiles`)."""
    for key in sorted(set(table) - set(HTTP_KEYS)):
        problems.append(unknown(f"{where}.{key}", key, HTTP_KEYS, elsewhere=homes))
    listen = table.get("listen")
    if listen is not None and (problem := _listen_problem(where, listen)):
        problems.append(problem)
        listen = None
    routes = table.get("routes", {})
    if not isinstance(routes, dict):
        problems.append(f"{where}.routes: must be a table of model = \"profile\"")
        routes = {}
    for model, profile in routes.items():
        if not isinstance(profile, str) or profile not in profiles:
            hint = did_you_mean(profile, profiles) if isinstance(profile, str) else ""
            problems.append(f"{where}.routes.{model}: no provider profile {profile!r}{hint}")
    return listen, dict(routes)


def _listen_problem(where: str, listen: Any) -> str | None:
    if not isinstance(listen, str):
        return f"{where}.listen: expected str, got {type(listen).__name__}"
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"{where}.listen: must be HOST:PORT, got {listen!r}"
    if not is_loopback(host.strip("[]")):
        return (f"{where}.listen: {listen} is reachable from other hosts; the gateway speaks "
                f"plain HTTP, so it binds loopback only (put a TLS proxy in front of it for "
                f"other hosts)")
    return None


def http_port_problem(where: str, listen: str | None, endpoint: str) -> str | None:
    """The gateway's port must be neither the client endpoint's nor the events
    endpoint's (the next one: docs/PROTOCOL.md §1)."""
    if listen is None or not endpoint.startswith("tcp://"):
        return None
    port, taken = int(endpoint.rpartition(":")[2]), int(listen.rpartition(":")[2])
    if taken not in (port, port + 1):
        return None
    return (f"{where}: port {taken} is the daemon's "
            f"{'client' if taken == port else 'events'} endpoint ({endpoint}, events on "
            f"port {port + 1}); pick another, e.g. {port + 2}")


def parse_cluster(table: dict[str, Any], where: str, problems: list[str],
                  homes: Mapping[str, str], error: type[Exception]) -> dict[str, Any]:
    """`[cluster]`'s values (none: single-host mode, or a problem); `error`:
    the exception cluster/settings.py raises for `[cluster.auth]` and `.tls`."""
    if not table:
        return {}
    found = len(problems)
    values = typed(table, where, CLUSTER_TYPES, problems, homes)
    for key, parse in (("auth", parse_auth), ("tls", parse_tls)):
        if key in values:
            try:
                values[key] = parse(values[key], f"{where}.{key}", error)
            except error as exc:
                problems.append(str(exc))
    mistyped = set(table) - set(values)  # their problem is already named
    urls = values.get("urls") or []
    if "urls" not in mistyped and not (urls and all(
            isinstance(u, str) and urlparse(u).scheme in ("nats", "tls") and urlparse(u).hostname
            for u in urls)):
        problems.append(f"{where}.urls: a list of the NATS servers' URLs (nats://HOST:PORT or "
                        f"tls://HOST:PORT), got "
                        f"{[shown_url(u) if isinstance(u, str) else u for u in urls]!r}")
    host = values.get("host", "")
    if "host" not in mistyped and not CLUSTER_HOST_RE.match(host):
        problems.append(f"{where}.host: this host's name, unique in the cluster (letters, "
                        f"digits, - and _, at most 64), got {host!r}")
    if not 1 <= values.get("replicas", 3) <= 5:
        problems.append(f"{where}.replicas: JetStream allows 1 to 5, got {values['replicas']}")
    for key in ("lease_s", "timeout_s"):
        if key in values and values[key] <= 0:
            problems.append(f"{where}.{key}: must be above 0, got {values[key]}")
    if len(problems) > found:
        return {}
    return dict(values, urls=tuple(urls))
