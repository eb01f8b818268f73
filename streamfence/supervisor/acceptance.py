"""Acceptance: an admitted submit becomes a call (streamfence.supervisor.
admission decides that it may). The call is journaled, in cluster mode its
record made, and it is queued; its `accepted` reply goes only once it is
durable:

- after the journal commit of the loop turn (`flush_accepts`: one commit,
  one fsync, for every call of the turn);
- a large request's, only after its request file is durable too
  (`on_stored`: the file is written off the loop; the reply waits in
  `_staged`);
- in cluster mode, only once the cluster stored the call's record
  (ARCHITECTURE §4.17: accepted means replicated). A call the journal held
  at start that never ran is stored there again before it runs
  (`recovered`): its daemon may have died before the cluster had it.

A call whose journal write meets a storage fault was never accepted: it and
the turn's other new calls are refused with the fault's code
(`refuse_unstored`). Each answer, `accepted` or refused, is the submit's
access line (supervisor/access.py).
"""

from __future__ import annotations

import errno
import functools
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from streamfence.cluster.records import call_record
from streamfence.config.identities import Identity
from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.failpoints import ARMED, failpoint
from streamfence.protocol.messages import Submit, Subscribe, accepted_msg
from streamfence.supervisor.access import Submitter, log_submit
from streamfence.supervisor.admission import Admitted
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.calls import Call
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.livecalls import call_context
from streamfence.supervisor.timeouts import attempt_timeouts

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

log = logging.getLogger("streamfence.front")


class Accept(NamedTuple):
    """An `accepted` reply waiting to go: to whom (the routing id), the reply,
    the subscribe to make once it went (for whom: the submitter), and the
    submit's fields for its access line."""

    routing: bytes
    reply: dict[str, Any]
    then_subscribe: tuple[Identity, Subscribe] | None
    who: Submitter


Refuse = Callable[[bytes, str | None, ErrorCode, str], None]  # identity, ref, code, message


