"""The client-facing side: decode and validate each frame and answer every
request (echoing its `ref`).

Bad input never raises out of here: it becomes an `error` reply with a
precise code, counted under `bad_input.<code>`. Submits are answered only
after the journal commit of the loop turn (see `flush_accepts`); a large
request's, only after its request file is durable too (`on_stored`: the file
is written off the loop, and the reply waits in `_staged`).

Every request comes with the identity that sent it (docs/SECURITY.md): a call
belongs to its submitter, and another identity's call answers exactly as a
call that does not exist (`unknown_call`), unless the asker is an admin.
"""

from __future__ import annotations

import errno
import functools
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import msgpack

from streamfence.cluster.records import call_record
from streamfence.config.identities import Identity
from streamfence.config.model import DaemonConfig
from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.messages import (
    MAX_REF_LEN,
    Cancel,
    Result,
    Status,
    Submit,
    Subscribe,
    accepted_msg,
    error_msg,
    parse_request,
    pending_msg,
    ref_of,
)
from streamfence.sink.transcript import stored_done
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls import Call
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.requests import check_request
from streamfence.supervisor.sinklink import Refused, SinkLink, SinkLost
from streamfence.supervisor.submit_rate import SubmitRate
from streamfence.supervisor.timeouts import attempt_timeouts

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

EARLY_CHECK_BYTES = 64 << 10  # a submit this large meets its byte limits before it is decoded
PEEK_BYTES = 512  # where its op and ref are looked for
HOLD_MAX_S = 1.0  # a rate refusal is answered after its wait, at most this much later

log = logging.getLogger("streamfence.front")

# Codes that mean "the client sent something we cannot take" (counted as bad
# input), as opposed to refusals of a well-formed request (breaker, overload).
BAD_INPUT = frozenset({ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE, ErrorCode.BAD_MESSAGE,
                       ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OP,
                       ErrorCode.UNKNOWN_PROVIDER, ErrorCode.UNKNOWN_CALL})


_UNSET = object()
Accept = tuple[bytes, dict[str, Any], Subscribe | None]  # routing id, reply, then subscribe


