"""HTTP API keys: `Authorization: Bearer KEY` (or Anthropic's `x-api-key`)
names an identity of docs/SECURITY.md.

An identity's HTTP key is derived from its CURVE secret key (an HMAC of a
fixed label), so it needs no storage of its own: `streamfence keys http-key
NAME` prints it, `keys rotate` changes it and `keys revoke` ends it, as for
the identity's ZeroMQ credentials. The key reads `sf-NAME.MAC` (MAC: 64 hex
digits); the gateway finds NAME's credentials file in the state dir's
`keys/`, computes the MAC again and compares in constant time. The gateway
then acts as NAME over the ZeroMQ socket with those credentials: the daemon
authenticates it exactly as any client of that identity.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from streamfence.protocol.client_async import AsyncClient
from streamfence.protocol.credentials import (
    LOCAL_NAME,
    Credentials,
    CredentialsError,
    load_credentials,
)
from streamfence.protocol.keys import NAME_RE

PREFIX = "sf-"
_LABEL = b"streamfence http key v1"


def http_key(creds: Credentials) -> str:
    """The HTTP key of the identity whose credentials these are."""
    mac = hmac.new(creds.secret_key, _LABEL, hashlib.sha256).hexdigest()
    return f"{PREFIX}{creds.name}.{mac}"


class HttpKeys:
    """Owns the cache of the credentials read from `keys/` (re-read when a
    file changes: a rotation or revocation takes effect at the next request)."""

    def __init__(self, keys_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(keys_dir)
        self._cache: dict[str, tuple[tuple[int, int], Credentials]] = {}

    def identify(self, key: str) -> Credentials | None:
        """The credentials of the identity `key` belongs to, or None."""
        name, dot, _ = key.removeprefix(PREFIX).rpartition(".")
        if not key.startswith(PREFIX) or not dot or not NAME_RE.match(name):
            return None
        creds = self._credentials(name)
        if creds is None:
            return None
        return creds if hmac.compare_digest(http_key(creds), key) else None

    def _credentials(self, name: str) -> Credentials | None:
        path = self.dir / f"{name}.credentials"
        try:
            st = path.stat()
        except OSError:
            self._cache.pop(name, None)
            return None
        version = (st.st_ino, st.st_mtime_ns)  # a rotation replaces the file
        cached = self._cache.get(name)
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            creds = load_credentials(path)
        except CredentialsError:
            return None
        self._cache[name] = (version, creds)
        return creds


def caller(keys: HttpKeys | None, authorization: str, other: str) -> Credentials | str | None:
    """Who a request is: LOCAL_NAME when the daemon has no keys (auth "none"),
    else the identity of its `Authorization: Bearer` key, or of `other` (the
    endpoint's other place for a key) without one; None: not one of ours."""
    if keys is None:
        return LOCAL_NAME
    key = authorization[len("Bearer "):] if authorization.startswith("Bearer ") else other
    key = key.strip()
    return keys.identify(key) if key else None


class ClientsByIdentity:
    """Owns one protocol client per identity that called (made at its first
    request; the endpoints' submits and their calls' events, the console's
    questions): the daemon authenticates each as that identity."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._clients: dict[str, AsyncClient] = {}

    def of(self, who: Credentials | str) -> AsyncClient:
        name = who if isinstance(who, str) else who.name
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = self.fresh(who, self._timeout_s)
        return client

    def fresh(self, who: Credentials | str, timeout_s: float) -> AsyncClient:
        """A client of its own for `who` (its caller closes it): a reader
        whose events no other request may take."""
        return AsyncClient(self._endpoint, timeout_s=timeout_s,
                           credentials=None if isinstance(who, str) else who)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
