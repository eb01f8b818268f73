"""The sink's side of cluster mode (docs/ARCHITECTURE.md §4.17, rules 3 and
6): this host's hold on each call's log on JetStream, of which the sink is
the only writer here.

`open_soon` appends an attempt's epoch record to the call's log (an
authorize, the done of a call it does not hold); `append_soon` appends a
batch of the call's rows, conditional on the last sequence this sink wrote
or read for the call; `follow_soon` reads a call another host runs and
follows its log. None waits: each answers by callback in the sink's thread
(the bridge's `run_done`), and sink/log_queue.py decides what waits
meanwhile. A refused append or open (error 10071: another host opened a
later epoch) drops the hold.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.ledger import Fenced, Owner, Ownership
from streamfence.cluster.records import EVENTS, Record, valid
from streamfence.cluster.settings import ClusterSettings

log = logging.getLogger("streamfence.sink")

Row = tuple[str, int, int, int, str, int, bytes]  # the store's: call, seq, last, attempt, op, n, body
# What an open answers: the rows the log held before the opened epoch (asked
# for), why not (another host owns the call), or what the cluster raised.
Opened = list[Row] | str | BaseException
# What an append answers: None (stored), why not (refused), or what the cluster raised.
Appended = str | BaseException | None


class ClusterLog:
    """Owns the bridge and, per call, the hold this sink has on its log."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.bridge = LedgerBridge(settings)
        self._held: dict[str, Ownership] = {}
        # Calls another host runs, followed here (§4.17, rule 5): their unsubscribes,
        # and the records their consumers delivered (filled by the ledger's thread).
        self._following: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}
        self._incoming: deque[tuple[str, Record]] = deque()
        self._starting: dict[str, list[Record]] = {}  # follows asked: records come early
        self.refused = 0  # runs the engine refused (their calls moved to another host)
        self.appends = 0

    def open_soon(self, call_id: str, attempt: int, read_before: bool,
                  then: Callable[[Opened], None]) -> None:
        """Open `attempt`'s epoch in the call's log, without waiting: `then(rows)`
        once opened, with `read_before` the rows the log holds before the epoch
        (void ones skipped: §4.17, rule 6), else []; `then(why not)` if the
        call's owner in the cluster is not this host at this epoch. Opened
        already: `then([])` at once."""
        held = self._held.get(call_id)
        if held is not None and held.epoch == attempt:
            then([])
            return
        ledger = self.bridge.ledger
        # Where this sink knows the log ends (Ledger.open_epoch `known`): nowhere
        # when it reads what is before, or held at a later epoch than asked.
        known = not read_before and (held is None or held.epoch < attempt)
        own = Ownership(Owner(call_id, self.settings.host, attempt, 0),
                        held.log_seq if known and held is not None else 0)

        async def open_and_read() -> tuple[Ownership, list[Record]]:
            opened = await ledger.open_epoch(own, known)
            return opened, (await ledger.read(call_id) if read_before else [])

        def done(result: Any) -> None:
            if isinstance(result, Fenced):
                self._held.pop(call_id, None)
                then(f"cluster_lost: {result}")
            elif isinstance(result, BaseException):
                then(result)
            else:
                opened, records = result
                self._held[call_id] = opened
                then(_rows(call_id, valid([r for r in records if r.seq < opened.log_seq])))
        self.bridge.submit(open_and_read(), done)

    def append_soon(self, call_id: str, rows: list[Row], then: Callable[[Appended], None]
                    ) -> None:
        """Append the call's rows, one record, without waiting: `then(None)` once
        stored, `then(why not)` if refused (the hold is dropped), `then(exception)`
        if the cluster failed (the same append may be tried again: its id makes
        a stored one a duplicate)."""
        body = [[seq, last, attempt, op, n, data] for _, seq, last, attempt, op, n, data in rows]

        def done(result: Any) -> None:
            if isinstance(result, Ownership):
                self._held[call_id] = result
                self.appends += 1
                then(None)
            elif isinstance(result, Fenced):
                self._held.pop(call_id, None)
                self.refused += 1
                then(f"cluster_lost: {result}")
            else:
                then(result)
        self.bridge.submit(self.bridge.ledger.append(self._held[call_id], body), done)

    def holds(self, call_id: str) -> bool:
        """This sink process has opened (or been given) the call's log before."""
        return call_id in self._held

    def follow_soon(self, call_id: str, then: Callable[[list[Record] | BaseException], None]
                    ) -> None:
        """Follow a call another host runs, without waiting: `then(the records its
        log holds now)`; the later ones come through `incoming` as they are
        stored, after those (the ones delivered before `then` are handed to it)."""
        if call_id in self._following or call_id in self._starting:
            then([])
            return
        self._starting[call_id] = []
        ledger = self.bridge.ledger

        def deliver(record: Record) -> None:  # in the ledger's thread
            self._incoming.append((call_id, record))
            self.bridge.wake()

        async def read_and_follow() -> tuple[list[Record], Callable[[], Coroutine[Any, Any, None]]]:
            records = await ledger.read(call_id)
            after = records[-1].seq if records else 0
            return records, await ledger.follow(call_id, after, deliver)

        def done(result: Any) -> None:
            early = self._starting.pop(call_id)
            if isinstance(result, BaseException):
                then(result)
                return
            records, self._following[call_id] = result
            then(records + early)
        self.bridge.submit(read_and_follow(), done)

    def unfollow(self, call_id: str) -> None:
        stop = self._following.pop(call_id, None)
        if stop is not None:
            self.bridge.submit(stop(), lambda _: None)

    def incoming(self) -> list[tuple[str, Record]]:
        """The followed calls' records delivered since last asked, in order."""
        out = []
        while self._incoming:
            call_id, record = self._incoming.popleft()
            early = self._starting.get(call_id)
            if early is not None:  # its follow's first read is not in yet: after it
                early.append(record)
            else:
                out.append((call_id, record))
        return out

    def stats(self) -> dict[str, int]:
        return {"cluster_appends": self.appends, "cluster_refused": self.refused,
                "cluster_engine_refused": self.bridge.ledger.refused}

    def close(self) -> None:
        self.bridge.close()


def _rows(call_id: str, records: list[Record]) -> list[Row]:
    """The store's rows that EVENTS records carry."""
    return [(call_id, seq, last, attempt, op, n, body) for record in records
            if record.kind == EVENTS for seq, last, attempt, op, n, body in record.body]
