"""The states a client sees in `status` (docs/PROTOCOL.md "status") and
the gateway's /metrics labels: a call's state, why an attempt was fenced, a
worker's state. The transitions between them are the supervisor's
(supervisor/calls.py, supervisor/pool.py); only the names live here, so a
client of the daemon reads them without importing the supervisor."""

from __future__ import annotations

from enum import Enum


class CallState(Enum):
    QUEUED = "queued"
    AUTHORIZING = "authorizing"
    RUNNING = "running"
    FENCING = "fencing"
    BACKOFF = "backoff"
    FINISHING = "finishing"
    DONE = "done"


class FenceReason(Enum):
    """Why the supervisor fenced an attempt (journaled as the attempt's `how`)."""

    STALE = "stale"
    WORKER_DIED = "worker_died"
    FINAL_REFUSED = "final_refused"
    DEADLINE = "deadline"
    SINK_RESTARTED = "sink_restarted"
    CANCELLED = "cancelled"
    CLUSTER_LOST = "cluster_lost"  # cluster mode: another host owns the call now


class WorkerState(Enum):
    SPAWNING = "spawning"  # fork requested, no hello yet
    IDLE = "idle"  # ready for an attempt
    RESERVED = "reserved"  # picked for an attempt that awaits its authorization
    BUSY = "busy"  # running an attempt
    KILLING = "killing"  # SIGKILL sent, not yet reaped
    DEAD = "dead"
