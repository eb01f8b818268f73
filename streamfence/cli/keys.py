"""`streamfence keys`: the client identities a daemon accepts (docs/SECURITY.md).

They work on the state dir's `keys/` directly, with or without a running
daemon: a running daemon sees a new, rotated or revoked key at the next
message, without a restart.
"""

from __future__ import annotations

from collections.abc import Mapping

import click

from streamfence.cli.common import config_option, load
from streamfence.config.identities import Identity, identity_named
from streamfence.protocol.credentials import LOCAL_NAME
from streamfence.protocol.keys import KeyStore, KeyStoreError


def _store(config_path: str | None) -> tuple[KeyStore, str]:
    cfg = load(config_path)
    from streamfence.supervisor import statedir

    try:
        state_dir = statedir.prepare(cfg.state_dir)
    except statedir.StateDirError as exc:
        raise click.ClickException(str(exc)) from None
    return KeyStore(state_dir / "keys"), cfg.endpoint


def _check_reachable(endpoint: str) -> None:
    """A wildcard bind address is no address a client can connect to."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if host in ("0.0.0.0", "*", "[::]", "::"):
        raise click.ClickException(
            f"the daemon binds {endpoint}, which a client cannot connect to; give the "
            f"address clients use: --endpoint tcp://HOST:PORT")


@click.group()
def keys() -> None:
    """Create, list, rotate and revoke client identities."""


@keys.command("new")
@config_option
@click.option("--endpoint", default=None,
              help="The endpoint written into the credentials (default: the daemon's).")
@click.argument("name")
def new(config_path: str | None, endpoint: str | None, name: str) -> None:
    """Create identity NAME: a key pair, registered, and its credentials file."""
    store, daemon_endpoint = _store(config_path)
    _check_reachable(endpoint or daemon_endpoint)
    try:
        store.register(name, endpoint or daemon_endpoint)
    except KeyStoreError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: credentials in {store.credentials_path(name)} "
               f"(keep it secret; hand it to the client)")


@keys.command("rotate")
@config_option
@click.option("--endpoint", default=None)
@click.argument("name")
def rotate(config_path: str | None, endpoint: str | None, name: str) -> None:
    """Give identity NAME a new key pair; the old one stops working at once."""
    store, daemon_endpoint = _store(config_path)
    if name not in store.names():
        raise click.ClickException(f"no identity {name!r} (see `streamfence keys list`)")
    _check_reachable(endpoint or daemon_endpoint)
    store.register(name, endpoint or daemon_endpoint, replace=True)
    click.echo(f"{name}: new credentials in {store.credentials_path(name)}; the old key is "
               f"refused from now on")


@keys.command("revoke")
@config_option
@click.option("--force", is_flag=True,
              help="Revoke the last admin identity too (the CLI is then locked out).")
@click.argument("name")
def revoke(config_path: str | None, force: bool, name: str) -> None:
    """Remove identity NAME's key: its clients are refused from the next message.

    The last admin identity (`local`, the CLI's own, unless the config makes
    others admins) is kept unless --force: without one, nobody sees every call
    or the whole `status`, and the CLI on the daemon's host is refused."""
    store, _ = _store(config_path)
    if not force:
        _check_not_last_admin(store, load(config_path).identities, name)
    try:
        store.revoke(name)
    except KeyStoreError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: revoked")


def _check_not_last_admin(store: KeyStore, identities: Mapping[str, Identity], name: str) -> None:
    names = store.names()
    admins = [n for n in names if identity_named(n, identities).is_admin]
    if name in names and admins == [name]:
        local = name == LOCAL_NAME
        cli = ", and the CLI on the daemon's host (it uses local's credentials) is refused"
        raise click.ClickException(
            f"{name} is the last admin identity: revoked, no identity sees every call or the "
            f"whole `status`{cli if local else ''}. Make another admin first "
            f"([identities.OTHER] role = \"admin\", `streamfence keys new OTHER`), or pass "
            f"--force (then `streamfence keys new {name}`"
            f"{', or a restart of the daemon,' if local else ''} gives it a key again)")


@keys.command("list")
@config_option
def list_(config_path: str | None) -> None:
    """The registered identities, one a line."""
    store, _ = _store(config_path)
    for name in store.names():
        click.echo(name)


@keys.command("for-host")
@config_option
@click.option("--endpoint", default=None,
              help="The endpoint written into the credentials (default: the daemon's).")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The credentials file to write (0600).")
@click.argument("credentials", type=click.Path(exists=True, dir_okay=False))
def for_host(config_path: str | None, endpoint: str | None, out: str, credentials: str) -> None:
    """Write CREDENTIALS' key pair for the daemon of --config (its endpoint and
    public key). In cluster mode a key registered on one host is accepted
    on every host (docs/SECURITY.md); a client needs each host's public key."""
    from dataclasses import replace

    from streamfence.protocol.credentials import (
        CredentialsError,
        load_credentials,
        write_credentials,
    )

    store, daemon_endpoint = _store(config_path)
    _check_reachable(endpoint or daemon_endpoint)
    try:
        creds = load_credentials(credentials)
        server_public, _ = store.server_keys()
    except (CredentialsError, KeyStoreError) as exc:
        raise click.ClickException(str(exc)) from None
    write_credentials(out, replace(creds, endpoint=endpoint or daemon_endpoint,
                                   server_key=server_public))
    click.echo(f"{creds.name}: credentials for {endpoint or daemon_endpoint} in {out} "
               f"(the same key pair: keep it secret)")


@keys.command("http-key")
@config_option
@click.argument("name")
def http_key_(config_path: str | None, name: str) -> None:
    """Print identity NAME's HTTP API key (the gateway's `Authorization: Bearer`).

    It is derived from NAME's credentials: `rotate` changes it, `revoke` ends it."""
    from streamfence.gateway.keys import http_key
    from streamfence.protocol.credentials import CredentialsError, load_credentials

    store, _ = _store(config_path)
    if name not in store.names() and not store.credentials_path(name).exists():
        raise click.ClickException(f"no identity {name!r} (`streamfence keys new {name}`)")
    try:
        creds = load_credentials(store.credentials_path(name))
    except CredentialsError as exc:
        raise click.ClickException(f"{exc} (`streamfence keys rotate {name}` makes new ones)") \
            from None
    click.echo(http_key(creds))
