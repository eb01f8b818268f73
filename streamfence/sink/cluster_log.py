"""The sink's side of cluster mode (docs/ARCHITECTURE.md §4.17, rules 3 and
6): the calls' logs on JetStream, written before the transcript.

`open` appends an attempt's epoch record to the call's log where the sink
opens the epoch itself (an adopt, a rebind, the done of a call it does not
hold, an authorize without a position); at an attempt's start the
supervisor opened it and `hold` records where. `replicate` appends, at each group
commit, one record per call with the rows the commit is about to store
(every call's append in flight together, each conditional on the last
sequence this sink wrote or read for the call) and returns the calls the
engine refused: another host opened a later epoch of each, so their rows
must never be stored or sent here. A call whose log this sink has not
opened (rows after a restart of the sink, before any authorize) is refused
the same way: the attempt is fenced and run again, never written blind.
Appends the cluster does not answer at once are waited for, and tried
again, through the sink's `pause` (sink/process.py, as a storage fault is
waited out): the supervisor's stats are answered meanwhile, its other ops
held for the loop, for up to 60 s (APPENDS_UNANSWERED).
"""

from __future__ import annotations

import asyncio
import logging
import select
import time
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.ledger import Fenced, Owner, Ownership
from streamfence.cluster.records import EVENTS, Record, valid
from streamfence.cluster.retry import RetryPolicy, retry_sync
from streamfence.cluster.settings import ClusterSettings
from streamfence.sink.store import StoreStopped

log = logging.getLogger("streamfence.sink")


class _Unanswered(Exception):
    """Appends of a commit the cluster did not answer (an election, a node gone)."""

    def __init__(self, failed: list[tuple[str, BaseException]]) -> None:
        super().__init__(f"appends of {len(failed)} call(s) failed ({failed[0][1]})")
        self.failed = failed


# The commit's appends the cluster did not answer are tried again (cluster/retry.py),
# 50 ms doubling to 1 s, for 60 s before the sink gives up (and is restarted).
APPENDS_UNANSWERED = RetryPolicy((_Unanswered,), first_s=0.05, factor=2.0, cap_s=1.0,
                                 budget_s=60.0)

# An append batch not answered within this is waited for through `pause` (the
# sink's stats are answered meanwhile).
ANSWERED_S = 0.05

Row = tuple[str, int, int, int, str, int, bytes]  # the store's: call, seq, last, attempt, op, n, body
# The sink's wait (sink/process.py, as for a storage fault): up to the seconds
# given, or until the descriptor given is readable; it answers the supervisor's
# stats and holds its other ops meanwhile. True when a stop was asked.
Pause = Callable[[float, int | None], bool]


def _sleep(seconds: float, fd: int | None) -> bool:
    """The default `pause`: wait for `fd` or the time; no stop is ever asked."""
    select.select([] if fd is None else [fd], [], [], seconds)
    return False


