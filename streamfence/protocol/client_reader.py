"""Reading one call's events for `events()`, `run` and `stream_text`: `EventReader`.

It hands out the call's events as the router buffered them and decides,
when none is buffered, whether to wait, re-subscribe (a gap, a cut_off, a
reconnect), probe the daemon or give up. It runs its I/O through the core's
`subscribe` and `result` flows (`ReaderCore`, which `client_core.ClientCore`
is), so this module does not import the core.
"""

from __future__ import annotations

from time import monotonic
from typing import Any, Protocol

from streamfence.protocol.client_effects import Flow, Wait
from streamfence.protocol.client_router import EVENTS_LOST, ClientError, Router
from streamfence.protocol.messages import Op

_DONE = Op.DONE.value  # compared per event: a plain str compares faster than the enum member


class ReaderCore(Protocol):
    """What an EventReader needs of `client_core.ClientCore`."""

    @property
    def router(self) -> Router: ...

    @property
    def timeout_s(self) -> float: ...

    def subscribe(self, call_id: str, from_seq: int = 0) -> Flow[None]: ...

    def result(self, call_id: str, wait_s: float = 0.0) -> Flow[dict[str, Any] | None]: ...


class EventReader:
    """One `events()` iteration: hands out the call's events, decides when to wait,
    re-subscribe, probe or give up.

    A shell iterates with `take()` (a buffered event, no I/O) and, when that
    finds none, runs the `wait()` flow. `limit` (the caller's timeout_s) is
    the longest silence allowed between two events; None means no limit while
    the daemon answers. A gap (a later event came, the next one did not) is
    refilled by a subscribe from the last seq handed out. After the client's
    timeout_s without an event it probes: it re-subscribes from the last seq
    (which repairs a subscription lost to a reconnect or a daemon restart)
    and asks `result` with wait_s 0, whose missing answer raises TimeoutError.
    A probe that finds the call done hands that done event to the stream; if
    the events before it still have not come by the next probe, EVENTS_LOST
    is raised. When the events connection was made again (the router counts
    reconnects), it re-subscribes from the last seq at once.
    """

    def __init__(self, core: ReaderCore, call_id: str, limit: float | None) -> None:
        self._core, self._router = core, core.router
        self._next_event = core.router.next_event  # bound once: take() runs per event
        self.call_id = call_id
        self.limit = limit
        self.last_event = self.quiet_since = monotonic()
        self.done_probes = 0  # probes in a row that found the call done
        self.reconnects = core.router.reconnects  # the router's count, as last acted on
        self.ended = False  # its done was handed out, or it had ended before
        self._wait = Wait(0.0, call_id)  # reused: the wait path allocates no effect per event

    def take(self) -> dict[str, Any] | None:
        """The call's next event if it is buffered; None otherwise or after its done."""
        if self.ended:
            return None
        event = self._next_event(self.call_id)
        if event is not None:
            self.last_event = self.quiet_since = monotonic()
            self.done_probes = 0
            self.ended = event["op"] == _DONE
        return event

    def wait(self) -> Flow[dict[str, Any] | None]:
        """After take() found nothing: the call's next event, waiting for it (and
        re-subscribing or probing when due); None once its events have ended."""
        router, call_id, wait = self._router, self.call_id, self._wait
        while not self.ended:
            if router.is_finished(call_id):
                self.ended = True
                break
            gap_from = router.gap(call_id)
            if router.take_cut(call_id):
                gap_from = router.last_seq(call_id)
            if router.reconnects != self.reconnects:
                self.reconnects = router.reconnects
                gap_from = router.last_seq(call_id)
            if gap_from is not None:
                yield from self._core.subscribe(call_id, gap_from)
            if self._probe_due(monotonic()):
                yield from self._probe()
            else:
                probe_at = self.quiet_since + self._core.timeout_s
                wait.deadline = (probe_at if self.limit is None
                                 else min(probe_at, self.last_event + self.limit))
                yield wait
            event = self.take()
            if event is not None:
                return event
        return None

    def _probe_due(self, now: float) -> bool:
        """True if a probe is due; raises TimeoutError past the caller's limit."""
        if self.limit is not None and now - self.last_event >= self.limit:
            raise TimeoutError(f"no event for call {self.call_id} within {self.limit:g} s "
                               f"(last seq received: {self._router.last_seq(self.call_id)})")
        return now - self.quiet_since >= self._core.timeout_s

    def _probe(self) -> Flow[None]:
        core, router, call_id = self._core, self._router, self.call_id
        yield from core.subscribe(call_id, router.last_seq(call_id))
        try:
            reply = yield from core.result(call_id)
        except TimeoutError as exc:
            raise TimeoutError(f"waiting for events of call {call_id} (last seq received: "
                               f"{router.last_seq(call_id)}), the daemon did not answer a "
                               f"liveness probe: {exc}") from None
        self.quiet_since = monotonic()
        if reply is None:
            return
        self.done_probes += 1
        if self.done_probes > 1:
            raise ClientError(EVENTS_LOST, f"call {call_id} is done (done seq "
                              f"{reply.get('seq')}) but its events after seq "
                              f"{router.last_seq(call_id)} did not arrive after re-subscribing",
                              reply)
        # The done event as stored: without the reply's ref and diagnostics.
        router.deliver({k: v for k, v in reply.items() if k not in ("ref", "diagnostics")})
