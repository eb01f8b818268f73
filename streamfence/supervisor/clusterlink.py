"""The supervisor's side of cluster mode (docs/ARCHITECTURE.md §4.17, rules
1, 2 and 4): a call's record replicated before it is `accepted`, each
attempt's ownership taken by compare-and-set before the sink hears of it,
and the leases: this host beats every lease / 3 in `sf_hosts`, and watches
the others' beats; a host whose beat has not moved for `lease_s` by this
host's own clock has lost its calls, and this host tries to take each one
(`take` from the entry it read, so of all the hosts trying one wins) and
hands the ones it won to the driver (`on_taken`).

Both go through the bridge (cluster/bridge.py) and answer by callback in
the supervisor's own loop (`run_done`, when `fd` is readable), as the
journal's commits and the sink's replies do.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import msgpack
import nats.errors

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.ledger import Owner
from streamfence.cluster.records import Beat
from streamfence.cluster.retry import RetryPolicy, TryAgain, retry_async
from streamfence.cluster.settings import ClusterSettings
from streamfence.protocol.errors import ErrorCode

log = logging.getLogger("streamfence.supervisor")
Won = tuple[Owner, dict[str, Any], str]  # a call taken over, its record, its owner before

AUDIT_LEASES = 3  # between two looks for this host's stray calls (`_audited`)
# How this side tries again (cluster/retry.py). An accept whose write failed or whose
# answer was lost (both writes are idempotent): for 3 × timeout_s.
ACCEPTING = RetryPolicy((TimeoutError, nats.errors.Error), first_s=0.1)
# A take's compare-and-set that found the entry changed: read it, try again at once
# (given up: the driver's next turn tries again).
ENTRY_RACED = RetryPolicy((TryAgain,), tries=5)
# A forwarded cancel the owner named does not know: the call moved while asked.
CANCEL_MOVED = RetryPolicy((TryAgain,), tries=5)


class ClusterLink:
    """Owns the bridge and, per live call, the owner entry this host last wrote."""

    def __init__(self, settings: ClusterSettings, lease_s: float,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self.lease_s = lease_s
        self._clock = clock
        self._accepting = ACCEPTING.within(settings.timeout_s * 3)
        self.bridge = LedgerBridge(settings)
        self._owners: dict[str, Owner] = {}
        self.accepted = 0
        self.moved = 0  # calls found owned by another host
        self.taken = 0  # calls taken from hosts that lost their lease
        self.takes_lost = 0  # ... that another host took first
        self._beat_at: float | None = None  # when this host's last beat was stored
        # Each other host's beat as last read, and when it last moved here.
        self._beats: dict[str, tuple[Beat, float]] = {}
        self._dead: set[str] = set()  # hosts whose calls were taken (until they beat again)
        self._next_beat = clock()
        self._watching = False  # a read of the beats is on its way
        self._next_audit = clock()
        self._auditing = False  # a listing of this host's calls is on its way
        self._writing: Counter[str] = Counter()  # accepts and takes on their way, per call
        self.on_taken: Callable[[Owner, dict[str, Any], str], None] = \
            lambda owner, record, taken_from: None
        self.knows: Callable[[str], bool] = lambda call_id: False  # the driver runs it
        # A cancel another host forwarded: the answer its client gets (the front's).
        self.on_cancel: Callable[[str], dict[str, Any]] = lambda call_id: {"op": "unknown"}
        self.bridge.call(self.bridge.ledger.cancels.serve(self._cancel_asked))

    @property
    def fd(self) -> int:
        return self.bridge.fd

    def run_done(self) -> None:
        self.bridge.run_done()

    def accept(self, call_id: str, record: bytes, then: Callable[[str | None], None], *,
               again: bool = False) -> None:
        """Store the call's record at the cluster's replication; `then(None)` once
        stored, or `then(why not)`. `again`: at start, a journaled call that
        never ran, which the cluster may lack (its host died between the
        journal's commit and the record's write, or between the record and
        its entry): what the cluster has stays, and a call another host ran
        since (its log holds records) gets no entry back."""
        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("the cluster did not store call %s: %s", call_id, result)
                then(f"{type(result).__name__}: {result}")
            else:
                if not again:
                    self.accepted += 1
                if result is not None:
                    self._owners[call_id] = result
                then(None)
        ledger = self.bridge.ledger

        async def accept() -> Owner | None:
            # Tried again (ACCEPTING): a write whose answer was lost (a node died) may
            # have landed, and both writes are idempotent (the record's id; the owner
            # entry, found as this host's at epoch 0).
            if not again or await ledger.accepted(call_id) is None:
                await ledger.accept(call_id, record)  # (its id dedupes within 2 min only)
            elif await ledger.last_record(call_id) is not None:
                return None  # run by another host since: its take at epoch 1 finds out
            # Owned by this host at epoch 0 (not run yet): should this host die
            # before the first attempt, the others find it in `sf_owners`.
            held = await ledger.take(call_id, None, 0)
            return held.owner if held is not None else await self._landed(call_id, 0)
        self._write(call_id, retry_async(self._accepting, accept), done)

    def lookup(self, call_id: str,
               then: Callable[[dict[str, Any] | str | None], None]) -> None:
        """The record of a call this host does not know, from `SF_CALLS`; None if
        the cluster has none; why, if it could not be asked."""
        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("cluster: could not look call %s up: %s", call_id, result)
                then(f"{type(result).__name__}: {result}")
            else:
                then(msgpack.unpackb(result, raw=False) if result is not None else None)
        self.bridge.submit(self.bridge.ledger.accepted(call_id), done)

    def take(self, call_id: str, epoch: int, then: Callable[[bool | str], None]) -> None:
        """Own the call at `epoch` (an attempt about to start), by compare-and-set
        in the ledger's loop (a burst's together); the sink, the only writer of
        the call's log, opens the epoch there at the authorize: `then(True)`;
        `then(False)`: another host owns it; `then(why)`: the cluster failed."""
        seen = self._owners.get(call_id)
        taken = seen is not None and seen.host == self.settings.host and seen.epoch == epoch

        async def take() -> Owner | None:
            return seen if taken else await self._own(call_id, seen, epoch)

        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("the cluster did not take call %s at epoch %d: %s", call_id,
                            epoch, result)
                then(f"{type(result).__name__}: {result}")
            elif result is None:
                self.moved += 1
                self._owners.pop(call_id, None)
                then(False)
            else:
                self._owners[call_id] = result
                then(True)
        self._write(call_id, take(), done)

    def _write(self, call_id: str, op: Coroutine[Any, Any, Any],
                done: Callable[[Any], None]) -> None:
        """`op` on the call's entry, in the ledger's loop, counted as on its way
        until `done` (so the look for strays leaves the call alone meanwhile)."""
        self._writing[call_id] += 1

        def finished(result: Any) -> None:
            self._writing[call_id] -= 1
            if not self._writing[call_id]:
                del self._writing[call_id]
            done(result)
        self.bridge.submit(op, finished)

    async def _own(self, call_id: str, seen: Owner | None, epoch: int) -> Owner | None:
        """This host's entry for the call raised to `epoch` from the entry it
        last saw (`seen`, or read now); None if the entry is another host's, or
        gone (done: after this host's restart, not ours either way). A
        compare-and-set that finds the entry changed reads it again: changed by
        this host's own earlier write whose answer was lost (a try at this
        epoch, which then stands, or at an earlier one: the driver's next try
        comes at the next epoch), or by another host."""
        ledger = self.bridge.ledger
        current = seen if seen is not None else await ledger.owner(call_id)

        async def raised_entry() -> Owner | None:
            nonlocal current
            if current is None or current.host != self.settings.host:
                return None
            if current.epoch == epoch:  # this very write landed before
                return current
            if current.epoch > epoch:  # the driver's next try comes at the next epoch
                raise ValueError(f"call {call_id}: this host owns it at epoch "
                                 f"{current.epoch}, above {epoch}")
            held = await ledger.take(call_id, current, epoch)
            if held is not None:
                return held.owner
            current = await ledger.owner(call_id)
            raise TryAgain
        try:
            return await retry_async(ENTRY_RACED, raised_entry)
        except TryAgain:
            raise TimeoutError(f"call {call_id}: its entry kept changing for "
                               f"{ENTRY_RACED.tries} tries") from None

    async def _landed(self, call_id: str, epoch: int) -> Owner | None:
        """A compare-and-set found the entry changed: by this host's own earlier
        write at `epoch`, whose answer was lost (then it is this host's), or by
        another host (None)."""
        current = await self.bridge.ledger.owner(call_id)
        if current is not None and current.host == self.settings.host \
                and current.epoch == epoch:
            return current
        return None

    def forget(self, call_id: str) -> None:
        self._owners.pop(call_id, None)

    def finished(self, call_id: str) -> None:
        """The call's done is stored: its entry in `sf_owners` goes."""
        owner = self._owners.pop(call_id, None)
        if owner is not None:
            self._write(call_id, self.bridge.ledger.release(owner), _ignore)

    # ---- cancels across hosts ------------------------------------------------------

    def cancel(self, call_id: str,
               then: Callable[[dict[str, Any] | tuple[ErrorCode, str]], None]) -> None:
        """Have the host that runs the call cancel it: `then(its answer)` (op
        `cancelling`, or the call's done), or `then((code, message))` if no host
        confirmed it (PROTOCOL §7): `cancel_unknown`, the owner was asked and
        did not answer in time (it may have the cancel, and act on it);
        `cluster_unavailable`, no host got it (the cluster failed, no host
        serves the owner's cancels, or none owns the call now: it has just
        ended, or is being taken over), so it never takes effect."""
        ledger = self.bridge.ledger

        def unasked(why: str) -> tuple[ErrorCode, str]:
            return ErrorCode.CLUSTER_UNAVAILABLE, (
                f"call {call_id!r} runs on another host of the cluster, which could not be "
                f"asked to cancel it ({why}); nothing was cancelled: ask again")

        def unconfirmed(host: str, why: str) -> tuple[ErrorCode, str]:
            return ErrorCode.CANCEL_UNKNOWN, (
                f"call {call_id!r} runs on host {host!r}, which may have the cancel or get "
                f"it late ({why}); it may still take effect: ask `result`, or cancel again")

        async def ask_the_owner() -> dict[str, Any] | tuple[ErrorCode, str]:
            owner = await ledger.owner(call_id)
            if owner is None:
                return unasked("no host owns it now: it has just ended, or is being "
                               "taken over")
            try:  # NoRespondersError passes: sent to no host, it never takes effect
                answer = await ledger.cancels.forward(owner.host, call_id)
            except TimeoutError as exc:  # sent: the owner may act on it, now or late
                log.warning("cluster: host %r did not answer the cancel of call %s; it may "
                            "yet cancel it", owner.host, call_id)
                return unconfirmed(owner.host, f"no answer in time: {_why(exc)}")
            if answer.get("op") == "unknown":  # the call moved while it was asked
                raise TryAgain
            if answer.get("op") not in ("cancelling", "done"):
                return unconfirmed(owner.host, f"an answer not understood: {answer!r}")
            return answer

        async def cancel() -> dict[str, Any] | tuple[ErrorCode, str]:
            try:
                return await retry_async(CANCEL_MOVED, ask_the_owner)
            except TryAgain:  # each owner asked said it does not run it: none cancelled
                return unasked(f"asked {CANCEL_MOVED.tries} times, the host named its owner "
                               f"did not run it: it is moving between hosts")

        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("cluster: could not forward the cancel of call %s: %s", call_id,
                            result)
                then(unasked(_why(result)))
            else:
                then(result)
        self.bridge.submit(cancel(), done)

    def _cancel_asked(self, call_id: str, reply_to: str) -> None:
        """In the ledger's thread: a cancel forwarded to this host, answered from
        the supervisor's (`on_cancel`)."""
        def answer() -> None:
            self.bridge.submit(self.bridge.ledger.cancels.answer(reply_to, self.on_cancel(call_id)),
                               _ignore)
        self.bridge.post(answer)

    # ---- leases ------------------------------------------------------------------

    def next_due(self) -> float:
        return self._next_beat

    def tick(self, now: float) -> None:
        """Every lease / 3: beat, and read the others' beats (`_judge`); every
        AUDIT_LEASES leases (the first at the start), look for this host's
        strays (`_audited`)."""
        if now < self._next_beat:
            return
        self._next_beat = now + self.lease_s / 3
        ledger = self.bridge.ledger
        self.bridge.submit(ledger.beat(len(self._owners)), self._beaten)
        if not self._watching:
            self._watching = True
            self.bridge.submit(ledger.host_beats(), self._judge)
        if now >= self._next_audit and not self._auditing:
            self._auditing = True
            self._next_audit = now + AUDIT_LEASES * self.lease_s
            self.bridge.submit(ledger.owned_by(self.settings.host), self._audited)

    def _beaten(self, result: Any) -> None:
        if isinstance(result, BaseException):
            log.debug("cluster: a beat failed: %s", result)
        else:
            self._beat_at = self._clock()

    def _judge(self, result: Any) -> None:
        self._watching = False
        if isinstance(result, BaseException):
            log.warning("cluster: could not read the hosts' beats: %s", result)
            return
        now = self._clock()
        for host, beat in result.items():
            if host == self.settings.host:
                continue
            last = self._beats.get(host)
            if last is None or last[0].revision != beat.revision:
                self._beats[host] = (beat, now)
                self._dead.discard(host)
            elif now - last[1] >= self.lease_s and host not in self._dead:
                self._dead.add(host)
                log.warning("cluster: host %r has not beaten for %.1f s (lease %g s): taking "
                            "over its calls", host, now - last[1], self.lease_s)

                async def take_over(host: str = host) -> tuple[list[Won], int, int]:
                    return await self._take_over(await self.bridge.ledger.owned_by(host))
                self.bridge.submit(take_over(), functools.partial(self._took, host=host))

    def _audited(self, result: Any) -> None:
        """The calls `sf_owners` says this host owns that run nowhere here
        (strays) are taken up as calls taken over are: a take-over or an accept
        whose journal write this host did not live to commit, a take whose
        answer was lost, a call it had moved away and won back. Any call this
        host runs, or has a write on its way for, is not one."""
        self._auditing = False
        if isinstance(result, BaseException):
            log.warning("cluster: could not list this host's calls: %s", result)
            return
        strays = [o for o in result if o.call_id not in self._owners
                  and not self._writing[o.call_id] and not self.knows(o.call_id)]
        if strays:
            log.warning("cluster: %d call(s) this host owns in the cluster run nowhere here; "
                        "taking them up", len(strays))
            self.bridge.submit(self._take_over(strays), self._took)

    async def _take_over(self, entries: list[Owner]) -> tuple[list[Won], int, int]:
        """Take each call from the entry read at its next epoch: those this host
        won, with their records, how many could not be tried (the cluster
        failed: a call whose write may have landed is found by the audit), and
        how many another host took first."""
        ledger = self.bridge.ledger
        won, failed, lost = [], 0, 0
        for seen in entries:
            try:
                held = await ledger.take(seen.call_id, seen)
                owner = held.owner if held is not None else \
                    await self._landed(seen.call_id, seen.epoch + 1)
                if owner is None:
                    lost += 1  # another host was first
                    continue
                record = await ledger.accepted(seen.call_id)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("cluster: could not take call %s: %s", seen.call_id, exc)
                failed += 1
                continue
            if record is None:
                log.error("cluster: call %s has an owner but no record; left alone",
                          seen.call_id)
                continue
            won.append((owner, msgpack.unpackb(record, raw=False), seen.host))
        return won, failed, lost

    def _took(self, result: Any, host: str | None = None) -> None:
        failed = isinstance(result, BaseException) or result[1] > 0
        if failed and host is not None:
            log.warning("cluster: taking over the calls of %r failed in part (%s); tried "
                        "again at the next look", host, result)
            self._dead.discard(host)
            self._beats.pop(host, None)  # judged again from the next read
        if isinstance(result, BaseException):
            return
        self.takes_lost += result[2]
        for owner, record, taken_from in result[0]:
            self._owners[owner.call_id] = owner
            self.taken += 1
            self.on_taken(owner, record, taken_from)

    def stats(self) -> dict[str, Any]:
        """`status`'s `cluster` (docs/PROTOCOL.md): ages by this host's clock;
        another host's beat age counts from when this host saw it move (it
        reads the beats every lease / 3)."""
        now = self._clock()
        return {"host": self.settings.host, "lease_s": self.lease_s,
                "lease_age_s": None if self._beat_at is None else round(now - self._beat_at, 3),
                "connected": self.bridge.ledger.connected,
                "hosts": {host: {"beat_age_s": round(now - seen, 3),
                                 "lease_lost": host in self._dead,
                                 "calls_owned": beat.calls_owned}
                          for host, (beat, seen) in sorted(self._beats.items())},
                "calls_owned": len(self._owners), "calls_accepted": self.accepted,
                "calls_moved": self.moved, "takes_won": self.taken,
                "takes_lost": self.takes_lost}

    def close(self) -> None:
        self.bridge.close()


def _why(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__


def _ignore(result: Any) -> None:
    if isinstance(result, BaseException):
        log.debug("cluster: %s", result)
