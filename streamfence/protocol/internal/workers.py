"""The supervisor's conversations with its workers ("workers": ZeroMQ
DEALER per worker, ROUTER at the supervisor; one msgpack array per frame) and
with the zygote (a pipe). Each message has one builder and one parser.

Supervisor -> worker ("workers"):
    [W_RUN, token, call_id, attempt, session_id, profile, request, settings,
     request_file, owner]   `encode_run(RunAttempt)` / `parse_run`
        profile: the provider profile as a map; settings: `AttemptSettings`'
        values in field order; request_file: a stored submit frame to read the
        request from, or nil; owner: the identity that submitted the call
        (for the worker's log lines). Sent when the attempt is scheduled:
        the worker prepares it, and sends nothing to the provider or the
        sink until the word that follows (workers/send_gate.py):
    [W_GO, token]     the sink authorized the attempt: send    `go_frame`
    [W_DROP, token]   it never starts: back to idle, silently  `drop_frame`
                      (`parse_word` parses both)
Worker -> supervisor (`parse_from_worker` parses both):
    [W_HELLO, worker_id, pid]                      `worker_hello_frame`
    [W_IDLE, worker_id, token, final_accepted]     `idle_frame`
The parsers take the frame's bytes and raise only `BadFrame`.

The zygote pipe: see "the zygote pipe" below (`encode_zygote`,
`decode_zygote_command`, `decode_zygote_event`; those raise ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

import msgpack

from streamfence.protocol.internal import W_DROP, W_GO, W_HELLO, W_IDLE, W_RUN
from streamfence.protocol.internal.checks import BadFrame

# ---- W_RUN (supervisor -> worker) -----------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptSettings:
    """How the worker runs one attempt (decided by the supervisor per attempt)."""

    streaming: bool = True  # False: the profile fell back to the non-streaming call
    include_usage: bool = True  # False: the provider refused `stream_options`
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 120.0
    write_timeout_s: float = 600.0
    final_ack_timeout_s: float = 30.0
    notice: str | None = None  # a notice delta to emit before the stream's first


@dataclass(frozen=True, slots=True)
class RunAttempt:
    """W_RUN: run attempt `attempt` of `call_id` on this worker. `token` names the
    reservation (echoed in W_IDLE); `profile` is the provider profile as a map.
    With `request_file`, the request is that file (a stored submit frame, read
    by the worker: the supervisor never encodes a large request again) and
    `request` only the fields the daemon set (`submitted_request`)."""

    token: int
    call_id: str
    attempt: int
    session_id: str | None  # None: the call has no session
    profile: dict[str, Any]
    request: dict[str, Any]
    settings: AttemptSettings
    request_file: str | None = None
    owner: str = ""  # the identity that submitted the call (its log lines name it)


_SETTINGS = tuple(f.name for f in fields(AttemptSettings))


def encode_run(run: RunAttempt) -> bytes:
    """W_RUN; the settings travel in `AttemptSettings`' field order, so a new
    setting is one field there and one keyword where the supervisor decides it."""
    s = run.settings
    packed: bytes = msgpack.packb(
        [W_RUN, run.token, run.call_id, run.attempt, run.session_id, run.profile, run.request,
         [getattr(s, name) for name in _SETTINGS], run.request_file, run.owner],
        use_bin_type=True)
    return packed


def _unpack(frame: bytes) -> Any:
    try:
        return msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadFrame(f"not msgpack: {exc}") from None


def parse_run(frame: bytes) -> RunAttempt:
    """A W_RUN frame (from the daemon's own supervisor: its fields are not
    checked one by one); anything else raises BadFrame."""
    msg = _unpack(frame)
    if not (type(msg) is list and len(msg) == 10 and type(msg[0]) is int and msg[0] == W_RUN
            and type(msg[7]) is list):
        raise BadFrame(f"not a W_RUN array of 10 elements: {str(msg)[:100]}")
    _, token, call_id, attempt, session_id, profile, request, settings, request_file, owner = msg
    try:
        run_settings = AttemptSettings(*settings)
    except TypeError as exc:
        raise BadFrame(f"W_RUN's settings: {exc}") from None
    return RunAttempt(token, call_id, attempt, session_id, profile, request, run_settings,
                      request_file, owner)


# ---- W_GO, W_DROP (supervisor -> worker) --------------------------------------


@dataclass(frozen=True, slots=True)
class Word:
    """The supervisor's word on the prepared attempt `token`: go (W_GO) or not
    (W_DROP)."""

    token: int
    go: bool


def go_frame(token: int) -> bytes:
    packed: bytes = msgpack.packb([W_GO, token])
    return packed


def drop_frame(token: int) -> bytes:
    packed: bytes = msgpack.packb([W_DROP, token])
    return packed


def parse_word(frame: bytes) -> Word:
    """A W_GO or W_DROP frame; anything else raises BadFrame."""
    msg = _unpack(frame)
    if type(msg) is list and len(msg) == 2 and msg[0] in (W_GO, W_DROP) \
            and type(msg[1]) is int:
        return Word(msg[1], msg[0] == W_GO)
    raise BadFrame(f"not a W_GO or W_DROP: {str(msg)[:100]}")


# ---- W_HELLO, W_IDLE (worker -> supervisor) -----------------------------------


@dataclass(frozen=True, slots=True)
class WorkerHello:
    """The worker is up (its first message)."""

    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerIdle:
    """The worker's attempt is over; `final_accepted`: the sink acked its final."""

    worker_id: int
    token: int
    final_accepted: bool