class Acceptance:
    """Owns the `accepted` replies waiting for this turn's journal commit, for
    a request file or for the cluster, the idempotency keys accepted this
    turn and the cluster records not stored yet; counts calls accepted.
    `refuse` answers an error (the Front's); `subscribe` follows a call for
    a submit's listener."""

    def __init__(self, journal: Journal, driver: AttemptDriver, clients: Clients,
                 counters: Counter[str], clock: Callable[[], float], refuse: Refuse,
                 subscribe: Callable[[bytes, Identity, Subscribe], None],
                 cluster: ClusterLink | None = None) -> None:
        self._journal = journal
        self._driver = driver
        self._clients = clients
        self._counters = counters
        self._clock = clock
        self._refuse = refuse
        self._subscribe = subscribe
        # Cluster mode (ARCHITECTURE §4.17): a new call's record until the cluster
        # stores it, and the replies that wait for that, by call id.
        self._cluster = cluster
        self._records: dict[str, bytes] = {}
        self._replicating: dict[str, list[Accept]] = {}
        # `accepted` replies by call id, until the commit that made the call
        # durable is synced; the calls whose replies came this turn, in order.
        self._unanswered: dict[str, list[Accept]] = {}
        self._turn: list[str] = []
        self._staged: dict[str, list[Accept]] = {}  # by call id, until its file is durable
        self._idem_in_turn: dict[tuple[str, str], str] = {}

    def existing(self, owner: str, idempotency_key: str) -> str | None:
        """The call `owner` submitted with this key: this turn's, or journaled."""
        scoped = (owner, idempotency_key)
        return self._idem_in_turn.get(scoped) or self._journal.call_by_idempotency_key(*scoped)

    def accept_duplicate(self, identity: bytes, user: Identity, req: Submit,
                         call_id: str) -> None:
        """The same call again: its id, once the call itself is accepted.
        Subscribed after `accepted` goes out, so the replay follows the reply."""
        reply = Accept(identity, accepted_msg(req.ref, call_id, duplicate=True),
                       _subscription(user, req, call_id), Submitter.of(user.name, req.call))
        if call_id in self._staged:
            self._staged[call_id].append(reply)
        else:
            self._wait_commit(call_id, [reply])

    def accept(self, identity: bytes, user: Identity, req: Submit, admitted: Admitted,
               frame: bytes | memoryview) -> None:
        """Journal the call, record it for the cluster, queue it; its reply
        waits for what makes it durable. `frame`: the submit frame (a large
        request's file holds it as sent)."""
        spec, profile = admitted.spec, admitted.profile
        call_id = uuid.uuid4().hex
        staged = self._journal.add_call(call_id, user.name, spec.idempotency_key,
                                        spec.session_id, spec.provider, spec.request,
                                        spec.options.to_map(), frame, admitted.overrides)
        fault = self._journal.fault
        who = Submitter.of(user.name, spec)
        if fault is not None:  # its own write found the fault: it and the turn's new calls
            self.refuse_unstored()
            log_submit(who, None, fault.code)  # no call: nothing was stored
            self._refuse(identity, req.ref, fault.code, fault.message)
            return
        if spec.idempotency_key is not None:
            self._idem_in_turn[(user.name, spec.idempotency_key)] = call_id
        group = admitted.group
        max_attempts = spec.options.max_attempts or (group or profile).max_attempts
        deadline = (self._clock() + spec.options.deadline_s
                    if spec.options.deadline_s is not None else None)
        call = Call(call_id=call_id, owner=user.name, spec=spec, profile=profile,
                    timeouts=attempt_timeouts(spec.options, profile, spec.request),
                    max_attempts=max_attempts, deadline=deadline, request_bytes=len(frame),
                    request_file=self._journal.request_file(call_id) if staged else None,
                    request_overrides=admitted.overrides, group=group,
                    profiles=admitted.profiles if group is not None else {})
        if self._cluster is not None:  # it runs once the cluster has it (_replicated)
            self._records[call_id] = call_record(call_id, user.name, spec.provider, spec.request,
                                                 spec.options.to_map(), spec.session_id,
                                                 spec.idempotency_key)
        self._driver.enqueue(call, staged=staged or self._cluster is not None)
        reply = Accept(identity, accepted_msg(req.ref, call_id),
                       _subscription(user, req, call_id), who)
        if staged:
            self._staged[call_id] = [reply]
        else:
            self._wait_commit(call_id, [reply])

    def on_stored(self) -> None:
        """Request files done since last asked: each call is accepted at this
        turn's commit, or, if its file could not be written, refused
        (`storage_error`) and forgotten."""
        for call_id, error in self._journal.stored():
            replies = self._staged.pop(call_id, [])
            live = self._driver.calls.has(call_id)  # not if an admin cancelled it meanwhile
            if error is None:
                if live and self._cluster is None:  # in cluster mode: once replicated
                    self._driver.release(call_id)
                self._wait_commit(call_id, replies)
                continue
            call = self._driver.calls.get(call_id)
            log.error("the request of call %s could not be stored (%s); it is refused",
                      call_id, error,
                      extra=call_context(call) if call is not None else {"call_id": call_id})
            if live:
                self._driver.drop(call_id)
            code = ErrorCode.STORAGE_FULL if error.errno == errno.ENOSPC \
                else ErrorCode.STORAGE_ERROR
            for reply in replies:
                self._refuse_reply(reply, code, f"the daemon could not store the request "
                                                f"({error.strerror}); it was not accepted")

    def refuse_unstored(self) -> None:
        """Calls whose journal writes failed with a storage fault were never
        accepted: each is dropped, and its submitters get the fault's code."""
        refused = self._journal.take_refused()
        fault = self._journal.fault
        for call_id in refused:
            if self._driver.calls.has(call_id):
                self._driver.drop(call_id)
            code, message = (fault.code, fault.message) if fault is not None else \
                (ErrorCode.STORAGE_ERROR, "the journal could not store the call")
            for reply in self._unanswered.pop(call_id, []) + self._staged.pop(call_id, []):
                self._refuse_reply(reply, code, message)

    def abandon_staged(self) -> None:
        """At shutdown: calls whose request file is not durable were never
        accepted (the journal forgets them at the next start); say so."""
        for replies in (*self._staged.values(), *self._unanswered.values()):
            for reply in replies:
                self._refuse_reply(reply, ErrorCode.SHUTTING_DOWN, "the daemon stopped "
                                   "before the request was stored; it was not accepted")
        self._staged.clear()
        self._unanswered.clear()

    def _wait_commit(self, call_id: str, replies: list[Accept]) -> None:
        self._unanswered.setdefault(call_id, []).extend(replies)
        self._turn.append(call_id)

    def flush_accepts(self) -> None:
        """Journal commit first; the `accepted` replies of this turn go once it
        is on disk (a duplicate's too: its call may be this turn's). A commit
        that meets a storage fault refuses the turn's new calls instead."""
        if self._turn:
            call_ids, self._turn = self._turn, []
            self._idem_in_turn.clear()
            self._journal.commit(then=functools.partial(self._send_accepts, call_ids))
        self.refuse_unstored()

    def _send_accepts(self, call_ids: list[str]) -> None:
        if ARMED:
            failpoint("supervisor.after_journal_commit")
        for call_id in call_ids:
            replies = self._unanswered.pop(call_id, [])
            record = self._records.pop(call_id, None)
            if record is not None and self._cluster is not None:
                # Accepted means replicated (ARCHITECTURE §4.17): answered then.
                self._replicating[call_id] = replies
                self._cluster.accept(call_id, record,
                                     functools.partial(self._replicated, call_id))
            elif call_id in self._replicating:  # a duplicate while its record is on its way
                self._replicating[call_id].extend(replies)
            else:
                self._answer(replies)

    def recovered(self, call: Call) -> None:
        """A call the journal held at start, to run again. In cluster mode one
        that never ran may be unknown to the cluster (its daemon died between
        the journal's commit and the record's replication: no other host can
        take it up, and its take at epoch 1 would find no entry and call it
        moved): it is stored there again first, as at its submit; a
        duplicate submit meanwhile waits with it."""
        if self._cluster is None or call.epoch > 0:
            self._driver.enqueue(call)
            return
        self._driver.enqueue(call, staged=True)
        self._replicating[call.call_id] = []
        self._rejoin(call)

    def _rejoin(self, call: Call) -> None:
        assert self._cluster is not None
        spec = call.spec
        record = call_record(call.call_id, call.owner, spec.provider, spec.request,
                             spec.options.to_map(), spec.session_id, spec.idempotency_key)
        self._cluster.accept(call.call_id, record, functools.partial(self._rejoined, call),
                             again=True)

    def _rejoined(self, call: Call, error: str | None) -> None:
        """Tried until the cluster answers: its `accepted` may have gone out
        before the restart. A call cancelled meanwhile is not tried again."""
        if error is not None and self._driver.calls.get(call.call_id) is call:
            self._rejoin(call)
            return
        self._replicated(call.call_id, None)

    def _answer(self, replies: list[Accept]) -> None:
        for identity, msg, then_subscribe, who in replies:
            duplicate = bool(msg.get("duplicate"))
            if not duplicate:
                self._counters["calls_accepted"] += 1
            self._clients.send(identity, msg)
            log_submit(who, msg["call_id"], duplicate=duplicate)
            if then_subscribe is not None:
                self._subscribe(identity, *then_subscribe)

    def _refuse_reply(self, reply: Accept, code: ErrorCode, message: str) -> None:
        """Refuse the submit whose `accepted` reply this was, with its access line."""
        log_submit(reply.who, reply.reply["call_id"], code)
        self._refuse(reply.routing, reply.reply["ref"], code, message)

    def _replicated(self, call_id: str, error: str | None) -> None:
        """Cluster mode: the cluster stored the call (it runs, and is answered
        `accepted`), or could not (it never runs; its submitters are refused)."""
        replies = self._replicating.pop(call_id, [])
        live = self._driver.calls.has(call_id)  # not if an admin cancelled it meanwhile
        if error is None:
            if live:
                self._driver.release(call_id)
            self._answer(replies)
            return
        if live:
            self._driver.drop(call_id)
        self._journal.finish_call(call_id, "refused")
        for reply in replies:
            self._refuse_reply(reply, ErrorCode.CLUSTER_UNAVAILABLE, f"the cluster did not "
                               f"store the call ({error}); it was not accepted")


def _subscription(user: Identity, req: Submit, call_id: str) -> tuple[Identity, Subscribe] | None:
    """A submit's listener follows the call from seq 1 (after `accepted`)."""
    return None if req.listener is None else \
        (user, Subscribe(ref=req.ref, call_id=call_id, listener=req.listener))
