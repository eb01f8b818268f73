"""Cluster mode (ARCHITECTURE §4.17, rule 3): a call taken by another host
while this host authorizes an attempt of it. Found by the explorer's
`host-pause` class (scripts/chaos_host_pause.py, seed 30, schedule 11).

The supervisor stands still before C_AUTHORIZE of attempt 2
(`supervisor.before_authorize`); meanwhile host B takes the call at epoch 3
and opens it. Before the sink became the only writer of the log (issue 30),
the supervisor had opened epoch 2 itself; the sink's authorize then stored
the attempt's reset, its commit's append was refused, and the sink sent
E_LOST before it answered `ok`: the supervisor, still AUTHORIZING, dropped
the loss and dispatched the attempt the sink had fenced (a second provider
request; the call never marked moved; its subscribers waiting 20 s and
more). Now the sink opens epoch 2 at the authorize and finds epoch 3 there:
the authorize is refused `cluster_lost` and the call is marked moved, with
one provider request. Red before the change (it timed out waiting for the
move)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from streamfence.cluster.ledger import Ledger
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.protocol import failpoints
from tests.harness import DaemonProcess, as_host, wait_until
from tests.test_cluster_daemon import HOST, _take_as_host_b
from tests.wires import profile_for

pytestmark = pytest.mark.slow
PAUSE = "supervisor.before_authorize"


def _armed_host(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster, armed: str
                ) -> Iterator[tuple[DaemonProcess, Path]]:
    """A cluster host with one failpoint armed (`armed`), and the directory
    where the failpoints record what fired."""
    where = tmp_path / "failpoints"
    where.mkdir()
    proc = DaemonProcess(tmp_path / "state", {"emu": profile_for("openai", emulator)},
                         env={failpoints.ENV: armed, failpoints.DIR_ENV: str(where)},
                         tables={"cluster": {"urls": nats.urls, "host": HOST, "replicas": 3}})
    proc.start()
    try:
        yield proc, where
    finally:
        proc.cleanup()
        assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


@pytest.fixture
def daemon(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster
           ) -> Iterator[tuple[DaemonProcess, Path]]:
    """A cluster host whose supervisor stands still 3 s before its 2nd authorize."""
    yield from _armed_host(tmp_path, emulator, nats, f"{PAUSE}=pause(3s)@2")


def test_a_call_taken_while_its_attempt_is_authorized_is_not_run_here(
        daemon: tuple[DaemonProcess, Path], emu: EmulatorClient, nats: NatsCluster) -> None:
    proc, where = daemon
    # Attempt 1 delivers 4 deltas, then stalls: stale, run again under `restart` (a reset).
    emu.script("taken", [{"fault": "stall", "after": 4, "stall_s": 20.0},
                         {"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    request: dict[str, Any] = {"model": "gpt-emu#taken",
                               "messages": [{"role": "user", "content": "hi"}]}
    with proc.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request, subscribe=False,
                                options={"stale_timeout_s": 1.0, "on_partial": "restart"})
        wait_until(lambda: (where / f"fired.{PAUSE}").exists(), 20,
                   "the supervisor to stand still before attempt 2's authorize")
        _take_as_host_b(nats, call_id, from_epoch=2)  # within the 3 s pause
        wait_until(lambda: client.status()["counters"].get("calls_moved", 0) == 1, 10,
                   "this host to see the call moved to host b")
    assert len(emu.log("taken")) == 1, \
        f"this host ran the attempt its sink fenced: {len(emu.log('taken'))} provider requests"


OPEN = "cluster.before_epoch_append"


@pytest.fixture
def paused_open(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster
                ) -> Iterator[tuple[DaemonProcess, Path]]:
    """A cluster host whose sink stands still 3 s before its first epoch append."""
    yield from _armed_host(tmp_path, emulator, nats, f"{OPEN}=pause(3s)@1")


def test_a_first_attempt_whose_epoch_open_is_refused_is_fenced_and_moved(
        paused_open: tuple[DaemonProcess, Path], emu: EmulatorClient, nats: NatsCluster) -> None:
    """A call's first attempt starts with its epoch's open in flight
    (sink/replica.py `authorize`); if another host opens a later epoch first,
    the open is refused: the attempt is fenced (E_LOST), its worker killed, the
    call marked moved, and nothing it sent is in the log."""
    proc, where = paused_open
    emu.script("first", [{"fault": "ok", "chunks": 60, "chunk_delay_s": 0.05}])
    request: dict[str, Any] = {"model": "gpt-emu#first",
                               "messages": [{"role": "user", "content": "hi"}]}
    with proc.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request, subscribe=False)
        wait_until(lambda: (where / f"fired.{OPEN}").exists(), 20,
                   "the sink to stand still before the first attempt's epoch append")

        async def take_and_open(ledger: Ledger) -> None:
            seen = await ledger.owner(call_id)
            assert seen is not None and (seen.host, seen.epoch) == (HOST, 1), seen
            held = await ledger.take(call_id, seen)
            assert held is not None
            await ledger.open_epoch(held)
        as_host(nats, "host-b", take_and_open)  # within the 3 s pause
        wait_until(lambda: client.status()["counters"].get("calls_moved", 0) == 1, 15,
                   "this host to see the call moved to host b")
        wait_until(lambda: not [w for w in client.status()["workers"]
                                if w["call_id"] == call_id], 10, "the attempt's worker gone")

    hosts = [(r.kind, r.epoch, r.host) for r in as_host(nats, "reader",
                                                        lambda ledger: ledger.read(call_id))]
    assert all(host == "host-b" for _, _, host in hosts), hosts


def test_a_first_attempt_streams_while_its_epoch_open_is_slow(
        paused_open: tuple[DaemonProcess, Path], emu: EmulatorClient) -> None:
    """The sink stands still 3 s in the first attempt's epoch open while its
    worker streams: the runs wait for the open, then are logged, stored and
    sent in order; the call completes here with its exact text (it was
    taken for lost: runs of a call whose open was in flight looked like a
    call this sink never opened)."""
    proc, where = paused_open
    emu.script("slowopen", [{"fault": "ok", "chunks": 30, "chunk_delay_s": 0.02}])
    request: dict[str, Any] = {"model": "gpt-emu#slowopen",
                               "messages": [{"role": "user", "content": "hi"}]}
    with proc.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", request)
        events = list(client.events(call_id, timeout_s=30.0))
        moved = client.status()["counters"].get("calls_moved", 0)
    assert (where / f"fired.{OPEN}").exists(), "the open never stood still"
    sent = emu.log("slowopen")
    assert moved == 0 and len(sent) == 1, (moved, len(sent))
    assert events[-1]["op"] == "done" and events[-1]["status"] == "completed", events[-1]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert "".join(e["data"] for e in events if e["op"] == "delta" and e["kind"] == "text") \
        == sent[0]["text"]
