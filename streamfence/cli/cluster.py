"""`streamfence cluster dev [--nodes 3] DIR`: a NATS JetStream cluster on this
machine for trying cluster mode (README.md, "Cluster mode").

It runs `nats-server` from the `cluster` extra (devtools/nats_cluster.py
starts and stops the nodes, as it does for the tests), each node's store,
config and log under DIR/nN, on fixed loopback ports (client 4222, 4223,
…, so the `[cluster]` table it prints can be written once); prints that
table once JetStream has a leader; then runs in the foreground. Ctrl-C,
SIGTERM or SIGHUP stop the nodes (SIGTERM, then SIGKILL after 10 s) and
reap them; the nodes also die with this process if it is killed. The
stores stay in DIR: a restart on the same DIR has the same streams.
"""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from streamfence.devtools.nats_cluster import NatsCluster

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@click.group()
def cluster() -> None:
    """Cluster mode's tools."""


def _busy(ports: list[int]) -> list[int]:
    """The ports of `ports` something on loopback already listens on."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            # As nats-server binds: a port in TIME_WAIT (a cluster just stopped) is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


@cluster.command()
@click.option("--nodes", type=click.IntRange(3, 5), default=3, show_default=True,
              help="nats-server processes, all routed to each other: 3 to 5 (JetStream's "
                   "clustered mode needs routes; 3 keep a quorum when one is killed).")
@click.option("--port", type=click.IntRange(0, 61000), default=None,
              help="The first node's client port; the others follow, routes are 2000 "
                   "and monitoring 4000 above (default 4222; 0: any free ports).")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def dev(nodes: int, port: int | None, directory: Path) -> None:
    """Run a NATS JetStream cluster of --nodes nodes on loopback, its data in
    DIRECTORY, until Ctrl-C; print the `[cluster]` table for the hosts."""
    from streamfence.devtools.nats_cluster import DEV_PORT, NatsCluster

    first = DEV_PORT if port is None else port
    if first and (busy := _busy([first + i + k for i in range(nodes)
                                 for k in (0, 2000, 4000)])):
        raise click.ClickException(
            f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 are in use (another "
            f"`streamfence cluster dev`, or a nats-server?): stop it, or give --port")
    stop = threading.Event()

    def asked(signum: int, frame: Any) -> None:  # only flags it: the loop below stops
        stop.set()
    for signum in STOP_SIGNALS:
        signal.signal(signum, asked)
    try:
        nats = NatsCluster(directory.resolve(), nodes, client_port=first, die_with_parent=True)
    except (FileNotFoundError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        click.echo(f"starting {nodes} nats-server node(s) ({nats.exe}), data in "
                   f"{directory.resolve()} ...")
        try:
            nats.start()
        except (RuntimeError, TimeoutError) as exc:
            raise click.ClickException(str(exc)) from None
        _announce(nats.urls, 3)
        _run_until(stop, nats)
    finally:
        nats.stop()
    click.echo("stopped: every node exited; the data stays in "
               f"{directory.resolve()}")


def _announce(urls: list[str], replicas: int) -> None:
    click.echo("ready: JetStream has a leader. Each host's config takes:\n")
    click.echo("[cluster]")
    click.echo("urls = [" + ", ".join(f'"{u}"' for u in urls) + "]")
    click.echo('host = "host-a"      # unique per host')
    click.echo(f"replicas = {replicas}")
    click.echo("\n(`streamfence init DIR --cluster-host NAME` writes it.) Ctrl-C stops the "
               "cluster.")


def _run_until(stop: threading.Event, nats: NatsCluster) -> None:
    """Until a stop signal; a node that exits on its own is said once."""
    gone: set[int] = set()
    while not stop.wait(1.0):
        for i, node in enumerate(nats.nodes):
            if i not in gone and node.proc is not None and node.proc.poll() is not None:
                gone.add(i)
                click.echo(f"node {node.name} exited ({node.proc.returncode}): "
                           f"{nats.log_tail(i, 3)}", err=True)
    click.echo("stopping the nodes ...")
