"""Internal messages between the daemon's own processes (docs/ARCHITECTURE.md §3).

All are msgpack arrays whose first element is a tag (small int, below), chosen
for the per-delta hot path: no map keys to encode, one decode. Sockets (in the
daemon's runtime directory, see `Endpoints`; all `ipc://` ZeroMQ endpoints
but the worker wire, an AF_UNIX stream socket with msgpack as its framing):

    worker ◄─► sink (AF_UNIX stream)    "sink.stream" deltas, finals, hellos; acks, rebinds
    (tests, tools) DEALER ──► sink      "sink.in"   the same, one ZeroMQ frame each
    supervisor DEALER ◄─► sink ROUTER   "sink.ctl"  authorize, fence, rebind, finish, stats,
                                                    subscribe, adopt, follow; replies, events
    worker DEALER ◄─► supervisor ROUTER "workers"   run; hello, idle
    child PUSH ──► supervisor PULL      "logs"      log records of the sink, gateway, workers
    supervisor ◄─► zygote               a pipe      fork requests, exits, the zygote's logs

This package holds the tags and the endpoints; each message has one builder
and one parser in the module of its conversation, whose docstring gives the
frame layouts (one exception: the sink's per-delta loop, sink/intake.py,
checks T_DELTA inline; tests/test_architecture.py holds the tags to these
modules):

- `worker_wire`: worker <-> sink ("sink.stream", "sink.in");
- `control`: supervisor <-> sink ("sink.ctl");
- `workers`: supervisor <-> worker ("workers") and the zygote pipe;
- `outcome`: the attempt outcome (`AttemptOutcome`) that T_FINAL and E_ENDED carry;
- `streamfence.protocol.logs`: the log records ("logs"; the supervisor reads
  them in supervisor/daemon.py `_drain_logs`).

Parsers of what another process sent raise only `checks.BadFrame` (a
ValueError), but the zygote pipe's decoders (ValueError) and the
supervisor's parser of its own sink's messages (`control.parse_from_sink`,
which may raise `outcome.BadOutcome`).

Logs (child PUSH -> supervisor PULL; built by `logs.ZmqLogHandler`):
    [L_RECORD, {"name", "levelno", "levelname", "msg", "exc_text", "created",
                "process", "processName", "session_id", "call_id", "attempt"}]
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# worker <-> sink
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

# supervisor <-> worker (41 was W_EXIT, which nothing ever sent)
W_RUN = 40
W_HELLO = 42
W_IDLE = 43
W_GO = 44
W_DROP = 45

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
    def events_link(self) -> str:
        """The sink's plain links to local listeners (sink/links.py): a path."""
        return os.path.join(self.runtime_dir, "events.link")

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
