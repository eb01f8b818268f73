"""The cluster's shared record (streamfence/cluster/ledger.py) on a real
3-node NATS JetStream cluster on loopback ports: accepted means stored by a
quorum, ownership moves by compare-and-set, and an owner that lost a call
can no longer append to its log, because the engine refuses it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgpack
import nats as nats_py
import pytest

from streamfence.cluster.ledger import (
    CALLS_STREAM,
    Fenced,
    Ledger,
    Owner,
    Ownership,
)
from streamfence.cluster.records import EPOCH, EVENTS
from streamfence.cluster.settings import ClusterSettings
from streamfence.devtools.nats_cluster import NatsCluster

pytestmark = pytest.mark.slow
T = TypeVar("T")


def _settings(nats: NatsCluster, host: str, first: int = 0) -> ClusterSettings:
    urls = nats.urls[first:] + nats.urls[:first]  # each host starts at a different node
    return ClusterSettings(tuple(urls), host, replicas=3)


async def _until(what: Callable[[], Awaitable[T]], timeout_s: float, waiting_for: str) -> T:
    """`what()`'s value once it stops raising (a quorum re-forming), within the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await what()
        except Exception as exc:  # the engine's errors while it elects a leader
            if time.monotonic() > deadline:
                raise TimeoutError(f"{waiting_for} within {timeout_s:g} s: last error "
                                   f"{type(exc).__name__}: {exc}") from exc
            await asyncio.sleep(0.1)


def _run(nats: NatsCluster, body: Callable[[Ledger, Ledger], Awaitable[None]]) -> None:
    async def main() -> None:
        a = await Ledger.connect(_settings(nats, "host-a", 0))
        b = await Ledger.connect(_settings(nats, "host-b", 1))
        try:
            await body(a, b)
        finally:
            await a.close()
            await b.close()
    asyncio.run(main())


def test_a_host_that_lost_a_call_can_no_longer_append_to_its_log(nats: NatsCluster) -> None:
    """The zombie host: A owns the call and appends; B takes it at epoch 2 and
    opens its epoch; every later append of A is refused by the engine and
    counted, whatever A believes, and the log holds nothing of A after B's
    epoch record."""
    async def body(a: Ledger, b: Ledger) -> None:
        await a.accept("call1", b"the request")
        held = await a.take("call1", None)
        assert held is not None and held.epoch == 1
        held = await a.open_epoch(held)
        for i in range(3):
            held = await a.append(held, [f"a{i}"])

        seen = await b.owner("call1")
        assert seen is not None and (seen.host, seen.epoch) == ("host-a", 1)
        taken = await b.take("call1", seen)
        assert taken is not None and taken.epoch == 2
        taken = await b.open_epoch(taken)

        for i in range(3):  # A wakes up and keeps streaming
            with pytest.raises(Fenced, match="epoch 1 is fenced"):
                await a.append(held, [f"late{i}"])
        assert a.refused == 3 and b.refused == 0
        await b.append(taken, ["b0"])

        log = [(r.kind, r.epoch, r.host, r.body) for r in await b.read("call1")]
        assert log == [(EPOCH, 1, "host-a", None), (EVENTS, 1, "host-a", ["a0"]),
                       (EVENTS, 1, "host-a", ["a1"]), (EVENTS, 1, "host-a", ["a2"]),
                       (EPOCH, 2, "host-b", None), (EVENTS, 2, "host-b", ["b0"])]
    _run(nats, body)


