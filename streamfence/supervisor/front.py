"""The client-facing side: decode and validate each frame and answer every
request (echoing its `ref`).

Bad input never raises out of here: it becomes an `error` reply with a
precise code, counted under `bad_input.<code>`. A submit is admitted or
refused by streamfence.supervisor.admission (every refusal is a check
there) and accepted by streamfence.supervisor.acceptance, which answers it
only once it is durable.

Every request comes with the identity that sent it (docs/SECURITY.md): a call
belongs to its submitter, and another identity's call answers exactly as a
call that does not exist (`unknown_call`), unless the asker is an admin.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from streamfence.config.identities import Identity
from streamfence.config.model import DaemonConfig
from streamfence.protocol.codec import decode_untrusted
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.internal.control import ListenerOwner
from streamfence.protocol.messages import (
    Cancel,
    Result,
    Status,
    Submit,
    Subscribe,
    error_msg,
    parse_request,
    pending_msg,
    ref_of,
)
from streamfence.protocol.queries import Calls, Usage
from streamfence.protocol.states import CallState
from streamfence.sink.transcript import stored_done
from streamfence.supervisor.acceptance import Acceptance
from streamfence.supervisor.access import Submitter, log_submit
from streamfence.supervisor.admission import (
    EARLY_CHECK_BYTES,
    Admission,
    Admitted,
    Duplicate,
    Refusal,
)
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.breaker import Breakers
from streamfence.supervisor.calls_view import CallsView
from streamfence.supervisor.clients import Clients
from streamfence.supervisor.journal import Journal
from streamfence.supervisor.sinklink import Refused, SinkLink, SinkLost

if TYPE_CHECKING:  # cluster mode only: it brings nats
    from streamfence.supervisor.clusterlink import ClusterLink

# The sink's refusals of a subscribe that are told as they are (any other:
# `unknown_call`); its reason is "code: message".
_SINK_REFUSALS = frozenset({ErrorCode.TOO_MANY_SUBSCRIPTIONS.value, ErrorCode.KEY_REVOKED.value})
HOLD_MAX_S = 1.0  # a rate refusal is answered after its wait, at most this much later
FOLLOWED_KEEP = 100_000  # followed calls whose owner is remembered (cluster mode)

log = logging.getLogger("streamfence.front")

# Codes that mean "the client sent something we cannot take" (counted as bad
# input), as opposed to refusals of a well-formed request (breaker, overload).
BAD_INPUT = frozenset({ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE, ErrorCode.BAD_MESSAGE,
                       ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OP,
                       ErrorCode.UNKNOWN_PROVIDER, ErrorCode.UNKNOWN_CALL})


class Front:
    """Owns request handling and the cluster's followed calls (their owners);
    counts bad input and refusals. Submits go through `admission` (the
    rates, whether new calls are accepted) and `acceptance` (the replies
    waiting for durability); new calls go to the AttemptDriver; replies go
    through Clients; subscriptions to the sink, which sends the events.
    `status` gives a status reply's body (each owner's view) to a callback."""

    def __init__(self, config: DaemonConfig, journal: Journal, driver: AttemptDriver,
                 clients: Clients, sink: SinkLink, breakers: Breakers, counters: Counter[str],
                 clock: Callable[[], float], transcript_path: str,
                 status: Callable[[Identity, Callable[[dict[str, Any]], None]], None],
                 calls: CallsView, cluster: ClusterLink | None = None) -> None:
        self._config = config
        self._cluster = cluster
        # Calls another host runs that were asked for here -> their owner identity.
        self._followed: OrderedDict[str, str] = OrderedDict()
        self._journal = journal
        self._driver = driver
        self._clients = clients
        self._sink = sink
        self._clock = clock
        self._transcript_path = transcript_path
        self._status = status
        self.calls = calls  # `calls` requests' answers (closed with the journal)
        self._counters = counters
        self.acceptance = Acceptance(journal, driver, clients, counters, clock, self._error,
                                     self._subscribe, cluster)
        self.admission = Admission(config, journal, driver, breakers, clock,
                                   self.acceptance.existing)

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

    def _refused(self, identity: bytes, ref: str | None, refusal: Refusal) -> None:
        if refusal.tally is not None:
            self._counters[refusal.tally] += 1
        self._error(identity, ref, refusal.code, refusal.message, refusal.hold_s)

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
        if len(body) >= EARLY_CHECK_BYTES:
            ref, refusal = self.admission.refuse_unread(user, body)
            if refusal is not None:  # a submit, refused before it is read
                log_submit(Submitter(user.name), None, refusal.code)
                self._refused(identity, ref, refusal)
                return
        obj: Any = None
        try:
            obj = decode_untrusted(body, self._config.max_frame_bytes)
            request = parse_request(obj)
        except ProtocolError as exc:
            if isinstance(obj, dict) and obj.get("op") == "submit":
                log_submit(Submitter(user.name), None, exc.code)
            self._error(identity, ref_of(obj), exc.code, exc.message)
            return
        try:
            if isinstance(request, Submit):
                self._submit(identity, user, request, body)
            elif isinstance(request, Status):
                ref = request.ref
                self._status(user, lambda body: self._clients.send(
                    identity, {"v": 1, "op": "status_reply", "ref": ref, **body}))
            elif isinstance(request, Usage):
                self._usage(identity, user, request)
            elif isinstance(request, Calls):
                self._clients.send(identity, self.calls.answer(user, request))
            elif self._cluster is not None and (
                    self._journal.owner_of(request.call_id) is None
                    or self._journal.is_moved(request.call_id)):
                self._remote(identity, user, request)  # another host's, if any
            elif not self._may_see(user, request.call_id):
                self._error(identity, request.ref, ErrorCode.UNKNOWN_CALL,
                            f"no call {request.call_id!r}")
            elif isinstance(request, Subscribe):
                self._subscribe(identity, user, request)
            elif isinstance(request, Result):
                self._result(identity, request)
            elif isinstance(request, Cancel):
                self._cancel(identity, request)
        except ProtocolError as exc:  # a store could not be read (Journal._row, stored_done)
            self._error(identity, request.ref, exc.code, exc.message)
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
            self._sink.follow(call_id, functools.partial(self._following, identity, user,
                                                         request, owner))
        known = self._followed.get(call_id)
        if known is not None:
            looked_up({"owner": known})
        else:
            self._cluster.lookup(call_id, looked_up)

    def _following(self, identity: bytes, user: Identity, request: Subscribe | Result | Cancel,
                   owner: str, reply: dict[str, Any] | Refused | SinkLost) -> None:
        call_id = request.call_id
        if not isinstance(reply, dict):
            why = getattr(reply, "reason", "the sink restarted")
            code = ErrorCode.CLUSTER_UNAVAILABLE if why.startswith("cluster_unavailable") \
                else ErrorCode.INTERNAL
            self._error(identity, request.ref, code,
                        f"this host could not follow call {call_id} from the cluster: {why}")
            return
        self._followed[call_id] = owner
        while len(self._followed) > FOLLOWED_KEEP:
            self._followed.popitem(last=False)
        done = stored_done(self._transcript_path, call_id) if reply.get("done") else None
        if isinstance(request, Subscribe):
            self._subscribe(identity, user, request, live=done is None)
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
                         answer: dict[str, Any] | tuple[ErrorCode, str]) -> None:
        """Cluster mode: the answer of the host that runs the call to its cancel,
        or why none came (ClusterLink.cancel: `cancel_unknown` or
        `cluster_unavailable`)."""
        if isinstance(answer, tuple):
            self._error(identity, request.ref, *answer)
        elif answer.get("op") == "done":
            self._clients.send(identity, dict(answer, ref=request.ref))
        else:
            self._clients.send(identity, {"v": 1, "op": "cancelling", "ref": request.ref,
                                          "call_id": request.call_id})

    def cancel_for_peer(self, call_id: str) -> dict[str, Any]:
        """Cluster mode: a cancel another host forwarded (it checked that its
        client may see the call). The answer: `cancelling`, the call's done, or
        `unknown` (not this host's: the asker looks for its owner again)."""
        if self._driver.calls.has(call_id):
            self._driver.cancel(call_id)
            return {"op": "cancelling"}
        done = self._done_of(call_id)
        return dict(done) if done is not None else {"op": "unknown"}

    # ---- ops -----------------------------------------------------------------
    def _submit(self, identity: bytes, user: Identity, req: Submit,
                frame: bytes | memoryview) -> None:
        """Admission decides (every refusal is there), acceptance makes it so.
        `frame`: the submit frame; its length is what the byte budgets count as
        the request's size. Why the frame and not `encode(request)`: it is at
        hand for free (encoding again is a pass over up to max_frame_bytes per
        submit), and it is an honest upper bound of the request's encoding,
        which the frame holds next to an envelope of some 100 bytes."""
        verdict = self.admission.admit(user, req.call, len(frame))
        if isinstance(verdict, Admitted):
            self.acceptance.accept(identity, user, req, verdict, frame)
        elif isinstance(verdict, Duplicate):
            self.acceptance.accept_duplicate(identity, user, req, verdict.call_id)
        else:
            log_submit(Submitter.of(user.name, req.call), None, verdict.code)
            self._refused(identity, req.ref, verdict)

    def _subscribe(self, identity: bytes, user: Identity, req: Subscribe,
                   live: bool | None = None) -> None:
        """The sink replays the call's stored events to the listener, then (a
        live call) follows it, charged to `user` (its share and its caps on
        listeners and subscriptions: sink/shares.py). Success has no reply
        (the events are the answer); a call whose events are gone, or a
        subscribe past a cap, gets an error with the ref. `live`: a followed
        call's (cluster mode); else: it is this host's."""
        owner = ListenerOwner(user.name, user.max_listeners, user.max_subscriptions)
        if live is None:
            live = self._driver.calls.has(req.call_id)
            if live:
                self._clients.follow(req.call_id, req.listener, owner)

        def answered(reply: Refused | SinkLost | None) -> None:
            if isinstance(reply, Refused):
                code, _, message = reply.reason.partition(": ")
                if code in _SINK_REFUSALS:
                    self._clients.unfollow(req.call_id, req.listener)
                    self._error(identity, req.ref, ErrorCode(code), message)
                else:
                    self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL,
                                f"no call {req.call_id!r}")
            elif isinstance(reply, SinkLost) and not live:
                self._error(identity, req.ref, ErrorCode.INTERNAL,
                            "the sink restarted before it answered; subscribe again")
            # A live call's listeners are subscribed again at the restarted sink.

        self._sink.subscribe(req.call_id, req.listener, req.from_seq, live, owner, answered)

    def _usage(self, identity: bytes, user: Identity, req: Usage) -> None:
        """The usage sums (supervisor/usage.py): an admin's of every identity,
        with every budget configured; any other identity's of its own only."""
        usage = self._journal.usage
        rows = usage.query(None if user.is_admin else user.name, req.since, req.by)
        owners = (self.admission.identities.values() if user.is_admin else [user])
        budgets = [dict(b, identity=who.name) for who in owners for b in usage.budgets(who)]
        self._clients.send(identity, {"v": 1, "op": "usage_reply", "ref": req.ref,
                                      "identity": user.name, "since": req.since,
                                      "by": list(req.by), "rows": rows, "budgets": budgets})

    def _done_of(self, call_id: str) -> dict[str, Any] | None:
        """A finished call's done event: stored once, in the transcript."""
        return stored_done(self._transcript_path, call_id) \
            if self._journal.is_finished(call_id) else None

    def _result(self, identity: bytes, req: Result) -> None:
        call = self._driver.calls.get(req.call_id)
        done = None
        if call is None:
            done = self._done_of(req.call_id)
        elif call.state is CallState.FINISHING and req.wait_s == 0:
            # The sink stores the done before it sends it, and may have sent it
            # already: a client that saw it gets it here, never `pending`. (A
            # waiting result is answered once the end is recorded here, the
            # call's budgets released: a few ms later.)
            done = stored_done(self._transcript_path, req.call_id)
        if done is not None:
            self._clients.send(identity, dict(
                done, ref=req.ref, diagnostics=self._journal.attempts_of(req.call_id)))
        elif call is None:
            self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
        elif req.wait_s > 0:
            self._clients.wait_result(req.call_id, identity, req.ref, self._clock() + req.wait_s)
        else:
            self._clients.send(identity, pending_msg(req.ref, req.call_id))

    def _cancel(self, identity: bytes, req: Cancel) -> None:
        if not self._driver.calls.has(req.call_id):
            done = self._done_of(req.call_id)
            if done is None:
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            else:
                self._clients.send(identity, dict(done, ref=req.ref))
            return
        self._clients.send(identity, {"v": 1, "op": "cancelling", "ref": req.ref,
                                      "call_id": req.call_id})
        self._driver.cancel(req.call_id)

