"""What the `streamfence` subcommands share: finding the config, the
credentials and the daemon (see streamfence.cli's docstring)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, TypeVar

import click

from streamfence.config.environment import ENV_CONFIG
from streamfence.config.model import ConfigError, DaemonConfig, load_config

if TYPE_CHECKING:
    from pathlib import Path

    from streamfence.protocol.client import Client, NoConnection

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_CONFIG = "streamfence.toml"


def config_path_of(given: str | None) -> str | None:
    """The config file to use: `given`, else $STREAMFENCE_CONFIG, else
    ./streamfence.toml if it exists, else None (the defaults)."""
    if given:
        return given
    if os.environ.get(ENV_CONFIG):
        return os.environ[ENV_CONFIG]
    return DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None


class InvalidConfig(click.ClickException):
    """Every problem of a config, one line each (exit status 1)."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(f"invalid configuration: {error}")
        self.problems = error.problems

    def show(self, file: IO[Any] | None = None) -> None:
        for problem in self.problems:
            click.echo(f"Error: invalid configuration: {problem}", file=file, err=file is None)


def load(config_path: str | None) -> DaemonConfig:
    try:
        return load_config(config_path_of(config_path))
    except ConfigError as exc:
        raise InvalidConfig(exc) from None


def config_option(f: F) -> F:
    return click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                        help="TOML configuration file (default: $STREAMFENCE_CONFIG, "
                             "else ./streamfence.toml if present).")(f)


def client_options(f: F) -> F:
    f = click.option("--credentials", default=None, type=click.Path(dir_okay=False),
                     help="A credentials file (default: $STREAMFENCE_CREDENTIALS, else the "
                          "daemon's admin credentials in its state dir).")(f)
    f = click.option("--endpoint", default=None,
                     help="The daemon's endpoint (default: from the credentials or config).")(f)
    return config_option(f)


@contextlib.contextmanager
def connect(endpoint: str | None, credentials: str | None, config_path: str | None,
            timeout_s: float = 10.0) -> Iterator[Client]:
    """A client of the daemon (see the module docstring); one-line errors."""
    from streamfence.protocol.client import Client, NoConnection
    from streamfence.protocol.credentials import CredentialsError, find_credentials

    cfg = load(config_path)
    found = find_credentials(credentials, cfg.state_dir)
    if endpoint is None and found is None:
        endpoint = cfg.endpoint
    import zmq

    try:
        client = Client(endpoint, timeout_s, credentials=found)
    except CredentialsError as exc:
        raise click.ClickException(str(exc)) from None
    except (zmq.ZMQError, ValueError) as exc:  # an endpoint that is not one, say
        raise click.ClickException(f"cannot connect to the daemon: {exc}") from None
    with client:
        try:
            yield client
        except NoConnection as exc:  # the cause, within a second
            raise click.ClickException(_unreached(exc, found, cfg.state_dir, config_path)) \
                from None
        except TimeoutError as exc:  # connected, but no answer in time
            how = f"as {found}" if found else "without credentials"
            raise click.ClickException(f"{exc} ({how}): is the daemon overloaded, starting "
                                       f"or stopping?") from None


def _unreached(exc: NoConnection, found: Path | None, state_dir: str,
               config_path: str | None) -> str:
    """Why the CLI could not reach the daemon, and where it looked for credentials."""
    from streamfence.protocol.client_monitor import NO_CREDENTIALS
    from streamfence.protocol.credentials import ENV_CREDENTIALS, local_credentials_path

    if exc.cause != NO_CREDENTIALS or found is not None:
        return f"{exc}" + (f" [credentials: {found}]" if found is not None else "")
    config = config_path_of(config_path)
    of = config or f"the defaults: no --config, $STREAMFENCE_CONFIG or ./{DEFAULT_CONFIG}"
    return (f"the daemon at {exc.endpoint} takes only CURVE clients, and no credentials were "
            f"found: no --credentials, ${ENV_CREDENTIALS} is not set, and there is no "
            f"{local_credentials_path(os.path.abspath(state_dir))} (the state dir of {of}); pass "
            f"--credentials PATH, or --config with the daemon's config")