def test_an_epoch_opened_where_the_log_is_known_to_end_keeps_the_fence(
        nats: NatsCluster) -> None:
    """`open_epoch(known=True)` appends at once, conditional on where the caller
    believes the log ends: on an empty log, one record; where the log moved on
    meanwhile (or the same record was stored before), the same judgement as a
    read would make: a later epoch there is Fenced, an earlier one or its own
    is opened after; no miss counts as a refusal."""
    async def body(a: Ledger, b: Ledger) -> None:
        held = await a.take("known1", None)
        assert held is not None
        opened = await a.open_epoch(held, known=True)
        assert opened.log_seq > 0 and a.refused == 0
        ran = await a.append(opened, ["a0"])
        # A's sink starts again and opens the same epoch where its log was empty:
        # the same record as before (a duplicate), so the log is read: opened after a0.
        again_a = await a.open_epoch(Ownership(held.owner, 0), known=True)
        assert again_a.log_seq > ran.log_seq
        # B took the call and opened epoch 2; A still believes its log is empty.
        seen = await b.owner("known1")
        assert seen is not None
        taken = await b.take("known1", seen)
        assert taken is not None
        await b.open_epoch(taken)
        with pytest.raises(Fenced, match="owner is now"):
            await a.open_epoch(Ownership(held.owner, 0), known=True)
        assert a.refused == 0
        # B opens epoch 3 believing the log ends at nothing: opened after its epoch 2.
        again = await b.take("known1", await b.owner("known1"))
        assert again is not None and again.epoch == 3
        reopened = await b.open_epoch(again, known=True)
        assert b.refused == 0
        log = [(r.kind, r.epoch, r.host, r.seq) for r in await b.read("known1")]
        assert [x[:3] for x in log] == [(EPOCH, 1, "host-a"), (EVENTS, 1, "host-a"),
                                        (EPOCH, 1, "host-a"), (EPOCH, 2, "host-b"),
                                        (EPOCH, 3, "host-b")]
        assert log[-1][3] == reopened.log_seq
    _run(nats, body)


class _StandsStillAfterItsOwnerRead(Ledger):
    """A host whose next read of an owner entry is followed by `meanwhile`,
    before it goes on: open_epoch's check, then a pause past a lease."""

    meanwhile: Callable[[], Awaitable[None]] | None = None

    async def owner(self, call_id: str) -> Owner | None:
        current = await super().owner(call_id)
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()
        return current


def test_an_owner_paused_after_its_check_opens_no_epoch_below_a_later_one(
        nats: NatsCluster) -> None:
    """The reviewer's interleaving (issue 30): A owns the call at epoch 1 and
    reads its owner entry (its own); before A reads the log, B takes the call
    at epoch 2 and opens it; then A goes on. A must be refused: an EPOCH 1
    after EPOCH 2 is accepted by JetStream (it checks the sequence, not the
    epoch), B's next append would be refused and the call run twice."""
    async def main() -> None:
        a = await _StandsStillAfterItsOwnerRead.connect(_settings(nats, "host-a", 0))
        b = await Ledger.connect(_settings(nats, "host-b", 1))
        try:
            await a.accept("paused", b"the request")
            held = await a.take("paused", None)
            assert held is not None and held.epoch == 1
            opened: list[Ownership] = []

            async def b_takes_and_opens() -> None:
                taken = await b.take("paused", await b.owner("paused"))
                assert taken is not None and taken.epoch == 2
                opened.append(await b.open_epoch(taken))
            a.meanwhile = b_takes_and_opens
            with pytest.raises(Fenced, match="epoch 1 is fenced"):
                await a.open_epoch(held)
            assert opened, "B took and opened the call while A stood still"
            await b.append(opened[0], ["b0"])  # B goes on: its log position still holds
            log = [(r.kind, r.epoch, r.host) for r in await b.read("paused")]
            assert log == [(EPOCH, 2, "host-b"), (EVENTS, 2, "host-b")]
        finally:
            await a.close()
            await b.close()
    asyncio.run(main())


def test_of_two_hosts_taking_a_call_from_the_same_view_one_wins(nats: NatsCluster) -> None:
    async def body(a: Ledger, b: Ledger) -> None:
        for i in range(20):
            call = f"race{i}"
            assert await a.take(call, None) is not None
            assert await b.take(call, None) is None  # it exists: created once
            seen = await b.owner(call)
            won = await asyncio.gather(a.take(call, seen), b.take(call, seen))
            assert sum(w is not None for w in won) == 1, (i, won)
    _run(nats, body)


def test_of_two_concurrent_appends_at_one_position_the_engine_stores_one(
        nats: NatsCluster) -> None:
    """The fence under concurrency, on a replicated stream: what nats-server
    before 2.9.21 got wrong (issue 4320; devtools/nats_cluster.py)."""
    async def body(a: Ledger, b: Ledger) -> None:
        for i in range(20):
            held = await a.take(f"twice{i}", None)
            assert held is not None
            held = await a.open_epoch(held)
            both = await asyncio.gather(a.append(held, ["a"]), b.append(held, ["b"]),
                                        return_exceptions=True)
            assert sorted(type(r).__name__ for r in both) == ["Fenced", "Ownership"], (i, both)
    _run(nats, body)


