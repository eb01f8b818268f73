"""A worker prepares its attempt while the journal and the sink commit it,
and sends nothing before the supervisor's W_GO (workers/send_gate.py,
ARCHITECTURE §2.2): an attempt that is never authorized, or cancelled
before its go, costs no provider request and no worker."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.protocol import failpoints
from tests.harness import DaemonProcess, tree_of, wait_until
from tests.wires import profile_for, request_for


def _daemon_whose_sink_pauses(tmp_path: Path, emulator: EmulatorProcess,
                              wire: str) -> tuple[DaemonProcess, Path]:
    """A daemon whose sink stands still 1.5 s after storing its first
    attempt's epoch (before answering the authorize), and its failpoints' dir."""
    points = tmp_path / "failpoints"
    points.mkdir()
    daemon = DaemonProcess(
        tmp_path / "state", {"emu": profile_for(wire, emulator)},
        daemon={"workers_spare": 1},
        env={failpoints.ENV: "sink.after_authorize=pause(1500ms)@1",
             failpoints.DIR_ENV: str(points)})
    return daemon, points


def _wait_for_the_pause(points: Path) -> None:
    wait_until(lambda: "sink.after_authorize" in failpoints.hits(str(points)), 20.0,
               "the sink to stand still after storing the attempt's epoch")


@pytest.mark.parametrize("wire", ["openai", "anthropic", "bedrock"])
def test_an_attempt_cancelled_before_its_go_never_reaches_the_provider(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient, wire: str) -> None:
    """The sink stands still after storing the attempt's epoch: the worker holds
    the prepared attempt (its SDK request built), the client cancels, and the
    supervisor, on the sink's answer, drops the attempt instead of sending
    it. Red if the worker sent at once (no gate: the SSE transport's, or
    botocore's before-send): the emulator would have the request. The same
    worker then serves the next call."""
    held, after = f"held-{wire}", f"after-{wire}"
    emu.script(held, [{"fault": "ok", "chunks": 5}])
    emu.script(after, [{"fault": "ok", "chunks": 5}])
    daemon, points = _daemon_whose_sink_pauses(tmp_path, emulator, wire)
    with daemon, daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for(wire, held))
        _wait_for_the_pause(points)
        client.cancel(call_id)
        result = client.result(call_id, wait_s=30.0)
        assert result is not None and result["status"] == "cancelled", result
        second = client.result(client.submit("emu", request_for(wire, after)), wait_s=30.0)
        status = client.status()
    assert emu.log(held) == [], "a dropped attempt reached the provider"
    assert second is not None and second["status"] == "completed", second
    assert len(emu.log(after)) == 1
    assert status["pool"]["killed_total"] == 0, status["pool"]


def _connections_to(port: int, pids: list[int]) -> list[int]:
    """The local port of each open TCP connection from `pids` to 127.0.0.1:`port`."""
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found += [c.laddr.port for c in conns if c.raddr and c.raddr.port == port
                  and c.status == psutil.CONN_ESTABLISHED]
    return found


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_prepared_attempt_opens_its_connection_and_sends_its_request_after_the_go(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient, wire: str) -> None:
    """While the sink stands still after storing the attempt's epoch, the
    worker has opened its connection to the provider (so the handshakes
    overlap the commits) and sent nothing on it; after the go the request
    comes on that same connection. Red if the transport connected after the
    gate (no connection during the pause) or sent before it (a request)."""
    key = f"conn-{wire}"
    emu.script(key, [{"fault": "ok", "chunks": 3}])
    port = int(emulator.base_url.rsplit(":", 1)[1])
    daemon, points = _daemon_whose_sink_pauses(tmp_path, emulator, wire)
    with daemon, daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request_for(wire, key))
        _wait_for_the_pause(points)
        opened = wait_until(lambda: _connections_to(port, tree_of(daemon)), 5.0,
                            "the prepared attempt's worker to open its connection to the provider")
        assert emu.log(key) == [], "the request left before the go"
        result = client.result(call_id, wait_s=30.0)
    assert result is not None and result["status"] == "completed", result
    [record] = emu.log(key)
    assert opened == [int(record["peer"].rsplit(":", 1)[1])], \
        (opened, record["peer"])  # the request came on the connection opened before the go
