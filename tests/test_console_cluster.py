"""Issue 34: the console in cluster mode, two hosts on a real 3-node NATS
JetStream cluster, each with its gateway. Host A streams a call and is
frozen past its lease; host B takes the call over. B's page of the call
says where it came from (taken over from host A at epoch 2: attempt 1 ran
there) and shows its own attempt 2; B's daemon page lists the hosts, their
leases (A's lost) and the calls each owns; once A wakes, its page of the
call says it moved, and its daemon page shows the call B owns.

The pages are fetched over HTTP with each host's admin key, as a browser
would get them before their live updates (the same fragments:
gateway/console_views.py); every wait is on a page or log condition.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from streamfence.cluster.records import EVENTS
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.gateway.keys import http_key
from streamfence.protocol.credentials import load_credentials
from tests.harness import DaemonProcess, as_host, free_port, healthy, stopped, tree_of, wait_until
from tests.wires import profile_for

pytestmark = pytest.mark.slow


class Host:
    def __init__(self, tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster,
                 name: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.daemon = DaemonProcess(
            tmp_path / name, {"emu": dict(profile_for("openai", emulator), stale_timeout_s=60.0)},
            tables={"cluster": {"urls": nats.urls, "host": name, "replicas": 3, "lease_s": 2.0},
                    "http": {"listen": f"127.0.0.1:{port}"}})

    def start(self) -> Host:
        self.daemon.start()
        wait_until(lambda: healthy(self.url), 30.0, f"the gateway to answer {self.url}/healthz")
        self.key = http_key(load_credentials(self.daemon.credentials_path))
        return self

    def page(self, path: str) -> str:
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            body: bytes = reply.read()
        return body.decode()


def _log_of(nats: NatsCluster, call_id: str) -> Any:
    return as_host(nats, "reader", lambda ledger: ledger.read(call_id))


def _host_row(page: str, host: str) -> str:
    """The daemon page's row of `host` in the cluster's hosts table ('' if none)."""
    found = re.search(rf'<tr data-host="{re.escape(host)}">.*?</tr>', page)
    return found.group(0) if found else ""


def _owned(row: str) -> str:
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    return cells[-1] if cells else ""


def test_a_call_taken_over_is_on_both_hosts_consoles(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    emu.script("taken", [{"fault": "ok", "chunks": 600, "chunk_delay_s": 0.05},  # A: 30 s
                         {"fault": "ok", "chunks": 400, "chunk_delay_s": 0.05}])  # B: 20 s
    a = Host(tmp_path, emulator, nats, "host-a").start()
    b = Host(tmp_path, emulator, nats, "host-b").start()
    try:
        with a.daemon.client() as client:
            call_id = client.submit("emu", {"model": "gpt-emu#taken", "messages": [
                {"role": "user", "content": "hi"}]}, subscribe=False)
        wait_until(lambda: sum(1 for r in _log_of(nats, call_id) if r.kind == EVENTS) >= 2,
                   15, "host a's first runs in the call's log", interval=0.2)
        with stopped(tree_of(a.daemon)):
            wait_until(lambda: len(emu.log("taken")) >= 2, 30,
                       "host b to take the call over and send its request")
            call_page = b.page(f"/console/calls/{call_id}")
            assert re.search(r'<li class=takeover data-from="host-a" data-epoch="2">',
                             call_page), call_page
            assert "Taken over" in call_page \
                and "attempt 1 ran on host <b>host-a</b>" in call_page
            attempts = re.findall(r'data-attempt="(\d+)"', call_page)
            assert attempts == ["2"], f"host b's page shows its own attempt only: {attempts}"

            def b_daemon() -> str:
                page = b.page("/console/daemon")
                return page if "lease lost" in _host_row(page, "host-a") \
                    and _owned(_host_row(page, "host-b")) == "1" else ""
            page = wait_until(b_daemon, 15, "host b's daemon page: host a's lease lost, "
                                            "the call owned by host b", interval=0.2)
            assert "this host" in _host_row(page, "host-b")

        wait_until(lambda: any("moved to another host" in r.get("message", "")
                               for r in a.daemon.log_records()), 20,
                   "host a to forget the call it lost")
        moved = a.page(f"/console/calls/{call_id}")
        assert 's-moved">moved<' in moved and "<li class=moved" in moved, moved
        assert re.findall(r'data-attempt="(\d+)"', moved) == ["1"]

        def a_daemon() -> str:
            page = a.page("/console/daemon")
            return page if _owned(_host_row(page, "host-b")) == "1" else ""
        page = wait_until(a_daemon, 15, "host a's daemon page: the call host b owns",
                          interval=0.2)
        assert _owned(_host_row(page, "host-a")) == "0", _host_row(page, "host-a")
        with b.daemon.client() as client:
            client.cancel(call_id)
            done = client.result(call_id, wait_s=20.0)
        assert done is not None and done["status"] == "cancelled", done
    finally:
        for host in (a, b):
            host.daemon.cleanup()
        for host in (a, b):
            assert not host.daemon.survivors, f"processes outlived the daemon: " \
                                              f"{host.daemon.survivors}"
