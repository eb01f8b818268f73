"""A client's credentials: who it is to the daemon, and how it knows the daemon.

A credentials file is small TOML, private to its owner (0600), written by
`streamfence keys new NAME` (docs/SECURITY.md)::

    # streamfence client credentials: keep this file secret
    name = "alice"
    endpoint = "tcp://127.0.0.1:7755"
    server_key = "<the daemon's CURVE public key, Z85>"
    public_key = "<this client's CURVE public key, Z85>"
    secret_key = "<this client's CURVE secret key, Z85>"

The client's socket is a CURVE client of the daemon's key: the daemon knows
the client by its public key (ZeroMQ's ZAP), never by anything the client
says about itself. `find_credentials` is where the CLI and `Client` look when
they are given none.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

ENV_CREDENTIALS = "STREAMFENCE_CREDENTIALS"
LOCAL_NAME = "local"  # the identity the daemon creates for its own user (an admin)


class CredentialsError(Exception):
    """A credentials file that is missing, unreadable, not private or malformed."""


@dataclass(frozen=True, slots=True)
class Credentials:
    name: str
    endpoint: str
    server_key: bytes  # Z85, 40 bytes
    public_key: bytes
    secret_key: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` a CURVE client of the daemon with this identity."""
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key

    def __repr__(self) -> str:  # never print the secret key
        return f"Credentials(name={self.name!r}, endpoint={self.endpoint!r})"


def _z85_key(data: dict[str, object], key: str, path: Path) -> bytes:
    value = data.get(key)
    if not isinstance(value, str) or len(value) != 40:
        raise CredentialsError(f"{path}: {key} must be a 40-character Z85 key")
    try:
        z85.decode(value)
    except (ValueError, KeyError):  # KeyError: a character outside Z85's alphabet
        raise CredentialsError(f"{path}: {key} is not Z85") from None
    return value.encode("ascii")


def load_credentials(path: str | os.PathLike[str]) -> Credentials:
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"{p}: cannot read credentials ({exc.strerror})") from None
    if mode & 0o077:
        raise CredentialsError(f"{p}: credentials must be private to their owner "
                               f"(mode {mode & 0o777:o}); run: chmod 600 {p}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CredentialsError(f"{p}: not TOML ({exc})") from None
    name, endpoint = data.get("name"), data.get("endpoint")
    if not isinstance(name, str) or not name:
        raise CredentialsError(f"{p}: name must be a non-empty string")
    if not isinstance(endpoint, str) or not endpoint:
        raise CredentialsError(f"{p}: endpoint must be a non-empty string")
    return Credentials(name, endpoint, _z85_key(data, "server_key", p),
                       _z85_key(data, "public_key", p), _z85_key(data, "secret_key", p))


def write_credentials(path: str | os.PathLike[str], creds: Credentials) -> None:
    """Write `creds` to `path` (0600 from its creation, replaced atomically)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    text = ("# streamfence client credentials: keep this file secret\n"
            f'name = "{creds.name}"\nendpoint = "{creds.endpoint}"\n'
            f'server_key = "{creds.server_key.decode()}"\n'
            f'public_key = "{creds.public_key.decode()}"\n'
            f'secret_key = "{creds.secret_key.decode()}"\n')
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, p)


def local_credentials_path(state_dir: str | os.PathLike[str]) -> Path:
    """Where the daemon writes its own user's (admin) credentials."""
    return Path(state_dir) / "keys" / f"{LOCAL_NAME}.credentials"


def find_credentials(explicit: str | None = None,
                     state_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The credentials to use: `explicit`, else $STREAMFENCE_CREDENTIALS, else the
    local admin credentials of `state_dir` if that file exists; None if none."""
    if explicit:
        return Path(explicit)
    if os.environ.get(ENV_CREDENTIALS):
        return Path(os.environ[ENV_CREDENTIALS])
    if state_dir is not None:
        local = local_credentials_path(state_dir)
        if local.exists():
            return local
    return None


def resolve(endpoint: str | None,
            credentials: Credentials | str | os.PathLike[str] | None,
            default_endpoint: str) -> tuple[str, Credentials | None]:
    """A client's endpoint and credentials: `credentials` (or a path to them),
    else $STREAMFENCE_CREDENTIALS if set, else none (a daemon with
    `auth = "none"`); the endpoint defaults to the credentials' own."""
    if credentials is None:
        credentials = find_credentials()
    if credentials is not None and not isinstance(credentials, Credentials):
        credentials = load_credentials(credentials)
    if endpoint is None:
        endpoint = credentials.endpoint if credentials is not None else default_endpoint
    return endpoint, credentials
