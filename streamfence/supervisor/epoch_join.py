"""A retry's epoch, committed by the journal and authorized by the sink at
the same time (docs/ARCHITECTURE.md §2.2): the attempt goes on (its W_GO)
only once both hold it, whichever answers first.

A first attempt does not join: its epoch commits with its call's row, which
must be durable before the sink hears of the call (a call the journal then
drops, e.g. on a storage fault, must leave nothing at the sink). A retry's
call is durable already; what the overlap can leave after a power cut is the
transcript one epoch ahead of the journal on that call, and recovery starts
above both (supervisor/recovery.py; supervisor/storepair.py allows it)."""

from __future__ import annotations

from collections.abc import Callable

from streamfence.supervisor.sinklink import StatsReply


class EpochJoin:
    """Runs `then(reply)` once the journal has synced the epoch (`synced`)
    and the sink has answered its authorize (`answered`)."""

    __slots__ = ("_reply", "_synced", "_then")

    def __init__(self, then: Callable[[StatsReply], None]) -> None:
        self._then = then
        self._synced = False
        self._reply: StatsReply | None = None  # a reply is never None

    def synced(self) -> None:
        self._synced = True
        self._both()

    def answered(self, reply: StatsReply) -> None:
        self._reply = reply
        self._both()

    def _both(self) -> None:
        if self._synced and self._reply is not None:
            self._then(self._reply)
