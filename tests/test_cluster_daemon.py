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

from streamfence.cluster.ledger import Ledger
from streamfence.cluster.records import EPOCH, EVENTS, Record, call_record
from streamfence.devtools.emulator.control import EmulatorClient, EmulatorProcess
from streamfence.devtools.nats_cluster import NatsCluster
from streamfence.protocol.client_router import ClientError
from streamfence.sink.transcript import read_events_after
from tests.harness import DaemonProcess, as_host, stopped, tree_of, wait_until
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


def _wait_runs(nats: NatsCluster, call_id: str, what: str) -> None:
    """Until the call's log holds two EVENTS records (its first runs)."""
    async def runs(ledger: Ledger) -> int:
        return sum(1 for r in await ledger.read(call_id) if r.kind == EVENTS)
    wait_until(lambda: as_host(nats, "reader", runs) >= 2, 15, what)


def _take_as_host_b(nats: NatsCluster, call_id: str, beat: bool = False,
                    from_epoch: int = 1) -> int:
    """Host B (a ledger here; with `beat`, one that beat once, so host A watches
    it) takes the call from host A's `from_epoch` at the next epoch and opens
    that epoch in its log: the sequence of its epoch record."""
    async def take(ledger: Ledger) -> int:
        if beat:
            await ledger.beat()
        seen = await ledger.owner(call_id)
        assert seen is not None and (seen.host, seen.epoch) == (HOST, from_epoch), seen
        held = await ledger.take(call_id, seen)
        assert held is not None and held.epoch == from_epoch + 1
        return (await ledger.open_epoch(held)).log_seq
    opened: int = as_host(nats, "host-b", take)
    return opened


def _wait_forgotten(proc: DaemonProcess, timeout_s: float, what: str) -> None:
    """Until the host logs that it forgot a call that moved to another host."""
    wait_until(lambda: any("moved to another host" in r.get("message", "")
                           for r in proc.log_records()), timeout_s, what)


def test_a_call_is_replicated_owned_and_logged_on_the_cluster(
        daemon: DaemonProcess, emu: EmulatorClient, nats: NatsCluster) -> None:
    emu.script("logged", [{"fault": "ok", "chunks": 12, "text": "twelve pieces of an answer"}])
    with daemon.client() as client:
        stream = client.stream_text("emu", _request("logged"))
        text = "".join(stream)
        call = stream.call_id
    assert text == "twelve pieces of an answer" and call is not None
    assert any("cluster: host" in r.get("message", "") for r in daemon.log_records()), \
        "the supervisor did not log its cluster link"

    async def look(ledger: Ledger) -> tuple[Any, ...]:
        record = msgpack.unpackb(await ledger.accepted(call) or b"", raw=False)
        return record, await ledger.read(call)

    record, log = as_host(nats, "reader", look)
    assert record["call_id"] == call and record["provider"] == "emu"
    assert record["request"]["model"] == "gpt-emu#logged"

    async def owner(ledger: Ledger) -> Any:
        return await ledger.owner(call)
    # Done: its entry in sf_owners goes (it holds live calls only), released
    # once the supervisor has the sink's answer to the finish, which can come
    # after the client read the done the sink sent.
    wait_until(lambda: as_host(nats, "reader", owner) is None, 10,
               "the done call's entry in sf_owners to go", interval=0.1)
    assert (log[0].kind, log[0].epoch, log[0].host) == (EPOCH, 1, HOST)
    assert {r.host for r in log} == {HOST} and {r.epoch for r in log} == {1}
    logged = _events_in(log[1:])
    stored_events = [msgpack.unpackb(b, raw=False)
                     for b in read_events_after(str(daemon.state_dir / "transcript.db"), call)]
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

    _wait_runs(nats, call_id, "the call's first runs in its log")
    took_at = time.time()
    opened = _take_as_host_b(nats, call_id)

    record = emu.wait_for(lambda log: log[0] if log and log[0]["aborted"] else None,
                          timeout=15.0, what="the provider connection to close", key="taken")
    assert not record["completed"], record
    assert record["ended"] - took_at < 10.0
    _wait_forgotten(daemon, 15, "the call to be forgotten")

    log = as_host(nats, "reader", lambda ledger: ledger.read(call_id))
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
    owner, log = as_host(nats, "reader", look)
    assert owner is None  # done
    assert [(r.kind, r.epoch) for r in log if r.kind == EPOCH] == [(EPOCH, 1), (EPOCH, 2)]
    assert {r.host for r in log} == {HOST}
    assert _events_in(log) == events  # the log holds exactly what the subscriber saw


