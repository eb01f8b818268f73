"""Driving attempts: schedule a queued call on a warm worker, authorize its
attempt at the sink first, watch liveness, fence then kill a stale or dead
attempt, decide (streamfence.supervisor.calls.decide), back off, and finish.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import msgpack
import zmq

from streamfence.protocol.errors import ErrorCode
from streamfence.protocol.internal import W_RUN
from streamfence.protocol.messages import CallStatus
from streamfence.supervisor.calls import Call, CallState, Finish, decide
from streamfence.supervisor.state import DaemonState
from streamfence.supervisor.timeouts import backoff_delay

log = logging.getLogger("streamfence.attempts")

# Error codes that mean "this provider will not stream for this profile".
NON_STREAMING_CODES = frozenset({"streaming_unsupported", "empty_sse_frames"})
PROBE_WINDOW_S = 60.0
SINK_LOST = "the sink died before answering"


def _ctx(call: Call) -> dict[str, Any]:
    return {"session_id": call.spec.session_id or "-", "call_id": call.call_id,
            "attempt": call.epoch}


def _breaker_key(call: Call) -> tuple[str, str]:
    return (call.spec.session_id or "-", call.profile.name)


class AttemptDriver:
    def __init__(self, st: DaemonState) -> None:
        self.st = st

    # ---- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start queued calls while warm workers are free."""
        st = self.st
        started: list[Call] = []
        while st.queue:
            call = st.calls.get(st.queue[0])
            if call is None or call.state is not CallState.QUEUED:
                st.queue.popleft()
                continue
            if call.deadline is not None and st.clock() >= call.deadline:
                st.queue.popleft()
                self.finish(call, Finish(CallStatus.FAILED, {
                    "code": ErrorCode.DEADLINE_EXCEEDED.value,
                    "message": "the call's deadline passed before an attempt could start"}, {}))
                continue
            token = st.next_token
            worker = st.pool.reserve(call.call_id, call.epoch + 1, token)
            if worker is None:
                break
            st.next_token += 1
            st.queue.popleft()
            call.epoch += 1
            call.attempts += 1
            call.token = token
            call.worker_id = worker.worker_id
            call.fence_reason = None
            call.ended = None
            call.to("start")
            st.journal.start_attempt(call.call_id, call.epoch)
            started.append(call)
        if started:
            # Epochs are durable before the sink hears of them.
            st.journal.commit()
            for call in started:
                reset = call.delivered  # only under on_partial=restart can this hold here
                model = str(call.spec.request.get("model") or call.spec.request.get("modelId")
                            or "-")
                st.sink.authorize(call.call_id, call.epoch, reset, model,
                                  functools.partial(self._authorized, call))
        st.pool.maintain(demand=sum(1 for cid in st.queue if cid in st.calls))

    def _authorized(self, call: Call, ok: bool, payload: Any) -> None:
        st = self.st
        worker = st.pool.workers.get(call.worker_id or -1)
        if not ok:
            if worker is not None:
                st.pool.release(worker)
            call.to("refused")
            if payload == SINK_LOST:
                st.queue.appendleft(call.call_id)  # the restarted sink will answer
                return
            # The sink knows better (e.g. an epoch it has seen, set after a
            # crash): never spin on it; fail the call with what it said.
            log.error("sink refused to authorize attempt: %s", payload, extra=_ctx(call))
            self.finish(call, Finish(CallStatus.FAILED, {
                "code": ErrorCode.INTERNAL.value,
                "message": f"the sink refused the attempt: {payload}"}, {}))
            return
        if call.delivered:
            call.delivered = False  # the reset voided it
        if call.cancel_requested or worker is None or worker.token != call.token:
            # Cancelled while authorizing, or the reserved worker died: fence
            # the (never started) attempt, then decide.
            if worker is not None:
                st.pool.release(worker)
            call.to("authorized")
            self.fence(call, "cancelled" if call.cancel_requested else "worker_died")
            return
        call.to("authorized")
        worker.to("run")
        call.dispatched_ns = time.monotonic_ns()
        st.journal.set_attempt_pid(call.call_id, call.epoch, worker.pid)
        profile = call.profile
        streaming = profile.name not in st.no_streaming and not call.probe_next
        call.probe_next = False
        settings = {"streaming": streaming,
                    "connect_timeout_s": call.timeouts.connect_s,
                    "read_timeout_s": call.timeouts.read_s,
                    "include_usage": profile.name not in st.no_stream_options,
                    "final_ack_timeout_s": 30.0, "notice": call.notice}
        call.notice = None
        try:
            st.workers_sock.send_multipart([worker.identity, msgpack.packb(
                [W_RUN, call.token, call.call_id, call.epoch, call.spec.session_id,
                 profile.to_map(), call.spec.request, settings], use_bin_type=True)])
        except zmq.ZMQError as exc:
            # Killed after it reported idle, before the zygote reported its
            # exit: the attempt never started; fence it and retry elsewhere.
            log.warning("worker %d unreachable (%s); fencing the attempt", worker.worker_id, exc,
                        extra=_ctx(call))
            st.pool.kill(worker)
            self.fence(call, "worker_died")
            return
        log.debug("attempt dispatched to worker %d (pid %d)", worker.worker_id, worker.pid,
                  extra=_ctx(call))

    # ---- liveness ----------------------------------------------------------
    def check_stale(self) -> None:
        st = self.st
        now_ns = time.monotonic_ns()
        for call in list(st.calls.values()):
            if call.state is not CallState.RUNNING:
                continue
            worker = st.pool.workers.get(call.worker_id or -1)
            if worker is None:
                continue
            token, last_ns, chunks, _ = st.live.read(worker.slot)
            if token == call.token and chunks > 0:
                since, limit = last_ns, call.timeouts.stale_s
            else:
                since, limit = call.dispatched_ns, call.timeouts.first_chunk_s
            if now_ns - since > limit * 1e9:
                log.warning("stale attempt: no chunk for %.1fs (limit %.1fs, chunks so far %d)",
                            (now_ns - since) / 1e9, limit, chunks if token == call.token else 0,
                            extra=_ctx(call))
                self.fence(call, "stale")
            elif call.deadline is not None and st.clock() >= call.deadline:
                self.fence(call, "deadline")

    # ---- ending an attempt ----------------------------------------------------
    def fence(self, call: Call, reason: str) -> None:
        """Close the attempt at the sink; once acknowledged, kill its worker."""
        call.fence_reason = reason
        call.to("fence")
        self.st.sink.fence(call.call_id, call.epoch,
                           functools.partial(self._fenced, call, call.epoch))

    def _fenced(self, call: Call, epoch: int, ok: bool, stats: Any) -> None:
        st = self.st
        if call.state is not CallState.FENCING or call.epoch != epoch:
            return
        if not ok or not isinstance(stats, dict):
            stats = self._stats_from_events(call)  # the sink died: what subscribers saw
        worker = st.pool.workers.get(call.worker_id or -1)
        if call.ended is not None:
            # The sink accepted the attempt's final before the fence: it finished.
            ended_stats, final = call.ended
            self._decide(call, ended_stats, final, final.get("error"))
            return
        if call.fence_reason == "stale":
            st.breakers.on_stale(_breaker_key(call))  # once per attempt: fenced once
        if worker is not None and worker.token == call.token:
            st.pool.kill(worker)  # fenced first, so the kill cannot lose an accepted delta
            st.pool.maintain()
        reason = call.fence_reason or "fenced"
        messages = {
            "stale": ("stream_stalled", f"no chunk within the stale timeout "
                                        f"({call.timeouts.stale_s:g}s)"),
            "worker_died": ("worker_died", "the worker process died mid-attempt"),
            "final_refused": ("final_refused", "the sink refused the attempt's final message"),
            "deadline": ("deadline_exceeded", "the call's deadline passed"),
            "sink_restarted": ("sink_restarted", "the sink restarted mid-attempt"),
            "cancelled": ("cancelled", "cancelled by the client"),
        }
        code, message = messages.get(reason, (reason, reason))
        error = {"class": "transient", "code": code, "message": message,
                 "retry_after_s": None}
        self._end_attempt(call, reason, None)
        self._decide(call, stats if isinstance(stats, dict) else {}, None, error)

    def on_ended(self, call_id: str, attempt: int, stats: dict[str, Any],
                 final: dict[str, Any]) -> None:
        call = self.st.calls.get(call_id)
        if call is None or call.epoch != attempt:
            return
        if final.get("stream_options_rejected"):
            self.st.no_stream_options.add(call.profile.name)
        if final.get("streaming_denied"):
            self.st.no_streaming.add(call.profile.name)
        if call.state is CallState.FENCING:
            call.ended = (stats, final)  # decided when the fence reply arrives
            return
        if call.state is not CallState.RUNNING:
            return
        self._end_attempt(call, "ended", final)
        self._decide(call, stats, final, final.get("error"))

    def on_final_refused(self, call_id: str, attempt: int, reason: str) -> None:
        call = self.st.calls.get(call_id)
        if call is not None and call.epoch == attempt and call.state is CallState.RUNNING:
            log.warning("final message refused by the sink: %s", reason, extra=_ctx(call))
            self.fence(call, "final_refused")

    def on_worker_exit(self, call_id: str | None, token: int, returncode: int) -> None:
        call = self.st.calls.get(call_id or "")
        if call is None or call.token != token:
            return
        if call.state is CallState.RUNNING:
            log.warning("worker died mid-attempt (exit %d)", returncode, extra=_ctx(call))
            self.fence(call, "worker_died")

    def _end_attempt(self, call: Call, how: str, final: dict[str, Any] | None) -> None:
        self.st.journal.end_attempt(call.call_id, call.epoch, how, final)

    def _decide(self, call: Call, stats: dict[str, Any], final: dict[str, Any] | None,
                error: dict[str, Any] | None) -> None:
        st = self.st
        if error is not None:
            call.last_error = error
        if int(stats.get("visible_chars", 0)) > 0:
            call.delivered = True
        error = self._streaming_fallbacks(call, stats, error)
        decision = decide(call, stats, final, error, st.clock())
        if error is None and final is not None:
            st.breakers.on_success(_breaker_key(call))
        elif call.fence_reason != "stale":
            st.breakers.on_probe_ended(_breaker_key(call))
        if isinstance(decision, Finish):
            self.finish(call, decision)
            return
        delay = backoff_delay(call.attempts, st.config.backoff_base_s, st.config.backoff_max_s,
                              decision.retry_after_s, st.rng)
        now = st.clock()
        if call.deadline is not None and now + delay >= call.deadline:
            self.finish(call, Finish(CallStatus.FAILED, {
                "code": ErrorCode.DEADLINE_EXCEEDED.value,
                "message": "the deadline leaves no time for the next attempt's backoff"}, {}))
            return
        if int(stats.get("tool_fragments", 0)) > 0:
            call.notice = (f"The connection dropped in the middle of a tool call "
                           f"({(error or {}).get('message')}); the request is retried "
                           f"and the tool call starts over.")
        log.info("retrying after %.2fs: %s", delay, (error or {}).get("message"), extra=_ctx(call))
        call.retry_at = now + delay
        call.to("retry")
        st.counters["retries"] += 1

    def _streaming_fallbacks(self, call: Call, stats: dict[str, Any],
                             error: dict[str, Any] | None) -> dict[str, Any] | None:
        """SPEC §3 streaming fall-backs. Returns the error `decide` should see."""
        st = self.st
        if error is None:
            return None
        name = call.profile.name
        if error.get("code") in NON_STREAMING_CODES and name not in st.no_streaming:
            # The provider will not stream for this profile: switch it to
            # non-streaming (delivered as deltas) and try again at once.
            log.warning("profile %s switched to non-streaming: %s", name, error.get("message"),
                        extra=_ctx(call))
            st.no_streaming.add(name)
            return dict(error, **{"class": "transient", "retry_after_s": 0.0})
        status = error.get("status") or 0
        now = st.clock()
        if (status >= 500 and int(stats.get("accepted", 0)) == 0 and name not in st.no_streaming
                and now - st.last_probe.get(name, -PROBE_WINDOW_S) >= PROBE_WINDOW_S):
            # A 5xx killed the stream before any delta: one non-streaming probe
            # per window, whose 4xx (if any) replaces the opaque 5xx.
            st.last_probe[name] = now
            call.probe_next = True
        return error

    def tick_backoffs(self) -> None:
        now = self.st.clock()
        for call in self.st.calls.values():
            if call.state is CallState.BACKOFF and now >= call.retry_at:
                call.to("backoff_over")
                self.st.queue.appendleft(call.call_id)

    # ---- finishing -----------------------------------------------------------
    def finish(self, call: Call, decision: Finish) -> None:
        call.to("finish")
        call.finishing = decision
        self._send_finish(call, decision)

    def _send_finish(self, call: Call, decision: Finish) -> None:
        self.st.sink.finish(call.call_id, decision.status.value, decision.error, call.attempts,
                            decision.meta, functools.partial(self._finished, call))

    # ---- the sink died ---------------------------------------------------------
    def on_sink_restart(self) -> None:
        """Fail the requests the dead sink never answered, then fence every
        attempt still running: its worker streams to a sink that no longer
        knows where it was."""
        for callback in self.st.sink.forget_pending():
            callback(False, SINK_LOST)
        for call in list(self.st.calls.values()):
            if call.state is CallState.RUNNING:
                call.fence_reason = "sink_restarted"
                call.to("fence")
                self._fenced(call, call.epoch, False, SINK_LOST)

    def _stats_from_events(self, call: Call) -> dict[str, Any]:
        """The current attempt's stats as subscribers saw them (every published
        event was committed first, so this is what the transcript holds)."""
        visible = fragments = accepted = 0
        for frame in self.st.events.get(call.call_id, []):
            event = msgpack.unpackb(frame, raw=False)
            if event.get("op") == "reset":
                visible = fragments = accepted = 0
            elif event.get("op") == "delta" and event.get("attempt") == call.epoch:
                accepted += 1
                if event["kind"] in ("text", "refusal"):
                    visible += len(str(event["data"]).strip())
                elif event["kind"] == "tool_call":
                    fragments += 1
        return {"attempt": call.epoch, "accepted": accepted, "visible_chars": visible,
                "tool_fragments": fragments}

    def _finished(self, call: Call, ok: bool, done: Any) -> None:
        st = self.st
        if not ok:
            if done == SINK_LOST and call.finishing is not None:
                # Ask the restarted sink again (a repeated finish is idempotent there).
                self._send_finish(call, call.finishing)
                return
            log.error("sink refused to finish the call: %s", done, extra=_ctx(call))
            return
        call.to("finished")
        st.journal.finish_call(call.call_id, str(done.get("status")), done)
        st.counters["calls_" + str(done.get("status"))] += 1
        log.info("call %s after %d attempt(s)", done.get("status"), call.attempts,
                 extra=_ctx(call))
        if call.waiters:
            reply = dict(done, diagnostics=st.journal.attempts_of(call.call_id))
            for identity, ref, _ in call.waiters:
                st.front.send_multipart([identity, msgpack.packb(dict(reply, ref=ref))])
        call.waiters.clear()
        st.subscribers.pop(call.call_id, None)
        st.events.pop(call.call_id, None)
        del st.calls[call.call_id]
