"""The client connections: counted, capped, and kept within the descriptors
(docs/SECURITY.md, "Connections").

The client socket's monitor reports each connection accepted (with its
descriptor) and its close; the loop reports the descriptor each request came
from (`spoke`). From them `FrontConnections` keeps the count
(`counters.connections`) and:

- `[daemon] max_connections`: past it, ZAP refuses new handshakes (curve;
  with `auth = "none"` the cap is only logged).
- the silent connections: accepted less than HANDSHAKE_S ago, no request
  yet (those in their handshake among them: libzmq closes a handshake that
  takes longer than HANDSHAKE_S, so an older connection is past it). At
  most SILENT_MAX of them, and never so many that the open-files limit
  would leave fewer than RESERVE descriptors free. Past either, the oldest
  are shed: their descriptor is shut down, libzmq sees the end and closes
  it (`connections_shed`). When the other connections alone leave no room,
  ZAP refuses new handshakes as at the cap. (The monitor cannot say whose
  handshake ended: its handshake events carry no descriptor.)

Why: libzmq's listener, when `accept` fails for want of a descriptor,
retries at once in its I/O thread, for as long as a connection waits, and
reports each failure as a monitor event. At a 1,024-descriptor limit, 1,100
idle TCP connections spun the supervisor at 160-190 % CPU with 18 M failed
accepts queued as events (1.7-2.0 GiB), which the loop was still reading
42-59 s after the connections closed. So clients never get to use the last
descriptors, and failed accepts are not watched at all.

libzmq's I/O thread sends monitor events with a blocking send, so the
monitor's queue has no limit (RCVHWM 0): the I/O thread never waits on it.
The loop reads at most DRAIN_MAX events a turn.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("streamfence.connections")

RESERVE = 128  # descriptors never given to client connections (the daemon's own, bursts)
SILENT_MAX = 2048  # silent connections at once; beyond, the oldest are shed
HANDSHAKE_S = 10.0  # libzmq closes a connection whose handshake takes longer
DRAIN_MAX = 10_000  # monitor events read in one turn of the loop
LOG_EVERY_S = 10.0  # "cap reached" and "shed" lines, at most this often

_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED

Names = tuple[Any, Any]  # a connection's (local, peer) address: which socket a descriptor is


class FrontConnections:
    """Owns the client socket's monitor, the count of its connections and the
    table of the silent ones (descriptor -> when accepted, its addresses)."""

    def __init__(self, context: zmq.Context[Any], max_connections: int,
                 refuse_handshakes: Callable[[bool], None]) -> None:
        """`refuse_handshakes(True)`: from now on ZAP refuses new handshakes."""
        self._context = context
        self._max_connections = max_connections
        self._refuse_handshakes = refuse_handshakes
        self.monitor: zmq.Socket[bytes] | None = None
        self.open = 0  # accepted and not yet closed, handshakes included
        self.shed = 0
        self._silent: OrderedDict[int, tuple[float, Names | None]] = OrderedDict()
        self._closing: set[int] = set()  # shed, not yet closed by libzmq
        self._full = False
        self._logged: dict[str, float] = {}  # what was last logged when (rate limit)

    def watch(self, sock: zmq.Socket[bytes]) -> None:
        """Watch the client socket's connections (call before bind: none is missed)."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        where = f"inproc://streamfence-client-connections-{id(self)}"
        sock.monitor(where, _WATCHED)
        monitor: zmq.Socket[bytes] = self._context.socket(zmq.PAIR)
        monitor.rcvhwm = 0
        monitor.connect(where)
        self.monitor = monitor

    def on_monitor(self) -> None:
        """The loop's turn when the monitor is readable: count, shed, cap."""
        assert self.monitor is not None
        now = time.monotonic()
        for _ in range(DRAIN_MAX):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.open += 1
                self._silent[fd] = (now, _names(fd))
            else:  # disconnected
                self.open = max(0, self.open - 1)
                self._silent.pop(fd, None)
                self._closing.discard(fd)
        self._forget_old(now)
        room = _room(self.open)
        self._shed_silent(room)
        established = self.open - len(self._silent) - len(self._closing)
        capped = bool(self._max_connections) and self.open > self._max_connections
        self._set_full(capped, room is not None and established >= room)

    def spoke(self, frame: zmq.Frame) -> None:
        """A request came in `frame`: its connection is not silent."""
        if self._silent:
            self._silent.pop(frame.get(zmq.SRCFD), None)

    def _forget_old(self, now: float) -> None:
        """Silent connections older than HANDSHAKE_S are past their handshake."""
        silent = self._silent
        while silent and now - next(iter(silent.values()))[0] >= HANDSHAKE_S:
            silent.popitem(last=False)

    def _shed_silent(self, room: int | None) -> None:
        """Shed the oldest silent connections past SILENT_MAX or past the
        `room` the descriptors leave to connections (None: no limit)."""
        keep = SILENT_MAX
        if room is not None:
            established = self.open - len(self._silent) - len(self._closing)
            keep = max(0, min(keep, room - established - len(self._closing)))
        shed = 0
        while len(self._silent) > keep:
            fd, (_, names) = self._silent.popitem(last=False)
            if _shut_down(fd, names):
                self._closing.add(fd)
                shed += 1
        if shed:
            self.shed += shed
            self._log_at_most_every(
                "shed", logging.WARNING, "shed %d new client connection(s) that had not "
                "spoken (%d at most, and %d descriptors kept free under the open-files "
                "limit; %d so far)", shed, SILENT_MAX, RESERVE, self.shed)

    def _set_full(self, capped: bool, no_room: bool) -> None:
        full = capped or no_room
        if full and not self._full:
            if capped:
                self._log_at_most_every(
                    "cap", logging.WARNING, "connection cap reached (max_connections %d): "
                    "new clients are refused until some close", self._max_connections)
            else:
                self._log_at_most_every(
                    "room", logging.WARNING, "open-files limit: %d client connections leave "
                    "no room for more (%d descriptors kept free); new clients are refused "
                    "until some close", self.open, RESERVE)
        elif self._full and not full:
            log.info("below the connection cap again: %d client connections", self.open)
        self._full = full
        self._refuse_handshakes(full)

    def _log_at_most_every(self, what: str, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._logged.get(what, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[what] = now
            log.log(level, msg, *args)

    def counts(self) -> dict[str, int]:
        """For `status`: connections open, silent, shed."""
        self._forget_old(time.monotonic())
        return {"connections": self.open, "connections_silent": len(self._silent),
                "connections_shed": self.shed}

    def view(self) -> dict[str, int]:
        """`status`'s `connections`: open now, silent, shed so far, and the cap
        (0: none)."""
        counts = self.counts()
        return {"live": counts["connections"], "silent": counts["connections_silent"],
                "shed": counts["connections_shed"], "max": self._max_connections}

    def close(self, sock: zmq.Socket[bytes]) -> None:
        """Before `sock` closes: no event may go to a monitor nobody reads."""
        if self.monitor is not None:
            sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None


def _room(connections: int) -> int | None:
    """How many client connections the open-files limit has room for, RESERVE
    kept free: `connections` plus the descriptors free beyond the reserve.
    None: no limit, or it cannot be known (no /proc)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # read each time: it may be lowered
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    return soft - RESERVE - (used - connections)


def _names(fd: int) -> Names | None:
    """The (local, peer) address of the connection on `fd`; None if it is gone."""
    try:
        sock = socket.socket(fileno=fd)  # a view of libzmq's descriptor: detached below
    except OSError:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()


def _shut_down(fd: int, names: Names | None) -> bool:
    """Shut the connection on `fd` down if it is still the one accepted with
    these `names` (a closed descriptor's number may be another's by now):
    libzmq then closes it. Whether it was shut down."""
    if names is None:
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if (sock.getsockname(), sock.getpeername()) != names:
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()