def _host(tmp_path: Path, emulator: EmulatorProcess, nats: NatsCluster, name: str,
          lease_s: float) -> DaemonProcess:
    return DaemonProcess(tmp_path / name, {"emu": dict(profile_for("openai", emulator),
                                                      stale_timeout_s=60.0)},
                         tables={"cluster": {"urls": nats.urls, "host": name, "replicas": 3,
                                             "lease_s": lease_s}})


def test_a_frozen_host_loses_its_call_to_another_host_and_is_fenced_when_it_wakes(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """The zombie host, end to end: host A streams a call; A is frozen
    (SIGSTOP of its whole process tree) past its lease; host B takes the call
    at epoch 2, stores its log, and runs it again (a reset, then a second
    provider request) to its done; A wakes (SIGCONT): its sink's appends are
    refused by the engine, its worker is killed (its provider connection
    closes) and it forgets the call. The log: A's epoch, A's runs, B's epoch,
    B's runs to the done, nothing of A after B's epoch."""
    emu.script("zombie", [{"fault": "ok", "chunks": 600, "chunk_delay_s": 0.05},  # A: 30 s
                          {"fault": "ok", "chunks": 10, "text": "the answer from host b"}])
    a = _host(tmp_path, emulator, nats, "host-a", 2.0).start()
    b = _host(tmp_path, emulator, nats, "host-b", 2.0).start()
    try:
        with a.client() as client:
            call_id = client.submit("emu", _request("zombie"), subscribe=False)

        _wait_runs(nats, call_id, "host a's first runs")
        with stopped(tree_of(a)):
            async def owner(ledger: Ledger) -> Any:
                return await ledger.owner(call_id)
            wait_until(lambda: (o := as_host(nats, "reader", owner)) is None
                       or o.host == "host-b", 20, "host b to take the call")

            async def done(ledger: Ledger) -> bool:
                return any(e["op"] == "done" for e in _events_in(await ledger.read(call_id)))
            wait_until(lambda: as_host(nats, "reader", done), 30, "host b to finish the call")
            assert not emu.log("zombie")[0]["ended"], "host a's stream ended while it was frozen"

        record = emu.wait_for(lambda log: log[0] if log and log[0]["ended"] else None,
                              timeout=20.0, what="host a's provider connection to close",
                              key="zombie")
        assert record["aborted"] and not record["completed"], record
        _wait_forgotten(a, 20, "host a to forget the call")

        log = as_host(nats, "reader", lambda ledger: ledger.read(call_id))
        epochs = [(r.epoch, r.host) for r in log if r.kind == EPOCH]
        assert epochs == [(1, "host-a"), (2, "host-b")], epochs
        b_opened = next(r.seq for r in log if r.kind == EPOCH and r.host == "host-b")
        assert all(r.host == "host-b" for r in log if r.seq > b_opened)
        events = _events_in(log)
        after_reset = events[next(i for i, e in enumerate(events) if e["op"] == "reset"):]
        assert "".join(e["data"] for e in after_reset if e["op"] == "delta") \
            == "the answer from host b"
        assert events[-1]["op"] == "done" and events[-1]["status"] == "completed"
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
        with a.client() as client:
            sink = client.status()["sink"]
        assert sink["cluster_refused"] >= 1 and sink["cluster_engine_refused"] >= 1, sink
        with b.client() as client:
            done_b = client.result(call_id, wait_s=5.0)  # host b serves the call it took
        assert done_b is not None and done_b["status"] == "completed", done_b
    finally:
        for proc in (a, b):
            proc.cleanup()


def test_any_host_serves_any_call(tmp_path: Path, emulator: EmulatorProcess,
                                  emu: EmulatorClient, nats: NatsCluster) -> None:
    """A call running on host A, read from host B (§4.17, rule 5): B's subscriber
    gets every event, live, in order, as A's does; a subscribe from a seq
    resumes exactly after it; `result` on B gives the done; an identity that
    may not see the call is told there is none."""
    emu.script("anyhost", [{"fault": "ok", "chunks": 40, "chunk_delay_s": 0.05}])
    a = _host(tmp_path, emulator, nats, "host-a", 5.0).start()
    b = _host(tmp_path, emulator, nats, "host-b", 5.0).start()
    try:
        with a.client() as on_a, b.client(timeout_s=10.0) as on_b:
            call_id = on_a.submit("emu", _request("anyhost"))
            first = next(iter(on_a.events(call_id, timeout_s=10.0)))
            assert first["op"] == "delta"  # running on A
            on_b.subscribe(call_id, from_seq=0)
            seen_on_b = list(on_b.events(call_id, timeout_s=15.0))
            seen_on_a = [first, *on_a.events(call_id, timeout_s=15.0)]
            assert seen_on_b == seen_on_a
            assert seen_on_b[-1]["op"] == "done" and seen_on_b[-1]["status"] == "completed"
            done = on_b.result(call_id)
            assert done is not None and done["status"] == "completed"
            assert done["response"]["content"] == seen_on_a[-1]["response"]["content"]
        with b.client() as on_b:
            on_b.subscribe(call_id, from_seq=10)
            assert list(on_b.events(call_id, timeout_s=10.0)) == seen_on_a[10:]
        assert len(emu.log("anyhost")) == 1  # one provider request: A's
    finally:
        for proc in (a, b):
            proc.cleanup()


def test_a_host_takes_up_at_its_start_the_calls_the_cluster_says_it_owns(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """Strays (§4.17, rule 4): between two starts of host A, the cluster came
    to say A owns two calls its journal does not run: one A finished (its
    entry outlived its done: a release whose answer was lost) and one
    accepted at epoch 0 (A died before its journal had it). At its start A
    runs the second to its done and only releases the first."""
    emu.script("ended", [{"fault": "ok", "chunks": 4, "text": "ended once"}])
    emu.script("stray", [{"fault": "ok", "chunks": 4, "text": "the stray's answer"}])
    a = _host(tmp_path, emulator, nats, "host-a", 2.0).start()
    try:
        with a.client() as client:
            ended = client.submit("emu", _request("ended"))
            done = client.result(ended, wait_s=15.0)
            assert done is not None and done["status"] == "completed", done
        assert a.stop() == 0
        stray = "0" * 31 + "5"

        async def leave_strays(ledger: Ledger) -> None:
            record = msgpack.unpackb(await ledger.accepted(ended) or b"", raw=False)
            assert await ledger.take(ended, None, 1) is not None  # the entry, as if kept
            await ledger.accept(stray, call_record(
                stray, record["owner"], "emu", _request("stray"), {}, None, None))
            assert await ledger.take(stray, None, 0) is not None
        as_host(nats, "host-a", leave_strays)

        a.start()
        with a.client() as client:
            done = client.result(stray, wait_s=20.0)
        assert done is not None and done["status"] == "completed", done
        assert done["response"]["content"] == "the stray's answer"

        async def owners(ledger: Ledger) -> tuple[Any, Any]:
            return await ledger.owner(ended), await ledger.owner(stray)
        wait_until(lambda: as_host(nats, "reader", owners) == (None, None), 15,
                   "both entries to go (done calls have none)")
        assert len(emu.log("ended")) == 1  # the ended call did not run again
        assert len(emu.log("stray")) == 1
        assert any("run nowhere here" in r.get("message", "") for r in a.log_records())
    finally:
        a.cleanup()


def test_a_host_wins_back_a_call_it_had_moved_away(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """Host A runs a call; host B (a ledger here) takes it at epoch 2, opens
    its epoch (A's sink is refused, A forgets the call: `moved`), and falls
    silent past its lease; A takes the call back at epoch 3, journals it
    anew, and runs it to its done: the log holds A, B, A's epochs and one
    answer after the reset."""
    emu.script("back", [{"fault": "ok", "chunks": 600, "chunk_delay_s": 0.05},  # A, 30 s
                        {"fault": "ok", "chunks": 6, "text": "won back"}])
    a = _host(tmp_path, emulator, nats, "host-a", 2.0).start()
    try:
        with a.client() as client:
            call_id = client.submit("emu", _request("back"), subscribe=False)

        _wait_runs(nats, call_id, "host a's first runs")

        _take_as_host_b(nats, call_id, beat=True)  # host b was alive, then falls silent
        _wait_forgotten(a, 20, "host a to forget the call")

        with a.client() as client:
            done = client.result(call_id, wait_s=30.0)
        assert done is not None and done["status"] == "completed", done
        assert done["response"]["content"] == "won back"
        log = as_host(nats, "reader", lambda ledger: ledger.read(call_id))
        epochs = [(r.epoch, r.host) for r in log if r.kind == EPOCH]
        assert epochs == [(1, "host-a"), (2, "host-b"), (3, "host-a")], epochs
        events = _events_in(log)
        after_reset = events[next(i for i, e in enumerate(events) if e["op"] == "reset"):]
        assert "".join(e["data"] for e in after_reset if e["op"] == "delta") == "won back"
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert a.proc is not None and a.proc.poll() is None, "host a died"
    finally:
        a.cleanup()


def test_a_take_whose_answer_was_lost_does_not_lose_the_call(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """A take's compare-and-set may land with its answer lost (a node killed):
    the entry is this host's at the earlier epoch with a revision the host
    never saw, and the driver's next try comes at the next epoch. Here the
    entry is rewritten (same host, same epoch) while attempt 1 stalls; the
    stale kill's retry, attempt 2, must own the call, not take it for
    another host's and forget it."""
    emu.script("lostanswer", [{"fault": "stall", "stall_s": 60.0},
                              {"fault": "ok", "chunks": 4, "text": "second try"}])
    a = DaemonProcess(tmp_path / "a", {"emu": dict(profile_for("openai", emulator),
                                                   stale_timeout_s=3.0)},
                      tables={"cluster": {"urls": nats.urls, "host": "host-a", "replicas": 3}})
    a.start()
    try:
        with a.client() as client:
            call_id = client.submit("emu", _request("lostanswer"), subscribe=False)
        emu.wait_for(lambda log: log[0] if log else None, timeout=15.0,
                     what="attempt 1's request",
                     key="lostanswer")

        async def rewrite(ledger: Ledger) -> None:
            seen = await ledger.owner(call_id)
            assert seen is not None and (seen.host, seen.epoch) == ("host-a", 1), seen
            await ledger.owners.update(call_id, msgpack.packb(["host-a", 1]),
                                       last=seen.revision)
        as_host(nats, "host-a", rewrite)
        assert not emu.log("lostanswer")[0]["ended"], "attempt 1 ended before the rewrite"

        with a.client() as client:
            done = client.result(call_id, wait_s=30.0)
        assert done is not None and done["status"] == "completed", done
        assert done["response"]["content"] == "second try"
        assert len(emu.log("lostanswer")) == 2
        assert not any("moved to another host" in r.get("message", "")
                       for r in a.log_records())
    finally:
        a.cleanup()


def test_a_call_the_cluster_cannot_be_asked_about_is_not_called_unknown(
        daemon: DaemonProcess, nats: NatsCluster) -> None:
    """A call this host does not know may run on another host: while the
    cluster cannot be asked (every NATS node frozen here), `result` is
    answered `cluster_unavailable`, not `unknown_call`; once it can, a call
    no host has is `unknown_call`."""
    stranger = "f" * 32
    with stopped([n.proc.pid for n in nats.nodes if n.proc is not None]):
        with daemon.client(timeout_s=30.0) as client, pytest.raises(ClientError) as refused:
            client.result(stranger)
        assert refused.value.code == "cluster_unavailable", refused.value
        assert "could not ask the cluster" in refused.value.message

    def answer() -> str:
        with daemon.client(timeout_s=30.0) as client:
            try:
                client.result(stranger)
            except ClientError as exc:
                return exc.code
        return "an answer"
    # The woken nodes elect their leaders again first (cluster_unavailable meanwhile).
    wait_until(lambda: answer() == "unknown_call", 60,
               "the woken cluster to say that no host has the call")


def test_a_done_the_cluster_refuses_is_never_sent_stored_or_journaled(
        daemon: DaemonProcess, emu: EmulatorClient, nats: NatsCluster) -> None:
    """A zombie's last word: host A's attempt stalls (nothing to append, so
    A has not noticed) while host B (a ledger here) takes the call and opens
    epoch 2; a client cancels the call on A. The cluster refuses A's done:
    A's subscriber never gets it, A's journal says `moved`, not cancelled,
    and A then serves the call from the log (pending: B wrote no done)."""
    emu.script("lastword", [{"fault": "stall", "after": 2, "stall_s": 60.0}])
    with daemon.client(timeout_s=10.0) as client:
        call_id = client.submit("emu", _request("lastword"))
        events = client.events(call_id, timeout_s=3.0)
        seen = [next(events)]
        assert seen[0]["op"] == "delta", seen

        _take_as_host_b(nats, call_id)
        client.cancel(call_id)
        _wait_forgotten(daemon, 20, "host a to forget the call")
        with pytest.raises(TimeoutError):  # no done comes: 3 s of silence
            seen.extend(events)
        assert client.result(call_id) is None  # pending: served from the log, no done in it
        assert client.status()["counters"].get("calls_cancelled", 0) == 0
    logged = _events_in(as_host(nats, "reader", lambda ledger: ledger.read(call_id)))
    assert not any(e["op"] == "done" for e in logged)
    assert seen == logged[:len(seen)]  # what A's subscriber got is what the log holds


def test_a_call_cancelled_before_it_ran_has_its_done_in_the_log(
        tmp_path: Path, emulator: EmulatorProcess, emu: EmulatorClient,
        nats: NatsCluster) -> None:
    """A call cancelled while queued (one worker, busy) never opened an epoch:
    its done is written under epoch 0 (the entry its accept left), so every
    host sees it ended, not only this one."""
    emu.script("busy", [{"fault": "stall", "after": 1, "stall_s": 60.0}])
    a = DaemonProcess(tmp_path / "a", {"emu": dict(profile_for("openai", emulator),
                                                   stale_timeout_s=60.0)},
                      daemon={"workers_max": 1, "workers_spare": 1},
                      tables={"cluster": {"urls": nats.urls, "host": HOST, "replicas": 3}})
    a.start()
    try:
        with a.client(timeout_s=10.0) as client:
            client.submit("emu", _request("busy"), subscribe=False)
            emu.wait_for(lambda log: log[0] if log else None, timeout=15.0,
                         what="the busy call's request", key="busy")
            queued = client.submit("emu", _request("queued"), subscribe=False)
            client.cancel(queued)
            done = client.result(queued, wait_s=10.0)
        assert done is not None and done["status"] == "cancelled", done
        log = as_host(nats, "reader", lambda ledger: ledger.read(queued))
        assert [(r.kind, r.epoch, r.host) for r in log if r.kind == EPOCH] == [(EPOCH, 0, HOST)]
        logged = _events_in(log)
        assert [e["op"] for e in logged] == ["done"] and logged[0]["status"] == "cancelled"
        assert emu.log("queued") == []  # it never ran
    finally:
        a.cleanup()


def test_a_call_is_cancelled_from_any_host(tmp_path: Path, emulator: EmulatorProcess,
                                           emu: EmulatorClient, nats: NatsCluster) -> None:
    """A cancel sent to host B for a call host A runs is forwarded to A, which
    cancels it (its provider connection closes); B answers `cancelling`, and
    both hosts then give the same done, status cancelled. While A cannot
    answer (frozen), B says it does not know whether the cancel took:
    `cancel_unknown` (A has it in its socket and acts on it when it wakes).
    Asked again once A is awake, B gives A's answer: `cancelling`, or the
    done if the first cancel already ended the call (or, in the moment
    between that end and B seeing its done, `cluster_unavailable`: ask again); either way the call ends
    cancelled, whichever came first."""
    emu.script("farcancel", [{"fault": "ok", "chunks": 600, "chunk_delay_s": 0.05}])  # 30 s
    a = _host(tmp_path, emulator, nats, "host-a", 30.0).start()
    b = _host(tmp_path, emulator, nats, "host-b", 30.0).start()
    try:
        with a.client() as on_a, b.client(timeout_s=15.0) as on_b:
            call_id = on_a.submit("emu", _request("farcancel"))
            assert next(iter(on_a.events(call_id, timeout_s=10.0)))["op"] == "delta"
            with stopped(tree_of(a)[:1]), pytest.raises(ClientError) as unanswered:  # A's supervisor
                on_b.cancel(call_id)
            assert unanswered.value.code == "cancel_unknown", unanswered.value

            def cancel_again() -> dict[str, Any] | None:
                try:
                    return on_b.cancel(call_id)
                except ClientError as exc:  # the call ended, its done not yet seen by B
                    if exc.code != "cluster_unavailable":
                        raise
                    return None
            again = wait_until(cancel_again, 15.0, "host B's answer to the cancel asked again")
            assert again["op"] in ("cancelling", "done"), again
            done_b = on_b.result(call_id, wait_s=15.0)
            done_a = on_a.result(call_id, wait_s=15.0)
        assert done_b is not None and done_b["status"] == "cancelled", done_b
        assert done_a is not None and done_a["seq"] == done_b["seq"], (done_a, done_b)
        if again["op"] == "done":  # the first cancel had ended it: the same done
            assert again["seq"] == done_b["seq"] and again["status"] == "cancelled", again
        record = emu.wait_for(lambda log: log[0] if log and log[0]["ended"] else None,
                              timeout=15.0, what="A's provider connection to close",
                              key="farcancel")
        assert record["aborted"] and not record["completed"], record
    finally:
        for proc in (a, b):
            proc.cleanup()


def test_a_forwarded_cancel_is_cluster_unavailable_only_if_it_reached_no_host(
        daemon: DaemonProcess, nats: NatsCluster) -> None:
    """The two answers of a cancel the owner did not confirm (§4.17, rule 5),
    for a call `sf_owners` says host Z owns (a ledger here). Nobody serves
    host Z's cancels: the cancel reached no host and never takes effect,
    `cluster_unavailable`. Host Z serves them and never answers (frozen, or
    its answer lost): the cancel reached it and may take effect,
    `cancel_unknown`."""
    ghost = "c" * 32

    async def own(ledger: Ledger) -> None:
        await ledger.accept(ghost, call_record(ghost, "local", "emu", _request("ghost"), {},
                                               None, None))
        assert await ledger.take(ghost, None, 1) is not None
    as_host(nats, "host-z", own)

    def cancel() -> str:
        with daemon.client(timeout_s=30.0) as client:
            try:
                return str(client.cancel(ghost)["op"])
            except ClientError as exc:
                return exc.code
    assert cancel() == "cluster_unavailable"

    async def deaf(ledger: Ledger) -> tuple[list[str], list[str]]:
        asked: list[str] = []
        await ledger.cancels.serve(lambda call_id, reply_to: asked.append(call_id))
        answers = [await asyncio.to_thread(cancel)]
        # Until host Z's subscription is known at the daemon's NATS node, the
        # cancel still reaches no host: cluster_unavailable, and Z gets nothing.
        until = time.monotonic() + 20.0
        while answers[-1] == "cluster_unavailable" and time.monotonic() < until:
            await asyncio.sleep(0.1)
            answers.append(await asyncio.to_thread(cancel))
        return answers, asked
    answers, asked = as_host(nats, "host-z", deaf)
    assert answers[-1] == "cancel_unknown", answers
    assert set(answers[:-1]) <= {"cluster_unavailable"}, answers
    assert asked == [ghost], asked  # it did reach host Z: Z could have acted on it
