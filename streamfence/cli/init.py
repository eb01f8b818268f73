"""`streamfence init [DIR]` and `streamfence emulator`: a first configuration,
and the provider emulator it points at, for a new operator's first tries
(README.md, "Try it against the emulator")."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import click

from streamfence.cli.common import DEFAULT_CONFIG, InvalidConfig
from streamfence.config.model import ConfigError, parse_config


@click.command()
@click.argument("directory", default=".", type=click.Path(file_okay=False, path_type=Path))
@click.option("--emulator-url", default=None, metavar="URL",
              help="The emulator the profiles point at (default: http://127.0.0.1:7790, "
                   "where `streamfence emulator` listens).")
@click.option("--force", is_flag=True, default=False,
              help="Overwrite an existing streamfence.toml in DIRECTORY.")
@click.option("--endpoint", default=None, metavar="tcp://HOST:PORT",
              help="The daemon's client endpoint (default: tcp://127.0.0.1:7755; events on "
                   "the next port). A second daemon on this machine needs another one.")
@click.option("--cluster-host", default=None, metavar="NAME",
              help="Cluster mode: write a [cluster] table with this host's name (unique in "
                   "the cluster) and the NATS URLs of --nats-url.")
@click.option("--nats-url", "nats_urls", multiple=True, metavar="URL",
              help="With --cluster-host, repeated: the NATS servers (default: the ones "
                   "`streamfence cluster dev` runs, nats://127.0.0.1:4222 to 4224).")
def init(directory: Path, emulator_url: str | None, force: bool, endpoint: str | None,
         cluster_host: str | None, nats_urls: tuple[str, ...]) -> None:
    """Write DIRECTORY/streamfence.toml (default: here): every key with its
    default and what it does, a state dir inside DIRECTORY, and a profile per
    wire (openai, anthropic, bedrock) pointing at the bundled emulator."""
    from streamfence.cli.config_template import EMULATOR_URL, render
    from streamfence.devtools.nats_cluster import dev_urls

    url = (emulator_url or EMULATOR_URL).rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path:
        raise click.BadParameter(f"must be http://HOST:PORT (no path), got {url!r}",
                                 param_hint="--emulator-url")
    path = directory / DEFAULT_CONFIG
    if path.exists() and not force:
        raise click.ClickException(f"{path} exists; it is left as it is (--force overwrites it)")
    state_dir = directory.resolve() / "streamfence-state"
    if nats_urls and cluster_host is None:
        raise click.UsageError("--nats-url goes with --cluster-host NAME")
    cluster = None if cluster_host is None else (cluster_host, list(nats_urls or dev_urls()))
    text = render(str(state_dir), url, config_name=str(path.resolve()), endpoint=endpoint,
                  cluster=cluster)
    try:  # what `serve` would refuse (a bad --endpoint or host name), refused now
        parse_config(tomllib.loads(text), str(path))
    except ConfigError as exc:
        raise InvalidConfig(exc) from None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    here = path.parent.resolve() == Path.cwd().resolve()
    config = "" if here else f" --config {path}"
    click.echo(f"wrote {path}: profiles openai, anthropic, bedrock at the emulator {url}; "
               f"state dir {state_dir}")
    click.echo("next, each in its own terminal:")
    if url == EMULATOR_URL:
        click.echo("  streamfence emulator")
    else:
        click.echo(f"  (the emulator at {url}: streamfence emulator --port "
                   f"{parsed.port or 80})")
    if cluster is not None and cluster[1] == dev_urls():
        click.echo("  streamfence cluster dev nats-dev   (the NATS cluster it names, unless "
                   "it runs)")
    click.echo(f"  streamfence serve{config}")
    click.echo(f"  streamfence submit{config} --provider anthropic \"Hello\"")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=None, type=click.IntRange(0, 65535),
              help="Default: 7790, where `streamfence init`'s profiles point; 0: any free port.")
def emulator(host: str, port: int | None) -> None:
    """Run the bundled provider emulator (OpenAI, Anthropic and Bedrock wires;
    every request answers a short made-up text, one log line each on stderr)
    until Ctrl-C. The same as `python -m streamfence.devtools.emulator`."""
    from streamfence.cli.config_template import EMULATOR_PORT
    from streamfence.devtools.emulator.__main__ import main as emulator_main

    sys.exit(emulator_main(["--host", host,
                            "--port", str(EMULATOR_PORT if port is None else port)]))
