"""Operating cluster mode (issue 30, "Operable"): `streamfence cluster dev`
runs a real NATS JetStream cluster until a stop signal and leaves no node
behind, also when it is killed; `init --cluster-host` writes a host's
config, `submit --no-wait` prints the call id alone; `status` shows this host's view of the
cluster (its lease, the hosts it has seen beat, its calls, its takes and
the engine's refusals), and `streamfence status` and `/metrics` show it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner
from rich.console import Console

from streamfence.cli import main
from streamfence.cli.status_view import status_tables
from streamfence.cluster.ledger import Ledger
from streamfence.cluster.settings import ClusterSettings
from streamfence.config.model import load_config
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster, dev_urls
from streamfence.gateway.metrics import families
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for

pytestmark = pytest.mark.slow
LEASE_S = 2.0


# ---- streamfence cluster dev ------------------------------------------------------------


class DevCluster:
    """`streamfence cluster dev --port 0 DIR` as a process, its stdout read by a thread."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamfence.cli", "cluster", "dev", "--port", "0", str(root)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def urls(self) -> list[str]:
        """The `urls = [...]` it printed, once ready."""
        wait_until(lambda: any("Ctrl-C stops" in line for line in self.lines)
                   or self.proc.poll() is not None, 60, "the dev cluster to be ready")
        line = next((x for x in self.lines if x.startswith("urls = ")), None)
        assert line is not None, self.lines
        return [str(url) for url in re.findall(r'"(nats://[^"]+)"', line)]

    def nodes(self) -> list[psutil.Process]:
        return list(psutil.Process(self.proc.pid).children())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _serves_jetstream(urls: list[str]) -> bool:
    """A ledger connects and makes its R3 streams and buckets there."""
    async def main() -> bool:
        ledger = await Ledger.connect(ClusterSettings(tuple(urls), "probe", replicas=3))
        await ledger.close()
        return True
    return asyncio.run(main())


def _gone(nodes: list[psutil.Process]) -> bool:
    return not any(n.is_running() and n.status() != psutil.STATUS_ZOMBIE for n in nodes)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_cluster_dev_runs_until_a_stop_signal_and_stops_every_node(
        tmp_path: Path, stop: signal.Signals) -> None:
    dev = DevCluster(tmp_path / "nats")
    try:
        urls = dev.urls()
        assert len(urls) == 3, dev.lines
        nodes = dev.nodes()
        assert len(nodes) == 3 and all("nats-server" in n.name() for n in nodes), nodes
        assert _serves_jetstream(urls)
        assert dev.proc.poll() is None, "it must run in the foreground until stopped"
        dev.proc.send_signal(stop)
        assert dev.proc.wait(30) == 0, dev.lines
        assert _gone(nodes), f"nodes outlived `cluster dev`: {nodes}"
        assert dev.lines[-1].startswith("stopped: every node exited"), dev.lines
        assert (tmp_path / "nats" / "n1" / "store").is_dir()  # the data stays
    finally:
        dev.kill()


def test_cluster_dev_killed_takes_its_nodes_with_it(tmp_path: Path) -> None:
    dev = DevCluster(tmp_path / "nats")
    try:
        dev.urls()
        nodes = dev.nodes()
        assert len(nodes) == 3
        dev.proc.kill()  # nothing of it runs: the kernel's parent-death signal does it
        dev.proc.wait(10)
        wait_until(lambda: _gone(nodes), 10, "the nodes to die with `cluster dev`")
    finally:
        for node in dev.nodes() if dev.proc.poll() is None else []:
            node.kill()
        dev.kill()


def test_cluster_dev_refuses_ports_in_use_in_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "streamfence.cli", "cluster", "dev",
                              "--port", str(port), str(tmp_path / "nats")],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stdout == "", out
    said = out.stderr.strip()  # (the ports after it may be in use too: other tests run)
    assert said.startswith(f"Error: port(s) {port}") and said.endswith(
        " on 127.0.0.1 are in use (another `streamfence cluster dev`, or a nats-server?): "
        "stop it, or give --port") and "\n" not in said, out.stderr


# ---- a host's config ---------------------------------------------------------------------------


def test_init_writes_a_cluster_hosts_config(tmp_path: Path) -> None:
    """`init --cluster-host` (with `--endpoint` for a second daemon here): a
    config that loads with the dev cluster's URLs; a bad host name writes
    nothing and says why in one line."""
    runner = CliRunner()
    out = runner.invoke(main, ["init", str(tmp_path / "b"), "--cluster-host", "host-b",
                               "--endpoint", "tcp://127.0.0.1:7765"])
    assert out.exit_code == 0, out.output
    cfg = load_config(str(tmp_path / "b" / "streamfence.toml"))
    assert cfg.endpoint == "tcp://127.0.0.1:7765"
    assert (cfg.cluster.host, list(cfg.cluster.urls), cfg.cluster.replicas) \
        == ("host-b", dev_urls(), 3)
    out = runner.invoke(main, ["init", str(tmp_path / "c"), "--cluster-host", "host c"])
    assert out.exit_code == 1 and "cluster.host: this host's name" in out.output, out.output
    assert not (tmp_path / "c").exists()
    # Two problems: each on its own line, as `serve` prints them.
    out = runner.invoke(main, ["init", str(tmp_path / "d"), "--cluster-host", "host d",
                               "--endpoint", "not-an-endpoint"])
    lines = [line for line in out.output.splitlines() if line.startswith("Error: ")]
    assert out.exit_code == 1 and len(lines) == 2, out.output
    assert any("cluster.host" in line for line in lines), lines
    assert any("endpoint" in line for line in lines), lines
    assert not (tmp_path / "d").exists()


