"""Internal messages between the daemon's own processes.

All are single-frame msgpack arrays whose first element is a tag (small int),
chosen for the per-delta hot path: no map keys to encode, one `unpackb`.
Sockets (all `ipc://` endpoints in the daemon's runtime directory, see
`Endpoints`):

    worker DEALER ──► sink ROUTER       "sink.in"   deltas, finals; sink acks finals
    supervisor DEALER ◄─► sink ROUTER   "sink.ctl"  authorize/fence/finish + events
    worker DEALER ◄─► supervisor ROUTER "workers"   hello, run, idle
    worker PUSH ──► supervisor PULL     "logs"      log records of every child

Worker -> sink ("sink.in"):
    [T_DELTA, call_id, attempt, seq, kind, data]
        seq starts at 1 per attempt and is contiguous; kind is a DeltaKind.
    [T_FINAL, call_id, attempt, last_seq, final]
        final: map, see `FinalInfo` keys below. Sent exactly once per attempt,
        also when the attempt failed. The worker waits for the ack.
Sink -> worker:
    [T_FINAL_ACK, call_id, attempt, accepted: bool, reason: str]

Supervisor -> sink ("sink.ctl"), each carries a request id echoed by the reply:
    [C_AUTHORIZE, req, call_id, attempt, reset: bool, model: str]
        attempt becomes the only writer of call_id (must be > any epoch seen
        for the call, else refused). reset=True voids the content so far and
        appends a `reset` event (on_partial="restart").
    [C_FENCE, req, call_id, attempt]
        close `attempt` (if it is the current one): nothing more is accepted.
    [C_FINISH, req, call_id, status, error, attempts, meta]
        append the `done` event, built from the accumulated content of the
        call's current attempt plus `meta` (finish_reason, usage, ...), commit,
        and publish it. status/error as in the public `done`.
    [C_STATS, req]
Sink -> supervisor replies:
    [R_OK, req, payload]       payload: AttemptStats map for AUTHORIZE/FENCE
                               (of the attempt that was current before; attempt
                               0 and zeros for a new call), the
                               done event for FINISH, counters for STATS
    [R_REFUSED, req, reason]
Sink -> supervisor events (unsolicited):
    [E_EVENT, call_id, seq, event_bytes]
        an accepted public event (delta/reset/done), already encoded as the
        msgpack map a subscriber receives; the supervisor forwards the bytes.
    [E_EVENTS, [[E_EVENT, call_id, seq, event_bytes], ...]]
        the events of one commit in one message (one decode per batch on the
        supervisor's side instead of one per delta).
        Events are sent only after the commit that stores them, and nothing
        the sink sends overtakes an earlier event: a subscriber never sees an
        event the transcript does not hold.
    [E_ENDED, call_id, attempt, stats, final]
        the sink accepted an attempt's final message (stats as AttemptStats).
    [E_FINAL_REFUSED, call_id, attempt, reason]

AttemptStats map: {"attempt", "accepted", "dropped", "visible_chars",
    "tool_fragments", "last_seq", "closed"}
FinalInfo map (worker -> sink, forwarded to the supervisor in E_ENDED):
    {"ok": bool, "finish_reason": str|None, "usage": map|None,
     "model": str|None, "provider_response_id": str|None,
     "dropped_tool_names": [str], "dropped_tool_indexes": [int],
     "error": None | {"class": "transient"|"final"|"context_overflow",
                      "code": str, "message": str, "status": int|None,
                      "retry_after_s": float|None},
     "diag": {"first_chunk_ms", "chunks", "bytes"}}

Supervisor -> worker ("workers"):
    [W_RUN, token, call_id, attempt, session_id, profile, request, settings]
        profile: the provider profile as a map (kind, base_url, api_key_env,
        region, ...); settings: {"connect_timeout_s", "read_timeout_s"}.
    [W_EXIT]
Worker -> supervisor:
    [W_HELLO, worker_id, pid]
    [W_IDLE, worker_id, token, final_accepted: bool]

Logs (worker PUSH -> supervisor PULL):
    [L_RECORD, {"name", "levelno", "levelname", "msg", "exc_text",
                "created", "process", "session_id", "call_id", "attempt"}]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# worker -> sink
T_DELTA = 0
T_FINAL = 1
T_FINAL_ACK = 2

# supervisor -> sink control
C_AUTHORIZE = 10
C_FENCE = 11
C_FINISH = 12
C_STATS = 13
R_OK = 20
R_REFUSED = 21
E_EVENT = 30
E_ENDED = 31
E_FINAL_REFUSED = 32
E_EVENTS = 33

# supervisor <-> worker
W_RUN = 40
W_EXIT = 41
W_HELLO = 42
W_IDLE = 43

L_RECORD = 50


@dataclass(frozen=True, slots=True)
class Endpoints:
    """The ipc endpoints of one daemon, all under one runtime directory."""

    runtime_dir: str

    def _ipc(self, name: str) -> str:
        return "ipc://" + os.path.join(self.runtime_dir, name)

    @property
    def sink_in(self) -> str:
        return self._ipc("sink.in")

    @property
    def sink_ctl(self) -> str:
        return self._ipc("sink.ctl")

    @property
    def workers(self) -> str:
        return self._ipc("workers")

    @property
    def logs(self) -> str:
        return self._ipc("logs")

    @property
    def liveness_file(self) -> str:
        return os.path.join(self.runtime_dir, "liveness.bin")


def attempt_stats(attempt: int, accepted: int, dropped: int, visible_chars: int,
                  tool_fragments: int, last_seq: int, closed: bool) -> dict[str, Any]:
    return {"attempt": attempt, "accepted": accepted, "dropped": dropped,
            "visible_chars": visible_chars, "tool_fragments": tool_fragments,
            "last_seq": last_seq, "closed": closed}


# ---- the attempt outcome (worker -> sink -> supervisor) ---------------------


class ErrorClass(StrEnum):
    """How the supervisor treats a failed attempt."""

    TRANSIENT = "transient"  # retry with backoff
    FINAL = "final"  # no retry: the call fails
    CONTEXT_OVERFLOW = "context_overflow"  # no retry, the call fails with empty content


@dataclass(frozen=True, slots=True)
class AttemptError:
    """Why an attempt failed, already scrubbed of secrets (workers.errors builds it)."""

    error_class: ErrorClass
    code: str
    message: str
    status: int | None = None
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptDiag:
    """What the worker measured of its attempt (reported in `result`'s diagnostics)."""

    first_chunk_ms: float | None = None
    chunks: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """How one attempt ended, as its worker saw it: built once by the adapter
    (or from the exception that ended it), sent to the sink in T_FINAL and
    forwarded to the supervisor in E_ENDED.

    `stream_options_rejected` / `streaming_denied`: the provider refused
    `stream_options` / the streaming action, so the supervisor remembers the
    fall-back for the profile."""

    ok: bool
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    provider_response_id: str | None = None
    dropped_tool_names: tuple[str, ...] = ()
    dropped_tool_indexes: tuple[int, ...] = ()
    error: AttemptError | None = None
    diag: AttemptDiag = AttemptDiag()
    stream_options_rejected: bool = False
    streaming_denied: bool = False
