"""The client-facing side: decode and validate each frame, answer every
request (echoing its `ref`), and fan out the sink's accepted events to
subscribers.

Bad input never raises out of here: it becomes an `error` reply with a
precise code, counted under `bad_input.<code>`. Submits are answered only
after the journal commit of the loop turn (see `flush_accepts`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from streamfence.protocol.codec import decode_untrusted, encode
from streamfence.protocol.errors import ErrorCode, ProtocolError
from streamfence.protocol.messages import (
    CallStatus,
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
from streamfence.sink.store import events_after
from streamfence.supervisor.attempts import AttemptDriver
from streamfence.supervisor.calls import Call, CallState, Finish
from streamfence.supervisor.state import DaemonState
from streamfence.supervisor.timeouts import attempt_timeouts

log = logging.getLogger("streamfence.front")

# Codes that mean "the client sent something we cannot take" (counted as bad
# input), as opposed to refusals of a well-formed request (breaker, overload).
BAD_INPUT = frozenset({ErrorCode.BAD_FRAME, ErrorCode.TOO_LARGE, ErrorCode.BAD_MESSAGE,
                       ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OP,
                       ErrorCode.UNKNOWN_PROVIDER, ErrorCode.UNKNOWN_CALL})


class Front:
    def __init__(self, st: DaemonState, driver: AttemptDriver, transcript_path: str) -> None:
        self.st = st
        self.driver = driver
        self._transcript_path = transcript_path
        self._accepts: list[tuple[bytes, dict[str, Any], Subscribe | None]] = []
        self._idem_in_turn: dict[str, str] = {}
        self.accepting = True

    def _send(self, identity: bytes, msg: dict[str, Any]) -> None:
        self.st.front.send_multipart([identity, encode(msg)])

    def _error(self, identity: bytes, ref: str | None, code: ErrorCode, message: str) -> None:
        kind = "bad_input." if code in BAD_INPUT else "refused."
        self.st.counters[kind + code.value] += 1
        self._send(identity, error_msg(ref, code, message))

    # ---- one frame ---------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._error(identity, None, ErrorCode.BAD_FRAME,
                        f"a request must be exactly one frame, got {len(frames) - 1}")
            return
        obj: Any = None
        try:
            obj = decode_untrusted(frames[1], self.st.config.max_frame_bytes)
            request = parse_request(obj)
        except ProtocolError as exc:
            self._error(identity, ref_of(obj), exc.code, exc.message)
            return
        try:
            if isinstance(request, Submit):
                self._submit(identity, request)
            elif isinstance(request, Subscribe):
                self._subscribe(identity, request)
            elif isinstance(request, Result):
                self._result(identity, request)
            elif isinstance(request, Cancel):
                self._cancel(identity, request)
            elif isinstance(request, Status):
                self._send(identity, self.status_reply(request.ref))
        except Exception:  # a bug must cost one reply, never the daemon
            log.exception("internal error while handling %s", type(request).__name__)
            self._error(identity, request.ref, ErrorCode.INTERNAL, "internal error; see the log")

    # ---- ops -----------------------------------------------------------------
    def _submit(self, identity: bytes, req: Submit) -> None:
        st = self.st
        spec = req.call
        if not self.accepting:
            self._error(identity, req.ref, ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            return
        profile = st.config.providers.get(spec.provider)
        if profile is None:
            known = ", ".join(sorted(st.config.providers)) or "none"
            self._error(identity, req.ref, ErrorCode.UNKNOWN_PROVIDER,
                        f"no provider profile {spec.provider!r} (configured: {known})")
            return
        existing = None
        if spec.idempotency_key is not None:
            existing = (self._idem_in_turn.get(spec.idempotency_key)
                        or st.journal.call_by_idempotency_key(spec.idempotency_key))
        if existing is not None:
            # The same call again: its id, and nothing new starts.
            # Subscribed after `accepted` goes out, so the replay follows the reply.
            self._accepts.append((identity, accepted_msg(req.ref, existing, duplicate=True),
                                  Subscribe(ref=req.ref, call_id=existing)
                                  if req.subscribe else None))
            return
        refusal = st.breakers.admit((spec.session_id or "-", spec.provider))
        if refusal is not None:
            self._error(identity, req.ref, ErrorCode.BREAKER_OPEN, refusal)
            return
        if len(st.queue) >= st.config.queue_max:
            self._error(identity, req.ref, ErrorCode.OVERLOADED,
                        f"{len(st.queue)} calls are queued (queue_max); retry later")
            return
        call_id = uuid.uuid4().hex
        st.journal.add_call(call_id, spec.idempotency_key, spec.session_id, spec.provider,
                            spec.request, spec.options.to_map())
        if spec.idempotency_key is not None:
            self._idem_in_turn[spec.idempotency_key] = call_id
        max_attempts = spec.options.max_attempts or profile.max_attempts
        deadline = (st.clock() + spec.options.deadline_s
                    if spec.options.deadline_s is not None else None)
        call = Call(call_id=call_id, spec=spec, profile=profile,
                    timeouts=attempt_timeouts(spec.options, profile, spec.request),
                    max_attempts=max_attempts, deadline=deadline)
        st.calls[call_id] = call
        st.events[call_id] = []
        if req.subscribe:
            st.subscribers.setdefault(call_id, {})[identity] = 1
        st.queue.append(call_id)
        st.counters["calls_accepted"] += 1
        self._accepts.append((identity, accepted_msg(req.ref, call_id), None))

    def flush_accepts(self) -> None:
        """Journal commit first, then the `accepted` replies of this turn."""
        if not self._accepts:
            return
        self.st.journal.commit()
        for identity, msg, then_subscribe in self._accepts:
            self._send(identity, msg)
            if then_subscribe is not None:
                self._subscribe(identity, then_subscribe)
        self._accepts.clear()
        self._idem_in_turn.clear()

    def _subscribe(self, identity: bytes, req: Subscribe) -> None:
        """Replay from the store, then follow live. Success has no reply (the
        events are the answer); an unknown call gets an error with the ref."""
        st = self.st
        live = st.events.get(req.call_id)
        if live is None and not st.journal.exists(req.call_id):
            self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            return
        if live is not None:
            for frame in live[req.from_seq:]:
                st.front.send_multipart([identity, frame])
            st.subscribers.setdefault(req.call_id, {})[identity] = len(live) + 1
            return
        for frame in self._replay(req.call_id, req.from_seq):
            st.front.send_multipart([identity, frame])

    def _replay(self, call_id: str, from_seq: int) -> list[bytes]:
        """Events of a finished call, read from the sink's transcript."""
        return events_after(self._transcript_path, call_id, from_seq)

    def _result(self, identity: bytes, req: Result) -> None:
        st = self.st
        call = st.calls.get(req.call_id)
        if call is None:
            done = st.journal.done_event(req.call_id)
            if done is None:
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            else:
                self._send(identity, dict(done, ref=req.ref,
                                          diagnostics=st.journal.attempts_of(req.call_id)))
            return
        if req.wait_s > 0:
            call.waiters.append((identity, req.ref, st.clock() + req.wait_s))
        else:
            self._send(identity, pending_msg(req.ref, req.call_id))

    def expire_waiters(self) -> None:
        now = self.st.clock()
        for call in self.st.calls.values():
            if not call.waiters:
                continue
            keep = []
            for identity, ref, until in call.waiters:
                if now >= until:
                    self._send(identity, pending_msg(ref, call.call_id))
                else:
                    keep.append((identity, ref, until))
            call.waiters = keep

    def _cancel(self, identity: bytes, req: Cancel) -> None:
        st = self.st
        call = st.calls.get(req.call_id)
        if call is None:
            done = st.journal.done_event(req.call_id)
            if done is None:
                self._error(identity, req.ref, ErrorCode.UNKNOWN_CALL, f"no call {req.call_id!r}")
            else:
                self._send(identity, dict(done, ref=req.ref))
            return
        self._send(identity, {"v": 1, "op": "cancelling", "ref": req.ref,
                              "call_id": req.call_id})
        if call.cancel_requested:
            return
        call.cancel_requested = True
        if call.state in (CallState.QUEUED, CallState.BACKOFF):
            self.driver.finish(call, Finish(CallStatus.CANCELLED, {
                "code": ErrorCode.CANCELLED.value, "message": "cancelled by the client"}, {}))
        elif call.state is CallState.RUNNING:
            self.driver.fence(call, "cancelled")
        # AUTHORIZING / FENCING: the pending reply sees cancel_requested.

    def status_reply(self, ref: str) -> dict[str, Any]:
        st = self.st
        by_state: dict[str, int] = {}
        for call in st.calls.values():
            by_state[call.state.value] = by_state.get(call.state.value, 0) + 1
        return {"v": 1, "op": "status_reply", "ref": ref,
                "processes": dict(st.processes),
                "workers": st.pool.snapshot(),
                "pool": {"spare": st.pool.spare, "max": st.pool.max_workers,
                         "spawned_total": st.pool.spawned_total,
                         "killed_total": st.pool.killed_total},
                "calls": {"active": len(st.calls), "queued": len(st.queue), "by_state": by_state,
                          "running": [{"call_id": c.call_id, "state": c.state.value,
                                       "attempt": c.epoch, "session_id": c.spec.session_id,
                                       "provider": c.profile.name}
                                      for c in list(st.calls.values())[:100]]},
                "breakers": st.breakers.snapshot(),
                "counters": dict(st.counters),
                "sink": st.sink.stats}

    # ---- fan-out -------------------------------------------------------------
    def on_event(self, call_id: str, seq: int, frame: bytes) -> None:
        st = self.st
        buffer = st.events.get(call_id)
        if buffer is not None and seq == len(buffer) + 1:
            buffer.append(frame)
        subs = st.subscribers.get(call_id)
        if subs:
            send = st.front.send_multipart
            for identity, owed in subs.items():
                if seq >= owed:
                    send([identity, frame])
                    subs[identity] = seq + 1

