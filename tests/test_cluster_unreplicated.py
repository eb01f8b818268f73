"""Cluster mode (ARCHITECTURE §4.17): a host that dies between a submit's
journal commit and the replication of its record. Found by the explorer's
`host-pause` class (scripts/chaos_host_pause.py, seed 10666, schedule 4:
host-a killed 1.5 s into the run, one of its four calls lost).

The journal holds the call (accepted, never run); the cluster holds
neither its record nor an owner entry, so no other host can take it up.
At its restart the host ran the call at epoch 1, found no entry to raise,
took that for "another host's" and forgot it (`moved`); the submitter's
retry with the same idempotency key was answered `accepted (duplicate)`
for a call no host runs, and its subscribe `unknown_call`: lost. Now a
recovered call that never ran is stored in the cluster again (record and
entry, both idempotent), as at its submit, before it runs."""

from __future__ import annotations

import select
import time
from pathlib import Path
from typing import Any

import pytest

from streamfence.cluster.ledger import Ledger
from streamfence.cluster.records import call_record
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.protocol import failpoints
from streamfence.protocol.client_router import ClientError
from streamfence.sink.transcript import TranscriptReader
from streamfence.supervisor.clusterlink import ClusterLink
from tests.harness import DaemonProcess, as_host, wait_until
from tests.wires import profile_for

pytestmark = pytest.mark.slow
CRASH = "supervisor.after_journal_commit=crash"  # before the record is replicated


def _host(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster,
          where: Path) -> DaemonProcess:
    """Host A on its state dir; its failpoint fires once across its starts
    (`where` records what fired)."""
    return DaemonProcess(tmp_path / "a", {"emu": profile_for("openai", emulator)},
                         env={failpoints.ENV: CRASH, failpoints.DIR_ENV: str(where)},
                         tables={"cluster": {"urls": nats.urls, "host": "host-a",
                                             "replicas": 3, "lease_s": 2.0}})


def _request(key: str) -> dict[str, Any]:
    return {"model": f"gpt-emu#{key}", "messages": [{"role": "user", "content": "hi"}]}


def _in_the_cluster(nats: NatsCluster, call_id: str) -> tuple[bool, Any]:
    """Whether the cluster has the call's record, and its owner entry."""
    async def look(ledger: Ledger) -> tuple[bool, Any]:
        return await ledger.accepted(call_id) is not None, await ledger.owner(call_id)
    return as_host(nats, "reader", look)


def _sink_made(path: Path) -> bool:
    reader = TranscriptReader(str(path))
    try:
        return reader.made()
    finally:
        reader.close()


def test_a_call_journaled_but_never_replicated_runs_after_the_restart(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    emu.script("unreplicated", [{"fault": "ok", "chunks": 4, "text": "ran after all"}])
    where = tmp_path / "failpoints"
    where.mkdir()
    first = _host(tmp_path, emulator, nats, where).start()
    try:
        wait_until(lambda: _sink_made(tmp_path / "a" / "transcript.db"), 30,
                   "host a's sink to make the transcript's tables")
        # No answer comes: the supervisor dies after the journal's commit (the
        # client may also see the connection go first).
        with first.client(timeout_s=3.0) as client, \
                pytest.raises((TimeoutError, ClientError)):
            client.submit("emu", _request("unreplicated"), idempotency_key="k-1",
                          subscribe=False)
        assert first.proc is not None
        wait_until(lambda: first.proc is not None and first.proc.poll() is not None, 30,
                   "host a to die at its failpoint")
    finally:
        first.cleanup()
    assert not first.survivors, f"processes outlived the daemon: {first.survivors}"
    assert (where / "fired.supervisor.after_journal_commit").exists()

    again = _host(tmp_path, emulator, nats, where).start()  # the point fired: not again
    try:
        with again.client(timeout_s=20.0) as client:
            call_id = client.submit("emu", _request("unreplicated"), idempotency_key="k-1",
                                    subscribe=False)
            done = client.result(call_id, wait_s=20.0)
        assert done is not None and done["status"] == "completed", done
        assert done["response"]["content"] == "ran after all"
        assert len(emu.log("unreplicated")) == 1
        assert not any("moved to another host" in r.get("message", "")
                       for r in again.log_records())
        # Its record is the cluster's, and its entry went with its done.
        wait_until(lambda: _in_the_cluster(nats, call_id) == (True, None), 15,
                   "the call's record kept and its entry released")
    finally:
        again.cleanup()
    assert not again.survivors, f"processes outlived the daemon: {again.survivors}"


def test_a_call_another_host_ran_since_gets_no_entry_back(nats: NatsCluster) -> None:
    """The store again at start (`ClusterLink.accept(again=True)`) of a call
    whose record the cluster has and whose log holds records: another host
    took it up, ran it and released its entry (done) while this one was
    down. No entry is made again (a stray that would outlive the call); the
    call's take at epoch 1 then finds it another host's."""
    call_id = "0" * 31 + "7"
    record = call_record(call_id, "local", "emu", _request("elsewhere"), {}, None, None)

    async def run_elsewhere(ledger: Ledger) -> None:
        await ledger.accept(call_id, record)
        held = await ledger.take(call_id, None, 1)
        assert held is not None
        await ledger.open_epoch(held)
        assert await ledger.release(held.owner)
    as_host(nats, "host-b", run_elsewhere)

    link = ClusterLink(ClusterSettings(tuple(nats.urls), "host-a", replicas=3), 2.0,
                       time.monotonic)
    answers: list[str | None] = []
    try:
        link.accept(call_id, record, answers.append, again=True)
        deadline = time.monotonic() + 30.0
        while not answers:
            assert time.monotonic() < deadline, "the store again was not answered in 30 s"
            if select.select([link.fd], [], [], 1.0)[0]:
                link.run_done()
    finally:
        link.close()
    assert answers == [None]
    assert _in_the_cluster(nats, call_id) == (True, None)
