"""What a process needs to reach the cluster (built from the `[cluster]`
table, config/model.py): the servers, this host's name, how it proves who
it is (`NatsAuth`, `[cluster.auth]`) and how it checks the servers
(`NatsTls`, `[cluster.tls]`); and a server's URL as it may be shown
(`shown_url`: never a password). Parsing checks the tables' shape only:
the files they name are read when the connection is opened
(cluster/connect.py), which names the key of a file it cannot read.
Importing it does not import nats."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """`[cluster.auth]`: at most one way to prove who this host is (none:
    the servers' URLs may still carry `user:password@`)."""

    creds: str | None = None  # a .creds file (the user's JWT and nkey seed)
    nkey_seed: str | None = None  # a file holding an nkey seed (SU...)
    user: str | None = None  # with the password in the environment variable:
    password_env: str | None = None

    @property
    def method(self) -> str | None:
        if self.creds:
            return "creds"
        if self.nkey_seed:
            return "nkey_seed"
        return "user" if self.user else None


@dataclass(frozen=True, slots=True)
class NatsTls:
    """`[cluster.tls]`: the CA that signed the servers' certificates, this
    host's certificate and key (servers that verify clients), whether to
    verify the servers at all, and the name their certificates carry (if
    not the URL's host)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    verify: bool = True
    server_name: str | None = None

    @property
    def configured(self) -> bool:
        return self != NatsTls()


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    urls: tuple[str, ...]
    host: str  # this host's name: unique in the cluster
    replicas: int = 3
    timeout_s: float = 5.0  # per JetStream request; bounds the first connect too
    auth: NatsAuth = field(default_factory=NatsAuth)
    tls: NatsTls = field(default_factory=NatsTls)

    @property
    def shown_urls(self) -> str:
        return ", ".join(map(shown_url, self.urls))


def shown_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`."""
    try:
        parts = urlsplit(url)
    except ValueError:  # unparsable: at most its host part
        return url.rpartition("@")[2]
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


_AUTH_KEYS: dict[str, type] = {"creds": str, "nkey_seed": str, "user": str,
                               "password_env": str}
_TLS_KEYS: dict[str, type] = {"ca": str, "cert": str, "key": str, "verify": bool, "server_name": str}


def _typed(table: Any, where: str, keys: dict[str, type], error: type[Exception]
           ) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise error(f"{where}: must be a table")
    for key, value in table.items():
        if key not in keys:
            raise error(f"{where}.{key}: unknown key")
        if not isinstance(value, keys[key]):
            raise error(f"{where}.{key}: expected {keys[key].__name__}, "
                        f"got {type(value).__name__}")
        if isinstance(value, str) and not value:
            raise error(f"{where}.{key}: must not be empty")
    return dict(table)


def parse_auth(table: Any, where: str, error: type[Exception]) -> NatsAuth:
    """`[cluster.auth]`, or `error(message naming the key)`."""
    auth = NatsAuth(**_typed(table, where, _AUTH_KEYS, error))
    ways = [k for k in ("creds", "nkey_seed", "user") if getattr(auth, k)]
    if len(ways) > 1:
        raise error(f"{where}: one of creds, nkey_seed or user, got {' and '.join(ways)}")
    if (auth.user is None) != (auth.password_env is None):
        raise error(f"{where}: user and password_env go together (the password is read "
                    f"from the environment variable password_env names)")
    if auth.password_env is not None and not ENV_NAME_RE.match(auth.password_env):
        raise error(f"{where}.password_env: the name of an environment variable, got "
                    f"{auth.password_env!r}")
    return auth


def parse_tls(table: Any, where: str, error: type[Exception]) -> NatsTls:
    """`[cluster.tls]`, or `error(message naming the key)`."""
    tls = NatsTls(**_typed(table, where, _TLS_KEYS, error))
    if (tls.cert is None) != (tls.key is None):
        raise error(f"{where}: cert and key go together (this host's certificate and its "
                    f"private key)")
    return tls