class Front:
    """Owns request handling: the `accepted` replies waiting for this turn's
    journal commit or for a request file, the idempotency keys seen this turn,
    and whether new calls are accepted; counts calls accepted, bad input and refusals. New calls go
    to the AttemptDriver; replies go through Clients; subscriptions to the
    sink, which sends the events.
    `status` gives a status reply's body (each owner's view) to a callback."""

    def __init__(self, config: DaemonConfig, journal: Journal, driver: AttemptDriver,
                 clients: Clients, sink: SinkLink, breakers: Breakers, counters: Counter[str],
                 clock: Callable[[], float], transcript_path: str,
                 status: Callable[[Identity, Callable[[dict[str, Any]], None]], None],
                 cluster: ClusterLink | None = None) -> None:
        self._config = config
        # Cluster mode (ARCHITECTURE §4.17): a new call's record until the cluster
        # stores it, and the replies that wait for that, by call id.
        self._cluster = cluster
        self._records: dict[str, bytes] = {}
        self._replicating: dict[str, list[Accept]] = {}
        # Calls another host runs that were asked for here -> their owner identity.
        self._followed: OrderedDict[str, str] = OrderedDict()
        self._journal = journal
        self._driver = driver
        self._clients = clients
        self._sink = sink
        self._breakers = breakers
        self._clock = clock
        self._transcript_path = transcript_path
        self._status = status
        # `accepted` replies by call id, until the commit that made the call
        # durable is synced; the calls whose replies came this turn, in order.
        self._unanswered: dict[str, list[Accept]] = {}
        self._turn: list[str] = []
        self._staged: dict[str, list[Accept]] = {}  # by call id, until its file is durable
        self._idem_in_turn: dict[tuple[str, str], str] = {}
        self._rate = SubmitRate(clock)
        self._byte_rate = SubmitRate(clock)  # request bytes per second, per identity
        self.accepting = True
        self._counters = counters

    def _error(self, identity: bytes, ref: str | None, code: ErrorCode, message: str,
               hold_s: float = 0.0) -> None:
        """Refuse a request; `hold_s`: answer that much later (a rate's wait)."""
        kind = "bad_input." if code in BAD_INPUT else "refused."
        self._counters[kind + code.value] += 1
        if hold_s > 0:
            self._clients.send_at(identity, error_msg(ref, code, message),
                                  self._clock() + min(hold_s, HOLD_MAX_S))
        else:
            self._clients.send(identity, error_msg(ref, code, message))

    # ---- one frame ---------------------------------------------------------
    def handle(self, frames: Sequence[bytes | memoryview], user: Identity) -> None:
        """One client message from `user` (the identity its key is registered as):
        its routing id, then its frames (views of the received buffers)."""
        identity = bytes(frames[0])
        if len(frames) != 2:
            self._error(identity, None, ErrorCode.BAD_FRAME,
                        f"a request must be exactly one frame, got {len(frames) - 1}")
            return
        body = frames[1]
        if len(body) >= EARLY_CHECK_BYTES and self._refused_unread(identity, user, body):
            return
        obj: Any = None
        try:
            obj = decode_untrusted(body, self._config.max_frame_bytes)
            request = parse_request(obj)
        except ProtocolError as exc:
            self._error(identity, ref_of(obj), exc.code, exc.message)
            return
        try:
            if isinstance(request, Submit):
                self._submit(identity, user, request, body)
            elif isinstance(request, Status):
                ref = request.ref
                self._status(user, lambda body: self._clients.send(
                    identity, {"v": 1, "op": "status_reply", "ref": ref, **body}))
            elif self._cluster is not None and (
                    self._journal.owner_of(request.call_id) is None
                    or self._journal.is_moved(request.call_id)):
                self._remote(identity, user, request)  # another host's, if any
            elif not self._may_see(user, request.call_id):
                self._error(identity, request.ref, ErrorCode.UNKNOWN_CALL,
                            f"no call {request.call_id!r}")
            elif isinstance(request, Subscribe):
                self._subscribe(identity, request)
            elif isinstance(request, Result):
                self._result(identity, request)
            elif isinstance(request, Cancel):
                self._cancel(identity, request)
        except Exception:  # a bug must cost one reply, never the daemon
            log.exception("internal error while handling %s", type(request).__name__)
            self._error(identity, request.ref, ErrorCode.INTERNAL, "internal error; see the log")

    def _may_see(self, user: Identity, call_id: str) -> bool:
        """Does `call_id` exist for `user`? (Its owner, or any call for an admin.)"""
        owner = self._journal.owner_of(call_id)
        return owner is not None and (owner == user.name or user.is_admin)

    def _remote(self, identity: bytes, user: Identity, request: Subscribe | Result | Cancel
                ) -> None:
        """Cluster mode: a call this host does not know may run on another
        (ARCHITECTURE §4.17, rule 5). Its record in the cluster says who may
        see it; this host's sink then follows its log, and the request is
        served from here as for a call of this host's."""
        assert self._cluster is not None
        call_id = request.call_id

        def looked_up(record: dict[str, Any] | str | None) -> None:
            if isinstance(record, str):
                self._error(identity, request.ref, ErrorCode.CLUSTER_UNAVAILABLE,
                            f"this host does not know call {call_id!r} and could not ask "
                            f"the cluster ({record}); ask again")
                return
            owner = None if record is None else str(record.get("owner"))
            if owner is None or (owner != user.name and not user.is_admin):
                self._error(identity, request.ref, ErrorCode.UNKNOWN_CALL, f"no call {call_id!r}")
                return
            # The sink's follow is idempotent: it answers whether the call is done.
            self._sink.follow(call_id, functools.partial(self._following, identity, request,
                                                         owner))
        known = self._followed.get(call_id)
        if known is not None:
            looked_up({"owner": known})
        else:
            self._cluster.lookup(call_id, looked_up)

    def _following(self, identity: bytes, request: Subscribe | Result | Cancel, owner: str,
                   reply: dict[str, Any] | Refused | SinkLost) -> None:
        call_id = request.call_id
        if not isinstance(reply, dict):
            self._error(identity, request.ref, ErrorCode.INTERNAL,
                        f"this host could not follow call {call_id} from the cluster: "
                        f"{getattr(reply, 'reason', 'the sink restarted')}")
            return
        self._followed[call_id] = owner
        while len(self._followed) > FOLLOWED_KEEP:
            self._followed.popitem(last=False)
        done = stored_done(self._transcript_path, call_id) if reply.get("done") else None
        if isinstance(request, Subscribe):
            self._subscribe(identity, request, live=done is None)
        elif isinstance(request, Result):
            if done is not None:
                self._clients.send(identity, dict(done, ref=request.ref, diagnostics=[]))
            elif request.wait_s > 0:
                self._clients.wait_result(call_id, identity, request.ref,
                                          self._clock() + request.wait_s)
            else:
                self._clients.send(identity, pending_msg(request.ref, call_id))
        elif done is not None:
            self._clients.send(identity, dict(done, ref=request.ref))
        else:  # the host that runs it cancels it
            assert self._cluster is not None
            self._cluster.cancel(call_id, functools.partial(self._cancelled_there, identity,
                                                            request))

    def _cancelled_there(self, identity: bytes, request: Subscribe | Result | Cancel,
                         answer: dict[str, Any] | str | None) -> None:
        """Cluster mode: the answer of the host that runs the call to its cancel."""
        call_id = request.call_id
        if isinstance(answer, dict) and answer.get("op") == "cancelling":
            self._clients.send(identity, {"v": 1, "op": "cancelling", "ref": request.ref,
                                          "call_id": call_id})
        elif isinstance(answer, dict) and answer.get("op") == "done":
            self._clients.send(identity, dict(answer, ref=request.ref))
        else:
            why = answer if isinstance(answer, str) else \
                "no host owns it now: it has just ended, or is being taken over"
            self._error(identity, request.ref, ErrorCode.CLUSTER_UNAVAILABLE,
                        f"call {call_id!r} runs on another host of the cluster, which could "
                        f"not be asked to cancel it ({why}); ask again")

    def cancel_for_peer(self, call_id: str) -> dict[str, Any]:
        """Cluster mode: a cancel another host forwarded (it checked that its
        client may see the call). The answer: `cancelling`, the call's done, or
        `unknown` (not this host's: the asker looks for its owner again)."""
        if self._driver.has_call(call_id):
            self._driver.cancel(call_id)
            return {"op": "cancelling"}
        done = self._done_of(call_id)
        return dict(done) if done is not None else {"op": "unknown"}

    # ---- ops -----------------------------------------------------------------
    def _submit(self, identity: bytes, user: Identity, req: Submit,
                frame: bytes | memoryview) -> None:
        """`frame`: the submit frame; its length is what the byte budgets count
        as the request's size. Why the frame and not `encode(request)`: it is at
        hand for free (encoding again is a pass over up to max_frame_bytes per
        submit), and it is an honest upper bound of the request's encoding,
        which the frame holds next to an envelope of some 100 bytes."""
        spec = req.call
        size = len(frame)
        if not self.accepting:
            self._error(identity, req.ref, ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            return
        fault = self._journal.fault
        if fault is not None:  # nothing new is accepted until the journal can commit
            self._error(identity, req.ref, fault.code, fault.message)
            return
        providers = self._config.providers
        profile = providers.get(spec.provider)
        if profile is None or not user.may_use(spec.provider):
            # A profile this identity may not use is one it cannot see.
            known = ", ".join(sorted(p for p in providers if user.may_use(p))) or "none"
            self._error(identity, req.ref, ErrorCode.UNKNOWN_PROVIDER,
                        f"no provider profile {spec.provider!r} (configured: {known})")
            return
        existing = None
        if spec.idempotency_key is not None:
            scoped = (user.name, spec.idempotency_key)
            existing = (self._idem_in_turn.get(scoped)
                        or self._journal.call_by_idempotency_key(*scoped))
        if existing is not None:
            # The same call again: its id, and nothing new starts.
            # Subscribed after `accepted` goes out, so the replay follows the reply.
            reply = (identity, accepted_msg(req.ref, existing, duplicate=True),
                     self._subscription(req, existing))
            if existing in self._staged:
                self._staged[existing].append(reply)
            else:
                self._wait_commit(existing, [reply])
            return
        refusal = self._breakers.admit((spec.session_id or "-", spec.provider))
        if refusal is not None:
            self._error(identity, req.ref, ErrorCode.BREAKER_OPEN, refusal)
            return
        queued = self._driver.queued()
        if queued >= self._config.queue_max:
            self._error(identity, req.ref, ErrorCode.OVERLOADED,
                        f"{queued} calls are queued (queue_max); retry later")
            return
        if self._over_in_flight_bytes(identity, req.ref, size):
            return
        in_flight = self._driver.in_flight(user.name)
        if user.max_in_flight and in_flight >= user.max_in_flight:
            self._error(identity, req.ref, ErrorCode.TOO_MANY_CALLS,
                        f"{in_flight} calls of {user.name!r} are not done yet (max_in_flight "
                        f"{user.max_in_flight}); submit again when one ends")
            return
        if self._over_max_in_flight_bytes(identity, user, req.ref, size):
            return
        wait_s = self._rate.admit(user.name, user.submits_per_s)
        if wait_s is not None:
            self._error(identity, req.ref, ErrorCode.RATE_LIMITED,
                        f"{user.name!r} may submit {user.submits_per_s:g} calls per second; "
                        f"retry in {wait_s:.2f}s", hold_s=wait_s)
            return
        wait_s = self._byte_rate.admit(user.name, user.submit_bytes_per_s, size)
        if wait_s is not None:
            self._byte_rate_refused(identity, user, req.ref, wait_s)
            return
        try:
            request = check_request(profile.kind, spec.request, user.caps)
        except ProtocolError as exc:
            self._error(identity, req.ref, exc.code, exc.message)
            return
        # The fields admission set (a cap filled in): with a large request, the
        # journal keeps the frame as sent, and these beside it.
        overrides = {k: v for k, v in request.items() if spec.request.get(k, _UNSET) is not v}
        if overrides:
            spec = replace(spec, request=request)
        call_id = uuid.uuid4().hex
        staged = self._journal.add_call(call_id, user.name, spec.idempotency_key,
                                        spec.session_id, spec.provider, spec.request,
                                        spec.options.to_map(), frame, overrides)
        fault = self._journal.fault
        if fault is not None:  # its own write found the fault: it and the turn's new calls
            self.refuse_unstored()
            self._error(identity, req.ref, fault.code, fault.message)
            return
        if spec.idempotency_key is not None:
            self._idem_in_turn[(user.name, spec.idempotency_key)] = call_id
        max_attempts = spec.options.max_attempts or profile.max_attempts
        deadline = (self._clock() + spec.options.deadline_s
                    if spec.options.deadline_s is not None else None)
        call = Call(call_id=call_id, owner=user.name, spec=spec, profile=profile,
                    timeouts=attempt_timeouts(spec.options, profile, spec.request),
                    max_attempts=max_attempts, deadline=deadline, request_bytes=size,
                    request_file=self._journal.request_file(call_id) if staged else None,
                    request_overrides=overrides)
        if self._cluster is not None:  # it runs once the cluster has it (_replicated)
            self._records[call_id] = call_record(call_id, user.name, spec.provider, spec.request,
                                                 spec.options.to_map(), spec.session_id,
                                                 spec.idempotency_key)
        self._driver.enqueue(call, staged=staged or self._cluster is not None)
        reply = (identity, accepted_msg(req.ref, call_id), self._subscription(req, call_id))
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
            live = self._driver.has_call(call_id)  # not if an admin cancelled it meanwhile
            if error is None:
                if live and self._cluster is None:  # in cluster mode: once replicated
                    self._driver.release(call_id)
                self._wait_commit(call_id, replies)
                continue
            log.error("the request of call %s could not be stored (%s); it is refused",
                      call_id, error)
            if live:
                self._driver.drop(call_id)
            code = ErrorCode.STORAGE_FULL if error.errno == errno.ENOSPC \
                else ErrorCode.STORAGE_ERROR
            for identity, msg, _ in replies:
                self._error(identity, msg["ref"], code,
                            f"the daemon could not store the request ({error.strerror}); "
                            f"it was not accepted")

    def refuse_unstored(self) -> None:
        """Calls whose journal writes failed with a storage fault were never
        accepted: each is dropped, and its submitters get the fault's code."""
        refused = self._journal.take_refused()
        fault = self._journal.fault
        for call_id in refused:
            if self._driver.has_call(call_id):
                self._driver.drop(call_id)
            code, message = (fault.code, fault.message) if fault is not None else \
                (ErrorCode.STORAGE_ERROR, "the journal could not store the call")
            for identity, msg, _ in self._unanswered.pop(call_id, []) + \
                    self._staged.pop(call_id, []):
                self._error(identity, msg["ref"], code, message)

    def abandon_staged(self) -> None:
        """At shutdown: calls whose request file is not durable were never
        accepted (the journal forgets them at the next start); say so."""
        for replies in (*self._staged.values(), *self._unanswered.values()):
            for identity, msg, _ in replies:
                self._error(identity, msg["ref"], ErrorCode.SHUTTING_DOWN,
                            "the daemon stopped before the request was stored; it was not "
                            "accepted")
        self._staged.clear()
        self._unanswered.clear()

    def _refused_unread(self, identity: bytes, user: Identity, frame: bytes | memoryview) -> bool:
        """Refuse a large submit over a byte limit before decoding it: a client
        that sends giant requests again and again must not cost the loop their
        decoding (the checks are _submit's, whose byte rate takes the tokens)."""
        op, ref = _peek_op_ref(frame)
        if op != "submit":
            return False
        size = len(frame)
        if (self._over_in_flight_bytes(identity, ref, size)
                or self._over_max_in_flight_bytes(identity, user, ref, size)):
            return True
        wait_s = self._byte_rate.wait(user.name, user.submit_bytes_per_s, size)
        if wait_s is not None:
            self._byte_rate_refused(identity, user, ref, wait_s)
            return True
        return False

    def _byte_rate_refused(self, identity: bytes, user: Identity, ref: str | None,
                           wait_s: float) -> None:
        self._counters["refused_bytes.submit_bytes_per_s"] += 1
        self._error(identity, ref, ErrorCode.RATE_LIMITED,
                    f"{user.name!r} may submit {_size(int(user.submit_bytes_per_s))} of requests "
                    f"per second (submit_bytes_per_s); retry in {wait_s:.2f}s", hold_s=wait_s)

    def _over_in_flight_bytes(self, identity: bytes, ref: str | None, size: int) -> bool:
        """Refuse (`overloaded`) a request of `size` bytes that would pass the
        daemon's byte budget (`in_flight_bytes_max`: the requests of every
        call accepted and not done); False if it fits."""
        budget = self._config.in_flight_bytes_max
        held = self._driver.in_flight_bytes()
        if not budget or held + size <= budget:
            return False
        if size > budget:
            why = (f"the request is {_size(size)}, more than in_flight_bytes_max "
                   f"({_size(budget)}) allows for all calls together; it can never be accepted")
        else:
            why = (f"accepted calls hold {_size(held)} of requests and this one is "
                   f"{_size(size)} (in_flight_bytes_max {_size(budget)}); retry later")
        self._counters["refused_bytes.in_flight_bytes_max"] += 1
        self._error(identity, ref, ErrorCode.OVERLOADED, why)
        return True

    def _over_max_in_flight_bytes(self, identity: bytes, user: Identity, ref: str | None,
                                  size: int) -> bool:
        """Refuse (`too_many_calls`) a request of `size` bytes that would pass
        `user`'s byte budget (`max_in_flight_bytes`: the requests of its calls
        accepted and not done); False if it fits."""
        budget = user.max_in_flight_bytes
        held = self._driver.in_flight_bytes(user.name)
        if not budget or held + size <= budget:
            return False
        if size > budget:
            why = (f"the request is {_size(size)}, more than {user.name!r} may have in flight "
                   f"(max_in_flight_bytes {_size(budget)}); it can never be accepted")
        else:
            why = (f"calls of {user.name!r} not done yet hold {_size(held)} of requests and "
                   f"this one is {_size(size)} (max_in_flight_bytes {_size(budget)}); submit "
                   f"again when one ends")
        self._counters["refused_bytes.max_in_flight_bytes"] += 1
        self._error(identity, ref, ErrorCode.TOO_MANY_CALLS, why)
        return True

    @staticmethod
    def _subscription(req: Submit, call_id: str) -> Subscribe | None:
        """A submit's listener follows the call from seq 1 (after `accepted`)."""
        return None if req.listener is None else \
            Subscribe(ref=req.ref, call_id=call_id, listener=req.listener)

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

    def _answer(self, replies: list[Accept]) -> None:
        for identity, msg, then_subscribe in replies:
            if not msg.get("duplicate"):
                self._counters["calls_accepted"] += 1
            self._clients.send(identity, msg)
            if then_subscribe is not None:
                self._subscribe(identity, then_subscribe)

    def _replicated(self, call_id: str, error: str | None) -> None:
        """Cluster mode: the cluster stored the call (it runs, and is answered
        `accepted`), or could not (it never runs; its submitters are refused)."""
        replies = self._replicating.pop(call_id, [])
        live = self._driver.has_call(call_id)  # not if an admin cancelled it meanwhile
        if error is None:
            if live:
                self._driver.release(call_id)
            self._answer(replies)
            return
        if live:
            self._driver.drop(call_id)
        self._journal.finish_call(call_id, "refused")
        for identity, msg, _ in replies:
            self._error(identity, msg["ref"], ErrorCode.CLUSTER_UNAVAILABLE,
                        f"the cluster did not store the call ({error}); it was not accepted")

    def _subscribe(self, identity: bytes, req: Subscribe, live: bool | None = None) -> None:
        """The sink replays the call's stored events to the listener, then (a
        live call) follows it. Success has no reply (the events are the
        answer); a call whose events are gone gets an error with the ref.
        `live`: a followed call's (cluster mode); else: it is this host's."""
        if live is None:
            live = self._driver.has_call(req.call_id)
            if live:
                self._clients.follow(req.call_id, req.listener)

        def answered(reply: Refused | SinkLost | None) -> None:
            if isinstance(reply, Refused):
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            elif isinstance(reply, SinkLost) and not live:
                self._error(identity, req.ref, ErrorCode.INTERNAL,
                            "the sink restarted before it answered; subscribe again")
            # A live call's listeners are subscribed again at the restarted sink.

        self._sink.subscribe(req.call_id, req.listener, req.from_seq, live, answered)

    def _done_of(self, call_id: str) -> dict[str, Any] | None:
        """A finished call's done event: stored once, in the transcript."""
        return stored_done(self._transcript_path, call_id) \
            if self._journal.is_finished(call_id) else None

    def _result(self, identity: bytes, req: Result) -> None:
        if not self._driver.has_call(req.call_id):
            done = self._done_of(req.call_id)
            if done is None:
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            else:
                self._clients.send(identity, dict(
                    done, ref=req.ref, diagnostics=self._journal.attempts_of(req.call_id)))
            return
        if req.wait_s > 0:
            self._clients.wait_result(req.call_id, identity, req.ref, self._clock() + req.wait_s)
        else:
            self._clients.send(identity, pending_msg(req.ref, req.call_id))

    def _cancel(self, identity: bytes, req: Cancel) -> None:
        if not self._driver.has_call(req.call_id):
            done = self._done_of(req.call_id)
            if done is None:
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            else:
                self._clients.send(identity, dict(done, ref=req.ref))
            return
        self._clients.send(identity, {"v": 1, "op": "cancelling", "ref": req.ref,
                                      "call_id": req.call_id})
        self._driver.cancel(req.call_id)


FOLLOWED_KEEP = 100_000  # followed calls whose owner is remembered (cluster mode)


def _peek_op_ref(frame: bytes | memoryview) -> tuple[Any, str | None]:
    """The `op` and `ref` of a request map, read from its first bytes only
    (clients put them before `call`); (None, None) if they are not there."""
    unpacker = msgpack.Unpacker(raw=False, max_str_len=PEEK_BYTES, max_bin_len=PEEK_BYTES,
                                max_array_len=64, max_map_len=64)
    unpacker.feed(frame[:PEEK_BYTES])
    found: dict[str, Any] = {}
    try:
        for _ in range(min(unpacker.read_map_header(), 16)):
            key = unpacker.unpack()
            if key in ("op", "ref"):
                found[key] = unpacker.unpack()
                if len(found) == 2:
                    break
            else:
                unpacker.skip()
    except (msgpack.OutOfData, ValueError, TypeError, msgpack.UnpackException):
        pass
    ref = found.get("ref")
    return found.get("op"), ref if isinstance(ref, str) and len(ref) <= MAX_REF_LEN else None


def _size(n: int) -> str:
    """`n` bytes for a message: "256 MiB", "255.9 MiB", "12.5 KiB", "900 bytes".
    Rounded down, so a total just under a budget never reads as the budget."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            tenths = n * 10 // scale
            return f"{tenths // 10} {unit}" if tenths % 10 == 0 else f"{tenths / 10:.1f} {unit}"
    return f"{n} bytes"
