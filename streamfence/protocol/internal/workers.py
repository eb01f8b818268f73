"""Supervisor -> worker (`W_RUN` as `RunAttempt`) and the zygote pipe
(supervisor <-> zygote)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

import msgpack

from streamfence.protocol.internal import W_RUN

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


_SETTINGS = tuple(f.name for f in fields(AttemptSettings))


def encode_run(run: RunAttempt) -> bytes:
    """W_RUN; the settings travel in `AttemptSettings`' field order, so a new
    setting is one field there and one keyword where the supervisor decides it."""
    s = run.settings
    packed: bytes = msgpack.packb(
        [W_RUN, run.token, run.call_id, run.attempt, run.session_id, run.profile, run.request,
         [getattr(s, name) for name in _SETTINGS], run.request_file], use_bin_type=True)
    return packed


def decode_run(msg: list[Any]) -> RunAttempt:
    """`msg`: the decoded W_RUN array (from the daemon's own supervisor, trusted)."""
    _, token, call_id, attempt, session_id, profile, request, settings, request_file = msg
    return RunAttempt(token, call_id, attempt, session_id, profile, request,
                      AttemptSettings(*settings), request_file)


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
