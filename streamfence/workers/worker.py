"""The worker process: runs one attempt at a time, streams its deltas to the
sink, and ends every attempt with an explicit final message.

Duties:
1. Say hello to the supervisor, then wait for a W_RUN.
2. Stamp the attempt on every log record (streamfence.protocol.logs), open the provider
   stream through the SDK, and push each delta to the sink as
   (call, attempt, seq, kind, data) with seq contiguous from 1.
3. Touch the liveness row on every real chunk (streamfence.workers.liveness).
4. Send T_FINAL with the last seq and the outcome, and count the attempt done
   only when the sink acknowledges it (a stream's end proves nothing; a PUSH
   that exits right after sending loses messages). No ack in time: exit with
   ExitCode.SINK_UNREACHABLE so the supervisor treats the attempt as incomplete.
5. Report W_IDLE and wait for the next attempt.

The worker never decides retries: a stale or superseded worker is killed by
the supervisor and, even if it lived on, its deltas carry a fenced epoch.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, NoReturn

import msgpack
import zmq

from streamfence.protocol.internal import (
    T_DELTA,
    T_FINAL,
    T_FINAL_ACK,
    W_EXIT,
    W_HELLO,
    W_IDLE,
    W_RUN,
    Endpoints,
)
from streamfence.protocol.logs import clear_context, route_logs_to, set_context
from streamfence.protocol.messages import DeltaKind
from streamfence.workers.lifecycle import ExitCode
from streamfence.workers.liveness import LivenessTable
from streamfence.workers.providers import final_from_exception, run_attempt

log = logging.getLogger("streamfence.worker")

_VISIBLE = (DeltaKind.TEXT.value, DeltaKind.REFUSAL.value)


class SinkOutput:
    """AttemptOutput that pushes deltas to the sink (the per-delta hot path)."""

    __slots__ = ("_attempt", "_call_id", "_live", "_pack", "_send", "_slot",
                 "first_chunk_ns", "seq", "visible_chars")

    def __init__(self, sink: zmq.Socket[bytes], call_id: str, attempt: int,
                 live: LivenessTable, slot: int) -> None:
        self._send = sink.send
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._call_id = call_id
        self._attempt = attempt
        self._live = live
        self._slot = slot
        self.seq = 0
        self.visible_chars = 0
        self.first_chunk_ns = 0

    def chunk(self, nbytes: int) -> None:
        if not self.first_chunk_ns:
            self.first_chunk_ns = time.monotonic_ns()
        self._live.touch(self._slot, nbytes)

    def delta(self, kind: str, data: Any) -> None:
        self.seq += 1
        if kind in _VISIBLE:
            self.visible_chars += len(data)
        self._send(self._pack([T_DELTA, self._call_id, self._attempt, self.seq, kind, data]))


def _run_one(msg: list[Any], sink: zmq.Socket[bytes], live: LivenessTable,
             slot: int) -> bool:
    _, token, call_id, attempt, session_id, profile, request, settings = msg
    set_context(session_id, call_id, attempt)
    live.begin(slot, token)
    out = SinkOutput(sink, call_id, attempt, live, slot)
    started = time.monotonic_ns()
    log.info("attempt started: provider=%s model=%s", profile.get("name"), request.get("model"))
    if settings.get("notice"):
        out.delta(DeltaKind.NOTICE.value, settings["notice"])
    try:
        final = run_attempt(profile, request, out, settings)
    except Exception as exc:
        final = final_from_exception(profile, exc)
        error = final["error"]
        if out.visible_chars == 0:
            # The one line that explains a failed stream: ERROR, with traceback.
            log.exception("stream failed before delivery: %s (%s, %s)",
                          error["message"], error["class"], error["code"])
        else:
            log.warning("stream failed after %d visible chars: %s (%s, %s)",
                        out.visible_chars, error["message"], error["class"], error["code"],
                        exc_info=True)
    else:
        if final.get("error"):
            err = final["error"]
            level = logging.ERROR if out.visible_chars == 0 else logging.WARNING
            log.log(level, "stream ended with error: %s (%s, %s)",
                    err.get("message"), err.get("class"), err.get("code"))
    if final.get("dropped_tool_names"):
        names = ", ".join(final["dropped_tool_names"])
        log.warning("tool call(s) dropped, never executed: %s", names)
        out.delta(DeltaKind.NOTICE.value,
                  f"The stream ended before these tool calls were complete; they were "
                  f"dropped and not executed: {names}.")
    if final.get("finish_reason") == "content_filter":
        out.delta(DeltaKind.NOTICE.value, "The provider stopped this answer with its content "
                                          "filter (finish_reason content_filter).")
    _, _, chunks, nbytes = live.read(slot)
    final["diag"] = {
        "first_chunk_ms": (out.first_chunk_ns - started) / 1e6 if out.first_chunk_ns else None,
        "chunks": chunks, "bytes": nbytes, "deltas": out.seq,
        "duration_ms": (time.monotonic_ns() - started) / 1e6,
    }
    sink.send(msgpack.packb([T_FINAL, call_id, attempt, out.seq, final], use_bin_type=True))
    accepted = _wait_final_ack(sink, call_id, attempt, settings.get("final_ack_timeout_s", 30.0))
    log.info("attempt ended: finish_reason=%s deltas=%d final_accepted=%s",
             final.get("finish_reason"), out.seq, accepted)
    return accepted


def _wait_final_ack(sink: zmq.Socket[bytes], call_id: str, attempt: int,
                    timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sink.poll(int(remaining * 1000) + 1):
            log.error("no ack from the sink for the final message within %.1fs; exiting",
                      timeout_s)
            logging.shutdown()
            os._exit(ExitCode.SINK_UNREACHABLE)
        reply = msgpack.unpackb(sink.recv(), raw=False)
        if reply[0] == T_FINAL_ACK and reply[1] == call_id and reply[2] == attempt:
            if not reply[3]:
                log.warning("sink refused the final message: %s", reply[4])
            return bool(reply[3])


def worker_main(worker_id: int, slot: int, runtime_dir: str, slots: int,
                log_level: int) -> NoReturn:
    """Entry point of a forked worker; never returns."""
    ep = Endpoints(runtime_dir)
    ctx = zmq.Context()
    logs = ctx.socket(zmq.PUSH)
    logs.linger = 1000
    logs.sndhwm = 10_000
    logs.connect(ep.logs)
    route_logs_to(logs, log_level, f"worker-{worker_id}")
    ctl = ctx.socket(zmq.DEALER)
    ctl.linger = 0
    ctl.setsockopt(zmq.IDENTITY, b"w%d" % worker_id)
    ctl.connect(ep.workers)
    sink = ctx.socket(zmq.DEALER)
    sink.linger = 2000
    sink.sndhwm = 0  # never drop or block-fail a delta; the fence decides, not the queue
    sink.connect(ep.sink_in)
    live = LivenessTable(ep.liveness_file, slots)
    ctl.send(msgpack.packb([W_HELLO, worker_id, os.getpid()]))
    code = ExitCode.OK
    try:
        while True:
            msg = msgpack.unpackb(ctl.recv(), raw=False)
            if msg[0] == W_EXIT:
                break
            if msg[0] != W_RUN:
                log.warning("unexpected message tag %r from the supervisor", msg[0])
                continue
            accepted = _run_one(msg, sink, live, slot)
            ctl.send(msgpack.packb([W_IDLE, worker_id, msg[1], accepted]))
            clear_context()
    except Exception:
        log.exception("worker crashed")
        code = ExitCode.BOOT_FAILED
    finally:
        logging.shutdown()
        for s in (ctl, sink, logs):
            s.close()
        ctx.term()
    os._exit(code)
