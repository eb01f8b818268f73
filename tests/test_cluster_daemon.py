"""Cluster mode at the daemon (ARCHITECTURE §4.17), one host on a real
3-node NATS JetStream cluster: a call is answered `accepted` once its record
is replicated, its attempt owns it in `sf_owners`, and its events are in the
call's log on JetStream before the transcript; and a host whose call was
taken by another host stops writing it, because the engine refuses its
appends, and kills its worker (the provider connection closes)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from streamfence.cluster.ledger import EPOCH, EVENTS, Ledger, Record
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.sink.store import events_after
from tests.harness import DaemonProcess, wait_until
from tests.wires import profile_for

pytestmark = pytest.mark.slow
HOST = "host-a"


@pytest.fixture
def daemon(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster
           ) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path / "state", {"emu": dict(profile_for("openai", emulator),
                                                         stale_timeout_s=30.0)},
                         tables={"cluster": {"urls": nats.urls, "host": HOST, "replicas": 3}})
    proc.start()
    try:
        yield proc
    finally:
        proc.cleanup()
        assert not proc.survivors, f"processes outlived the daemon: {proc.survivors}"


def _request(key: str) -> dict[str, Any]:
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": "hi"}]}


def _ledger(nats: NatsCluster, host: str, body: Any) -> Any:
    """Run `body(ledger)` with a ledger of its own as `host`; its result."""
    async def main() -> Any:
        ledger = await Ledger.connect(ClusterSettings(tuple(nats.urls), host))
        try:
            return await body(ledger)
        finally:
            await ledger.close()
    return asyncio.run(main())


def _events_in(records: list[Record]) -> list[dict[str, Any]]:
    """The public events an owner's EVENTS records carry, in order."""
    out = []
    for record in records:
        if record.kind == EVENTS:
            for _seq, _last, _attempt, _op, _n, body in record.body:
                unpacker = msgpack.Unpacker(raw=False)
                unpacker.feed(body)
                out.extend(unpacker)
    return out


def test_a_call_is_replicated_owned_and_logged_on_the_cluster(
        daemon: DaemonProcess, emu: EmulatorClient, nats: NatsCluster) -> None:
    emu.script("logged", [{"fault": "ok", "chunks": 12, "text": "twelve pieces of an answer"}])
    with daemon.client() as client:
        text = "".join(client.stream_text("emu", _request("logged")))
    assert text == "twelve pieces of an answer"
    assert any("cluster: host" in r.get("message", "") for r in daemon.log_records()), \
        "the supervisor did not log its cluster link"

    async def look(ledger: Ledger) -> tuple[Any, ...]:
        ids = await ledger.owners.keys()
        assert len(ids) == 1, ids
        call = ids[0]
        record = msgpack.unpackb(await ledger.accepted(call) or b"", raw=False)
        return call, record, await ledger.owner(call), await ledger.read(call)

    call, record, owner, log = _ledger(nats, "reader", look)
    assert record["call_id"] == call and record["provider"] == "emu"
    assert record["request"]["model"] == "gpt-emu#logged"
    assert (owner.host, owner.epoch) == (HOST, 1)
    assert (log[0].kind, log[0].epoch, log[0].host) == (EPOCH, 1, HOST)
    assert {r.host for r in log} == {HOST} and {r.epoch for r in log} == {1}
    logged = _events_in(log[1:])
    stored_events = [msgpack.unpackb(b, raw=False)
                     for b in events_after(str(daemon.state_dir / "transcript.db"), call)]
    assert logged == stored_events  # the log holds what the transcript holds, done included
    assert "".join(e["data"] for e in logged if e["op"] == "delta") == text
    assert logged[-1]["op"] == "done" and logged[-1]["status"] == "completed"


def test_a_host_whose_call_was_taken_stops_writing_it_and_kills_its_worker(
        daemon: DaemonProcess, emu: EmulatorClient, nats: NatsCluster) -> None:
    """The zombie's side: another host takes the call at epoch 2 and opens its
    epoch; this host's sink has its next append refused by the engine, drops
    the run, fences the attempt, and the supervisor kills the worker (the
    provider connection closes) and forgets the call (`moved`)."""
    emu.script("taken", [{"fault": "ok", "chunks": 200, "chunk_delay_s": 0.05}])  # 10 s
    with daemon.client() as client:
        call_id = client.submit("emu", _request("taken"), subscribe=False)

    async def some_events(ledger: Ledger) -> int:
        return sum(1 for r in await ledger.read(call_id) if r.kind == EVENTS)
    wait_until(lambda: _ledger(nats, "reader", some_events) >= 2, 15,
               "the call's first runs in its log")

    async def take(ledger: Ledger) -> int:
        seen = await ledger.owner(call_id)
        assert seen is not None and (seen.host, seen.epoch) == (HOST, 1), seen
        held = await ledger.take(call_id, seen)
        assert held is not None
        return (await ledger.open_epoch(held)).log_seq
    took_at = time.time()
    opened = _ledger(nats, "host-b", take)

    record = emu.wait_for(lambda log: log[0] if log and log[0]["aborted"] else None,
                          timeout=15.0, what="the provider connection to close", key="taken")
    assert not record["completed"], record
    assert record["ended"] - took_at < 10.0
    wait_until(lambda: any("moved to another host" in r.get("message", "")
                           for r in daemon.log_records()), 15, "the call to be forgotten")

    log = _ledger(nats, "reader", lambda ledger: ledger.read(call_id))
    after = [r for r in log if r.seq > opened]
    assert all(r.host != HOST for r in after), after  # nothing of host-a after host-b's epoch
    with daemon.client() as client:
        status = client.status()
    sink = status["sink"]
    assert sink["cluster_refused"] == 1 and sink["cluster_engine_refused"] >= 1, sink
    assert status["counters"]["calls_moved"] == 1, status["counters"]


def test_a_sink_killed_mid_stream_goes_on_under_a_new_epoch_it_owns(
        daemon: DaemonProcess, emu: EmulatorClient, nats: NatsCluster) -> None:
    """§2.8 in cluster mode: the restarted sink's rebind is owned first (epoch 2
    in sf_owners, this host) and opened in the log; the call completes from one
    provider request, and its log holds one answer."""
    emu.script("sinkdeath", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    with daemon.client(timeout_s=20.0) as client:
        call_id = client.submit("emu", _request("sinkdeath"))
        events: list[dict[str, Any]] = []
        for event in client.events(call_id, timeout_s=20.0):
            events.append(event)
            if len(events) == 5:
                break
        sink_pid = client.status()["processes"]["sink"]
        os.kill(sink_pid, signal.SIGKILL)
        events += list(client.events(call_id, timeout_s=15.0))
        status = client.status()
    assert status["counters"]["attempts_rebound"] == 1, status["counters"]
    assert events[-1]["op"] == "done" and events[-1]["status"] == "completed"
    assert len(emu.log("sinkdeath")) == 1  # one provider request

    async def look(ledger: Ledger) -> tuple[Any, list[Record]]:
        return await ledger.owner(call_id), await ledger.read(call_id)
    owner, log = _ledger(nats, "reader", look)
    assert (owner.host, owner.epoch) == (HOST, 2)
    assert [(r.kind, r.epoch) for r in log if r.kind == EPOCH] == [(EPOCH, 1), (EPOCH, 2)]
    assert {r.host for r in log} == {HOST}
    assert _events_in(log) == events  # the log holds exactly what the subscriber saw