class ClusterLog:
    """Owns the bridge and, per call, the hold this sink has on its log."""

    def __init__(self, settings: ClusterSettings, pause: Pause = _sleep) -> None:
        self.settings = settings
        self._pause = pause
        self.bridge = LedgerBridge(settings)
        self._held: dict[str, Ownership] = {}
        # Calls another host runs, followed here (§4.17, rule 5): their unsubscribes,
        # and the records their consumers delivered (filled by the ledger's thread).
        self._following: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}
        self._incoming: deque[tuple[str, Record]] = deque()
        self.refused = 0  # runs the engine refused (their calls moved to another host)
        self.retries = 0  # appends tried again (the cluster did not answer)
        self.appends = 0

    def open(self, call_id: str, attempt: int) -> str | None:
        """Open `attempt`'s epoch in the call's log; None, or why not (the call's
        owner in the cluster is not this host at this epoch). Opened already: None."""
        held = self._held.get(call_id)
        if held is not None and held.epoch == attempt:
            return None
        own = Ownership(Owner(call_id, self.settings.host, attempt, 0))
        try:
            self._held[call_id] = self.bridge.call(self.bridge.ledger.open_epoch(own))
        except Fenced as exc:
            self._held.pop(call_id, None)
            return f"cluster_lost: {exc}"
        return None

    def holds(self, call_id: str) -> bool:
        """This sink process has opened (or been given) the call's log before."""
        return call_id in self._held

    def hold(self, call_id: str, attempt: int, log_seq: int) -> None:
        """The supervisor opened `attempt`'s epoch in the call's log at `log_seq`:
        this sink's appends go on from there (ARCHITECTURE §4.17)."""
        self._held[call_id] = Ownership(Owner(call_id, self.settings.host, attempt, 0), log_seq)

    def missing(self, call_id: str, after_seq: int) -> list[Row]:
        """The rows the call's log holds after `after_seq` (this sink's last stored
        one): after a restart of the sink, the runs its predecessor appended
        but never committed here (the log is written first)."""
        opened = self._held[call_id].log_seq
        records = self.bridge.call(self.bridge.ledger.read(call_id))
        return [row for row in _rows(call_id, valid([r for r in records if r.seq < opened]))
                if row[1] > after_seq]

    def adopt(self, call_id: str, epoch: int) -> list[Row] | str:
        """A call taken over at `epoch` from a host that lost its lease: open the
        epoch in its log (the old owner can write no more), and the rows the log
        holds before it (void records skipped: §4.17, rule 6); or why not."""
        lost = self.open(call_id, epoch)
        if lost is not None:
            return lost
        opened = self._held[call_id].log_seq
        records = self.bridge.call(self.bridge.ledger.read(call_id))
        return _rows(call_id, valid([r for r in records if r.seq < opened]))

    def follow(self, call_id: str) -> list[Record]:
        """Follow a call another host runs: the records its log holds now; the
        later ones come through `incoming` as they are stored."""
        if call_id in self._following:
            return []
        ledger = self.bridge.ledger
        records = self.bridge.call(ledger.read(call_id))
        after = records[-1].seq if records else 0

        def deliver(record: Record) -> None:  # in the ledger's thread
            self._incoming.append((call_id, record))
            self.bridge.wake()
        self._following[call_id] = self.bridge.call(ledger.follow(call_id, after, deliver))
        return records

    def unfollow(self, call_id: str) -> None:
        stop = self._following.pop(call_id, None)
        if stop is not None:
            self.bridge.submit(stop(), lambda _: None)

    def incoming(self) -> list[tuple[str, Record]]:
        """The followed calls' records delivered since last asked, in order."""
        out = []
        while self._incoming:
            out.append(self._incoming.popleft())
        return out

    def forget(self, call_ids: Iterable[str]) -> None:
        for call_id in call_ids:
            self._held.pop(call_id, None)

    def replicate(self, rows: list[Row]) -> set[str]:
        """Append each call's rows to its log; the calls refused (module docstring).
        Raises what the cluster raised otherwise (unreachable past the timeout)."""
        by_call: dict[str, list[list[Any]]] = defaultdict(list)
        for call_id, seq, last, attempt, op, n, body in rows:
            by_call[call_id].append([seq, last, attempt, op, n, body])
        refused = {c for c in by_call if c not in self._held}
        calls = [c for c in by_call if c in self._held]
        ledger = self.bridge.ledger

        def append_calls() -> None:
            nonlocal calls
            results = self._gathered([ledger.append(self._held[c], by_call[c]) for c in calls])
            failed = []
            for call_id, result in zip(calls, results, strict=True):
                if isinstance(result, Ownership):
                    self._held[call_id] = result
                    self.appends += 1
                elif isinstance(result, Fenced):
                    refused.add(call_id)
                    del self._held[call_id]
                elif isinstance(result, BaseException):
                    failed.append((call_id, result))
            calls = [c for c, _ in failed]
            if failed:  # the cluster is electing a leader, or a node went: wait it out
                raise _Unanswered(failed)
        if calls:
            try:
                retry_sync(APPENDS_UNANSWERED, append_calls, on_retry=self._retrying,
                           sleep=self._wait)
            except _Unanswered as exc:
                raise exc.failed[0][1] from None
        if refused:
            self.refused += len(refused)
            log.warning("sink: the cluster refused the runs of %d call(s) (%s): another host "
                        "owns them now", len(refused), ", ".join(sorted(refused)[:5]))
        return refused

    def _gathered(self, ops: list[Coroutine[Any, Any, Any]]) -> list[Any]:
        """`ops` run together in the ledger's loop; each one's result or exception.
        Waited for as a commit waits for SQLite while they answer within
        ANSWERED_S (the normal case: no other wake-up in between), then through
        `pause` (the supervisor's stats answered meanwhile, its other ops held),
        for up to 2 × timeout_s (their requests' own timeouts come first)."""
        got: list[list[Any]] = []

        async def all_of() -> list[Any]:
            return list(await asyncio.gather(*ops, return_exceptions=True))
        bridge = self.bridge
        bridge.submit(all_of(), got.append)
        select.select([bridge.fd], [], [], ANSWERED_S)
        deadline = time.monotonic() + self.settings.timeout_s * 2
        while True:
            bridge.run_done()  # the other callbacks too: all are this thread's
            if self._incoming:  # the loop's wake-up, consumed here: given back
                bridge.wake()
            if got:
                return got[0]
            left = deadline - time.monotonic()
            if left <= 0:
                return [TimeoutError(f"no answer within {self.settings.timeout_s * 2:g} s")
                        for _ in ops]
            if self._pause(left, bridge.fd):  # a stop asked (the final commit's, say):
                select.select([bridge.fd], [], [], left)  # the answer is still waited for

    def _wait(self, seconds: float) -> None:
        """`pause` for `seconds` between two tries; a stop asked meanwhile gives
        the commit up (as a storage fault's wait does)."""
        if self._pause(seconds, None):
            raise StoreStopped("a stop was asked while the cluster did not answer the "
                               "commit's appends: gave the commit up")

    def _retrying(self, failure: BaseException, wait_s: float) -> None:
        self.retries += 1
        log.warning("sink: %s; trying again in %.2f s", failure, wait_s)

    def stats(self) -> dict[str, int]:
        return {"cluster_appends": self.appends, "cluster_refused": self.refused,
                "cluster_append_retries": self.retries,
                "cluster_engine_refused": self.bridge.ledger.refused}

    def close(self) -> None:
        self.bridge.close()


def _rows(call_id: str, records: list[Record]) -> list[Row]:
    """The store's rows that EVENTS records carry."""
    return [(call_id, seq, last, attempt, op, n, body) for record in records
            if record.kind == EVENTS for seq, last, attempt, op, n, body in record.body]