def worker_hello_frame(worker_id: int, pid: int) -> bytes:
    packed: bytes = msgpack.packb([W_HELLO, worker_id, pid])
    return packed


def idle_frame(worker_id: int, token: int, final_accepted: bool) -> bytes:
    packed: bytes = msgpack.packb([W_IDLE, worker_id, token, final_accepted])
    return packed


def parse_from_worker(frame: bytes) -> WorkerHello | WorkerIdle:
    """A W_HELLO or W_IDLE frame; anything else raises BadFrame."""
    msg = _unpack(frame)
    if type(msg) is list and msg and type(msg[0]) is int \
            and all(type(v) is int for v in msg[1:3]):
        if msg[0] == W_HELLO and len(msg) == 3:
            return WorkerHello(msg[1], msg[2])
        if msg[0] == W_IDLE and len(msg) == 4 and type(msg[3]) is bool:
            return WorkerIdle(msg[1], msg[2], msg[3])
    raise BadFrame(f"not a W_HELLO or W_IDLE: {str(msg)[:100]}")


# ---- the zygote pipe (supervisor <-> zygote) --------------------------------
# A multiprocessing pipe, not a socket (the zygote owns no ZeroMQ context: one must
# not cross a fork); each frame is a msgpack array, tag first. The tags are the
# strings the pipe has always carried, so either side can switch to these names first.


class ZygoteTag(StrEnum):
    """The first element of a zygote-pipe frame; one message type each (below)."""

    SPAWN = "spawn"  # supervisor -> zygote: fork worker `worker_id` on liveness slot `slot`
    STOP = "stop"  # supervisor -> zygote: kill the workers and exit
    READY = "ready"  # zygote -> supervisor: warmed up, forks from now on
    SPAWNED = "spawned"  # zygote -> supervisor: the worker's pid
    EXITED = "exited"  # zygote -> supervisor: a worker was reaped
    LOG = "log"  # zygote -> supervisor: one of its log records (the L_RECORD fields)


@dataclass(frozen=True, slots=True)
class SpawnWorker:
    worker_id: int
    slot: int
    warm: bool = False  # a spare (no call waits for it): warm up after the hello


@dataclass(frozen=True, slots=True)
class StopZygote:
    pass


@dataclass(frozen=True, slots=True)
class ZygoteReady:
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerSpawned:
    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerExited:
    worker_id: int  # -1: a child the zygote did not know
    pid: int
    returncode: int  # an ExitCode (protocol/lifecycle.py), or -N: killed by signal N


@dataclass(frozen=True, slots=True)
class ZygoteLog:
    fields: dict[str, Any]


ZygoteCommand = SpawnWorker | StopZygote
ZygoteEvent = ZygoteReady | WorkerSpawned | WorkerExited | ZygoteLog

_ZYGOTE_TAGS: dict[type, ZygoteTag] = {
    SpawnWorker: ZygoteTag.SPAWN, StopZygote: ZygoteTag.STOP, ZygoteReady: ZygoteTag.READY,
    WorkerSpawned: ZygoteTag.SPAWNED, WorkerExited: ZygoteTag.EXITED, ZygoteLog: ZygoteTag.LOG}
_ZYGOTE_TYPES = {tag: cls for cls, tag in _ZYGOTE_TAGS.items()}


def encode_zygote(msg: ZygoteCommand | ZygoteEvent) -> bytes:
    """The frame of any zygote-pipe message: [tag, *fields in declaration order]."""
    values = [getattr(msg, name) for name in msg.__match_args__]
    packed: bytes = msgpack.packb([_ZYGOTE_TAGS[type(msg)].value, *values], use_bin_type=True,
                                  default=str)
    return packed


def _decode_zygote(frame: bytes, allowed: tuple[type, ...]) -> Any:
    msg = msgpack.unpackb(frame, raw=False)
    try:
        cls = _ZYGOTE_TYPES.get(msg[0])
        if cls in allowed:
            return cls(*msg[1:])
    except (TypeError, IndexError, KeyError):
        pass
    raise ValueError(f"unexpected zygote-pipe message {str(msg)[:100]}")


def decode_zygote_command(frame: bytes) -> ZygoteCommand:
    """A frame the supervisor sent (ValueError for anything else)."""
    cmd: ZygoteCommand = _decode_zygote(frame, (SpawnWorker, StopZygote))
    return cmd


def decode_zygote_event(frame: bytes) -> ZygoteEvent:
    """A frame the zygote sent (ValueError for anything else)."""
    event: ZygoteEvent = _decode_zygote(frame, (ZygoteReady, WorkerSpawned, WorkerExited,
                                                ZygoteLog))
    return event
