"""Internal messages between the daemon's own processes (docs/ARCHITECTURE.md §3).

All are msgpack arrays whose first element is a tag (small int), chosen for
the per-delta hot path: no map keys to encode, one decode. Sockets (in the
daemon's runtime directory, see `Endpoints`; all `ipc://` ZeroMQ endpoints
but the worker wire, an AF_UNIX stream socket with msgpack as its framing):

    worker ──► sink (AF_UNIX stream)    "sink.stream" deltas, finals; sink acks finals
    (tests, tools) DEALER ──► sink      "sink.in"   the same, one ZeroMQ frame each
    supervisor DEALER ◄─► sink ROUTER   "sink.ctl"  authorize/fence/finish/subscribe
    worker DEALER ◄─► supervisor ROUTER "workers"   hello, run, idle
    worker PUSH ──► supervisor PULL     "logs"      log records of every child
    supervisor ◄─► zygote               a pipe      fork requests, exits (`workers`)

This package holds the tags and the endpoints; each message has one builder
and one parser in the module of its conversation:

- `outcome`: the attempt outcome (`AttemptOutcome`), worker -> sink -> supervisor;
- `control`: supervisor <-> sink (`sink.ctl`);
- `workers`: supervisor -> worker (`W_RUN` as `RunAttempt`) and the zygote pipe.

Worker -> sink ("sink.stream", or "sink.in"):
    [T_DELTA, call_id, attempt, seq, kind, data]
        seq starts at 1 per attempt and is contiguous; kind is a DeltaKind.
    [T_FINAL, call_id, attempt, last_seq, outcome]
        outcome: `outcome.outcome_to_wire(AttemptOutcome)`. Sent exactly once
        per attempt, also when the attempt failed. The worker waits for the ack.
    [T_HELLO, call_id, attempt, token]
        Sent first on a connection opened again mid-attempt (the sink it
        wrote to died): the worker holds its deltas until the answer.
Sink -> worker:
    [T_FINAL_ACK, call_id, attempt, accepted: bool, reason: str]
    [T_REBIND, call_id, attempt, new_attempt, resume_after]
        The answer to T_HELLO: write on as `new_attempt`, from seq
        resume_after + 1 (what the transcript holds of the answer is durable);
        new_attempt 0: the attempt is over, write nothing more.

Supervisor -> sink ("sink.ctl"), each carries a request id echoed by the reply
(records `Authorize`, `Fence`, `Rebind`, `Finish`, `Stats`, `AddSubscriber`;
`control.encode_control` / `control.parse_control`):
    [C_AUTHORIZE, req, call_id, attempt, reset: bool, model: str|None, log_seq: int]
                               (log_seq: cluster mode, where the supervisor opened the
                               attempt's epoch in the call's log; 0 or absent: none)
    [C_FENCE, req, call_id, attempt]
    [C_REBIND, req, call_id, attempt, from_attempt, content_from, token]
    [C_ADOPT, req, call_id, epoch]  cluster mode: the call was taken over from a
                               dead host at `epoch`: open it in the call's log
                               and store what the log holds (answered with the
                               stats of that content; refused if it holds a done)
    [C_FOLLOW, req, call_id]   cluster mode: a call another host runs, asked for
                               here: store its log as a replica and keep
                               following it to its done (answered {done})
        after a sink restart: the running attempt `from_attempt` (its worker
        holds `token`) writes on as `attempt`, its answer's content being
        every delta since attempt `content_from` (docs/ARCHITECTURE.md §2.8)
    [C_FINISH, req, call_id, status, error, attempts, meta]   meta: FinishMeta map
    [C_STATS, req]
    [C_SUBSCRIBE, req, call_id, listener, from_seq, live: bool]   from_seq -1: from now
Sink -> supervisor (`control.parse_from_sink`; the events themselves go from
the sink to the subscribers' listeners, never through the supervisor):
    [R_OK, req, payload]       `encode_ok`: AttemptStats for AUTHORIZE/FENCE/REBIND,
                               the done event for FINISH, counters for STATS,
                               nil for SUBSCRIBE
    [R_REFUSED, req, reason]   `encode_refused`
    [E_ENDED, call_id, attempt, stats, outcome]     `encode_ended`
    [E_FINAL_REFUSED, call_id, attempt, reason]     `encode_final_refused`
    [E_LOST, call_id, attempt, reason]              `encode_lost`: cluster mode, the
                               cluster refused the call's run: another host owns it
    [E_FOLLOWED_DONE, call_id, done]                `encode_followed_done`: cluster
                               mode, a followed call's done is stored here
AttemptStats: [attempt, accepted, dropped, visible_chars, tool_fragments,
    last_seq, closed] (`stats_to_wire` / `stats_from_wire`).

Supervisor -> worker ("workers"):
    [W_RUN, token, call_id, attempt, session_id, profile, request, settings]
        `workers.encode_run(RunAttempt)` / `workers.decode_run`; profile: the
        provider profile as a map; settings: `AttemptSettings` in field order.
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

# worker -> sink
T_DELTA = 0
T_FINAL = 1
T_FINAL_ACK = 2
T_HELLO = 3
T_REBIND = 4

# supervisor -> sink control
C_AUTHORIZE = 10
C_FENCE = 11
C_FINISH = 12
C_STATS = 13
C_SUBSCRIBE = 14
C_REBIND = 15
C_ADOPT = 16
C_FOLLOW = 17
R_OK = 20
R_REFUSED = 21
E_ENDED = 31
E_FINAL_REFUSED = 32
E_LOST = 33
E_FOLLOWED_DONE = 34

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
    def sink_stream(self) -> str:
        """The workers' AF_UNIX stream socket (a path, not a ZeroMQ endpoint)."""
        return os.path.join(self.runtime_dir, "sink.stream")

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