# ---- status shows the cluster ---------------------------------------------------------------


def _host(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster,
          name: str) -> DaemonProcess:
    return DaemonProcess(tmp_path / name, {"emu": dict(profile_for("openai", emulator),
                                                      stale_timeout_s=60.0)},
                         tables={"cluster": {"urls": nats.urls, "host": name, "replicas": 3,
                                             "lease_s": LEASE_S}})


def _cluster_of(proc: DaemonProcess) -> dict[str, Any]:
    with proc.client() as client:
        cluster: dict[str, Any] = client.status()["cluster"]
    return cluster


def _rendered(reply: dict[str, Any]) -> str:
    console = Console(record=True, width=120)
    for table in status_tables(reply):
        console.print(table)
    return console.export_text()


def _samples(reply: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in families(reply) for s in family.samples}


def test_status_shows_this_hosts_view_of_the_cluster(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """Two hosts: after a call on A, A's status names A, its fresh lease, B's
    fresh beat, its accepted call (owned no more: done); the CLI table and
    the metrics show the same. Then A is killed mid-call: B takes the call
    over (takes_won 1), says A's lease is lost, and finishes the call."""
    emu.script("slow", [{"fault": "ok", "chunks": 400, "chunk_delay_s": 0.05}])
    a = _host(tmp_path, emulator, nats, "host-a").start()
    b = _host(tmp_path, emulator, nats, "host-b").start()
    try:
        with a.client() as client:
            done = client.run("emu", {"model": "gpt-emu", "messages": [
                {"role": "user", "content": "hi"}]})
        assert done["status"] == "completed", done

        def sees_b() -> dict[str, Any] | None:
            cluster = _cluster_of(a)
            return cluster if "host-b" in cluster["hosts"] else None
        wait_until(sees_b, 10, "host a to see host b beat")
        with a.client() as client:
            reply = client.status()
        cluster = reply["cluster"]
        assert cluster["host"] == "host-a" and cluster["lease_s"] == LEASE_S, cluster
        assert cluster["connected"] is True
        assert 0 <= cluster["lease_age_s"] < LEASE_S, cluster
        assert cluster["hosts"]["host-b"]["beat_age_s"] < LEASE_S, cluster
        assert cluster["hosts"]["host-b"]["lease_lost"] is False
        assert "host-a" not in cluster["hosts"]  # itself: lease_age_s
        assert (cluster["calls_accepted"], cluster["calls_owned"], cluster["calls_moved"],
                cluster["takes_won"], cluster["takes_lost"], cluster["appends_refused"],
                cluster["runs_waiting"], cluster["calls_waiting"]) \
            == (1, 0, 0, 0, 0, 0, 0, 0), cluster

        text = _rendered(reply)
        assert "cluster (lease 2 s, NATS connected)" in text, text
        assert re.search(r"host-a \(this host\)\s*│\s*\d+\.\d s ago\s*│\s*held", text), text
        assert re.search(r"host-b\s*│\s*\d+\.\d s ago\s*│\s*held", text), text
        for what in ("calls owned here", "takes won", "takes lost", "calls moved",
                     "appends refused by the engine", "runs waiting for the cluster"):
            assert re.search(rf"{what}.*│\s*0 │", text), (what, text)
        assert re.search(r"calls accepted here\s*│\s*1 │", text), text
        samples = _samples(reply)
        assert samples[("streamfence_cluster_connected", ())] == 1.0
        assert samples[("streamfence_cluster_host_lease_lost", (("host", "host-b"),))] == 0.0
        assert samples[("streamfence_cluster_takes_total", (("result", "won"),))] == 0.0
        assert ("streamfence_cluster_lease_age_seconds", ()) in samples
        assert samples[("streamfence_cluster_appends_refused_total", ())] == 0.0
        assert samples[("streamfence_cluster_runs_waiting", ())] == 0.0

        # Host a dies mid-call; host b takes it over.
        with a.client() as client:
            call_id = client.submit("emu", {"model": "gpt-emu#slow", "messages": [
                {"role": "user", "content": "hi"}]}, subscribe=False)
        wait_until(lambda: emu.log("slow"), 10, "host a's provider request")
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGKILL)
        with b.client() as client:
            taken_over = client.result(call_id, wait_s=30.0)
        assert taken_over is not None and taken_over["status"] == "completed", taken_over
        cluster = _cluster_of(b)
        assert cluster["takes_won"] == 1 and cluster["takes_lost"] == 0, cluster
        assert cluster["hosts"]["host-a"]["lease_lost"] is True, cluster
        assert cluster["hosts"]["host-a"]["beat_age_s"] >= LEASE_S, cluster
    finally:
        for proc in (a, b):
            with contextlib.suppress(ProcessLookupError):
                proc.cleanup()


def test_submit_no_wait_prints_only_the_call_id(make_daemon: Any) -> None:
    """What the quick start captures: the id alone on stdout, exit 0, the
    call running on without the client."""
    daemon = make_daemon()
    out = subprocess.run(
        [sys.executable, "-m", "streamfence.cli", "submit", "--credentials",
         str(daemon.state_dir / "keys" / "local.credentials"), "--provider", "emu",
         "--no-wait", "hi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out
    call_id = out.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{32}", call_id) and out.stdout == call_id + "\n", out.stdout
    with daemon.client() as client:
        done = client.result(call_id, wait_s=20.0)
    assert done is not None and done["status"] == "completed", done
