"""Named failpoints: a fault a test arms at one step of one process.

A failpoint sits where a process hands something on or acts on what it
read (docs/ARCHITECTURE.md §7 lists every point and why it is there). A
test, or `scripts/chaos_schedules.py`, arms points through the environment
the daemon starts with, which every child inherits:

    STREAMFENCE_FAILPOINTS="sink.after_commit=crash;worker.before_final=pause(800ms)@2"

Each entry is `NAME=ACTION[@N]`: on the N-th pass of this process through
the point (default: the first), do ACTION, once:

- `crash`: SIGKILL this process (nothing of it runs after the point);
- `pause(D)`: sleep D (`ms` or `s`): the process stands still, as a GC
  pause, a swapped page or SIGSTOP would make it;
- `raise`: raise `FailpointError` (an unexpected exception at that step);
- `drop`: the call site skips the message it was about to hand on (only
  where its entry in `POINTS` says it can);
- `count`: nothing; only the pass is recorded (see below).

With STREAMFENCE_FAILPOINTS_DIR set (the explorer and the tests set it), a
fired action is fired once for the whole daemon, not once per process (a
sink restarted after `crash` does not crash again at the same point: the
first firing leaves a marker file), and every pass through an armed point
appends its name to `hits` there, so a test can tell a point was reached.
`*=count` arms every point for that record alone.

Disarmed (the variable unset, as in production), `ARMED` is empty and a
call site costs one truthiness test of a module global:
`if ARMED and failpoint("sink.after_commit"): ...`. No point sits on the
per-delta path.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

ENV = "STREAMFENCE_FAILPOINTS"
DIR_ENV = "STREAMFENCE_FAILPOINTS_DIR"

# Every point: its name (`<process>.<step>`) -> the step it sits between.
# ARCHITECTURE §7 holds the same list, and tests/test_failpoints.py checks
# that each is placed in the code and reached by a test.
POINTS: dict[str, str] = {
    "supervisor.after_journal_commit": "a submit is durable; `accepted` not yet sent",
    "supervisor.before_authorize": "an attempt's epoch journaled (a retry's: written, its "
                                   "sync under way); C_AUTHORIZE not yet sent",
    "supervisor.before_dispatch": "the sink authorized the attempt; W_GO not yet sent (the "
                                  "worker holds it prepared)",
    "supervisor.after_fence": "the sink closed an attempt; its worker not yet killed",
    "supervisor.before_rebind": "a running attempt's new epoch journaled after a sink "
                                "restart; C_REBIND not yet sent",
    "sink.after_authorize": "an epoch stored; the supervisor's ack not yet sent",
    "sink.after_commit": "a group commit stored; the events it holds for subscribers not yet "
                         "sent",
    "sink.after_done_sent": "a call's done stored and sent to its subscribers; the "
                            "supervisor's answer to the finish not yet sent",
    "sink.before_final_ack": "a worker's final judged, the supervisor told; T_FINAL_ACK not "
                             "yet sent (drop: the ack is lost)",
    "sink.after_rebind": "a rebind's new epoch stored; T_REBIND not yet sent to the worker",
    "worker.before_final": "the provider's stream ended; T_FINAL not yet sent (drop: the "
                           "final is lost)",
    "worker.after_rebind": "T_REBIND received; the held deltas not yet sent again",
    "worker.before_warm_up_step": "a new spare between two steps of its warm-up; whether an "
                                  "attempt came meanwhile not yet looked at",
    "gateway.replay_to_live": "a resumed HTTP stream read again up to Last-Event-ID; the "
                              "first event after it not yet sent",
    "cluster.before_take": "a call's owner entry read; its compare-and-set to a higher epoch "
                           "not yet sent (pause: the process's ledger thread stands still)",
    "cluster.before_epoch_append": "where a call's log ends decided (its last record read "
                                   "and judged, or known to the sink); the epoch record's "
                                   "append conditional on it not yet sent",
}
# Points only a daemon in cluster mode passes (the ledger's, cluster/ledger.py):
# the explorer's `host-pause` class arms them, its other classes never do.
CLUSTER_POINTS = tuple(name for name in POINTS if name.startswith("cluster."))

KINDS = ("crash", "pause", "raise", "drop", "count")
_ENTRY = re.compile(r"^(?P<name>[\w.*]+)=(?P<kind>crash|pause|raise|drop|count)"
                    r"(?:\((?P<value>\d+(?:\.\d+)?)(?P<unit>ms|s)\))?(?:@(?P<nth>\d+))?$")


class FailpointError(RuntimeError):
    """Raised by an armed `raise` point: an unexpected error at that step."""


@dataclass(frozen=True, slots=True)
class Action:
    kind: str
    pause_s: float = 0.0
    nth: int = 1  # fire on this pass of the process through the point (1-based)


def parse(spec: str, known: dict[str, str] | None = None) -> dict[str, Action]:
    """`NAME=ACTION[@N];...` as a map; ValueError naming the entry that is
    not one (an unknown point, an unknown action, a pause without its time)."""
    points = POINTS if known is None else known
    armed: dict[str, Action] = {}
    for entry in (e.strip() for e in spec.split(";")):
        if not entry:
            continue
        m = _ENTRY.match(entry)
        if m is None:
            raise ValueError(f"{ENV}: {entry!r} is not NAME=ACTION[@N] with ACTION one of "
                             f"crash, pause(D ms|s), raise, drop, count")
        name, kind = m["name"], m["kind"]
        if name != "*" and name not in points:
            raise ValueError(f"{ENV}: {name!r} is no failpoint (docs/ARCHITECTURE.md §7)")
        if (kind == "pause") != (m["value"] is not None):
            raise ValueError(f"{ENV}: {entry!r}: pause takes a time, pause(300ms), "
                             f"and no other action does")
        pause_s = 0.0
        if m["value"] is not None:
            pause_s = float(m["value"]) / (1000.0 if m["unit"] == "ms" else 1.0)
        nth = int(m["nth"] or 1)
        if nth < 1:
            raise ValueError(f"{ENV}: {entry!r}: @N counts from 1")
        armed[name] = Action(kind, pause_s, nth)
    return armed


def _armed_from_environment() -> dict[str, Action]:
    spec = os.environ.get(ENV, "")
    if not spec:
        return {}
    try:
        return parse(spec)
    except ValueError:
        return {}  # `check()` at the daemon's start says why; a child never guesses


ARMED: dict[str, Action] = _armed_from_environment()
_passes: dict[str, int] = {}  # this process's passes through each armed point


def check() -> None:
    """Raise ValueError if the environment's spec is not valid (the daemon's
    start calls this before it starts any child)."""
    parse(os.environ.get(ENV, ""))


def failpoint(name: str) -> bool:
    """Pass through the point `name`: act if it is armed for this pass.
    True means "drop the message you were about to send" (a `drop` action);
    a `crash` does not return, a `raise` raises FailpointError."""
    action = ARMED.get(name)
    wildcard = ARMED.get("*")
    if action is None and wildcard is None:
        return False
    where = os.environ.get(DIR_ENV)
    if where:
        _record(where, name)
    if action is None:
        return False
    passes = _passes[name] = _passes.get(name, 0) + 1
    if passes != action.nth or not _first_firing(where, name):
        return False
    if action.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.kind == "pause":
        time.sleep(action.pause_s)
    elif action.kind == "raise":
        raise FailpointError(f"failpoint {name} armed to raise")
    return action.kind == "drop"


def _record(where: str, name: str) -> None:
    # One short append per pass: O_APPEND keeps the lines of processes whole.
    fd = os.open(os.path.join(where, "hits"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, f"{name} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def _first_firing(where: str | None, name: str) -> bool:
    """True for the first process to fire `name` (with a directory to mark
    it in); without one, every process fires its own."""
    if not where:
        return True
    try:
        os.close(os.open(os.path.join(where, f"fired.{name}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def hits(where: str) -> list[str]:
    """The points passed, in order, as recorded under STREAMFENCE_FAILPOINTS_DIR."""
    try:
        with open(os.path.join(where, "hits")) as f:
            return [line.split(" ", 1)[0] for line in f if line.strip()]
    except FileNotFoundError:
        return []