def test_an_owner_superseded_before_it_opened_its_epoch_is_fenced(nats: NatsCluster) -> None:
    async def body(a: Ledger, b: Ledger) -> None:
        held = await a.take("call3", None)
        assert held is not None
        taken = await b.take("call3", await b.owner("call3"))
        assert taken is not None
        with pytest.raises(Fenced, match="owner is now"):
            await a.open_epoch(held)
        await b.open_epoch(taken)
    _run(nats, body)


def test_accepted_is_stored_by_a_quorum_and_outlives_its_leader(nats: NatsCluster) -> None:
    async def body(a: Ledger, b: Ledger) -> None:
        seq = await a.accept("call4", b"record")
        assert await a.accept("call4", b"record") == seq  # the same call: the same record
        info = await a._js.stream_info(CALLS_STREAM)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader
        assert len(info.cluster.replicas or []) == 2
        leader = next(i for i, n in enumerate(nats.nodes) if n.name == info.cluster.leader)
        nats.kill(leader)
        reader = b if leader != 1 else a
        assert await _until(lambda: _accepted(reader, "call4"), 30,
                            "the record read from the other two nodes") == b"record"
    _run(nats, body)


async def _accepted(ledger: Ledger, call_id: str) -> bytes:
    record = await ledger.accepted(call_id)
    if record is None:
        raise LookupError(f"call {call_id} not found")
    return record


def test_the_quorum_carries_on_without_one_node_and_it_catches_up(nats: NatsCluster) -> None:
    async def body(a: Ledger, b: Ledger) -> None:
        taken = await a.take("call5", None)
        assert taken is not None
        held = await a.open_epoch(taken)
        nats.kill(0)  # the node A is connected to: its client moves to another
        held = await _until(lambda: a.append(held, ["while n1 is down"]), 30,
                            "an append with two nodes of three")
        await _until(lambda: a.accept("call6", b"r"), 30, "an accept with two nodes of three")
        nats.restart(0)
        nats.kill(1)
        await _until(lambda: b.append(held, ["now n2 is down"]), 30,
                     "an append after n1 came back and n2 went")
        log: list[Any] = [r.body for r in await _until(lambda: b.read("call5"), 30, "the log")]
        assert log == [None, ["while n1 is down"], ["now n2 is down"]]
    _run(nats, body)


def test_an_append_tried_again_after_its_answer_was_lost_is_stored_once(
        nats: NatsCluster) -> None:
    """A sink whose append's answer was lost (a node died) tries it again: the
    same record at the same position is the same append (its id), so the log
    holds it once and the retry gets its sequence; another record at that
    position is still refused."""
    async def body(a: Ledger, b: Ledger) -> None:
        held = await a.take("call7", None)
        assert held is not None
        before = await a.open_epoch(held)
        after = await a.append(before, ["run"])
        again = await a.append(before, ["run"])  # its answer "lost": tried again
        assert again.log_seq == after.log_seq
        with pytest.raises(Fenced):
            await a.append(before, ["another run"])
        assert [r.body for r in await a.read("call7")] == [None, ["run"]]
    _run(nats, body)


def test_a_forwarded_cancel_reaches_its_host_and_one_naming_no_call_is_unknown(
        nats: NatsCluster) -> None:
    """Cancels across hosts (core NATS request/reply on sf.cancel.<host>): B's
    cancel reaches A's handler and comes back with A's answer; a request
    whose payload is not a call id (bytes msgpack cannot read, a list) is
    answered `unknown` without reaching the handler."""
    async def body(a: Ledger, b: Ledger) -> None:
        asked: list[str] = []

        def handle(call_id: str, reply_to: str) -> None:
            asked.append(call_id)
            asyncio.get_running_loop().create_task(
                a.cancels.answer(reply_to, {"op": "cancelling", "call_id": call_id}))
        await a.cancels.serve(handle)
        # B's node learns of A's subscription through the cluster's routes: until
        # then a request finds no responder (a cancel gets cluster_unavailable).
        answer = await _until(lambda: b.cancels.forward("host-a", "c1"), 10.0,
                              "A's subscription to reach B's node")
        assert answer == {"op": "cancelling", "call_id": "c1"}
        client = await nats_py.connect(servers=nats.urls[1:])  # a peer that speaks nonsense
        try:
            for junk in (b"\xc1", msgpack.packb([1, 2])):
                reply = await client.request("sf.cancel.host-a", junk, timeout=5.0)
                assert msgpack.unpackb(reply.data) == {"op": "unknown"}
        finally:
            await client.close()
        assert asked == ["c1"] * len(asked) and asked  # retried only while it had no responder
    _run(nats, body)
