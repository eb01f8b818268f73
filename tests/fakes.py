"""Fakes several test modules share. Each subclasses the Protocol it stands
for, so mypy reports a fake that drifted from it (a member missing, or of
another signature) at the fake, not at a far-away call."""

from __future__ import annotations

from streamfence.protocol.internal.control import ListenerOwner
from streamfence.sink.listeners import Cuts, Listeners, Outbox
from streamfence.sink.peer import Publisher
from streamfence.sink.shares import Active


class Nobody(Publisher, Listeners):
    """The sink's supervisor and listeners, absent: everything sent is dropped
    (the test reads the SinkState or the store directly)."""

    def publish(self, frame: bytes) -> None:
        pass

    def deliver(self, outbox: Outbox) -> Cuts:
        return []

    def replay(self, listener: bytes, events: list[bytes]) -> int:
        return 0

    def room(self, listener: bytes) -> int:
        return 0

    def cut_off(self, listener: bytes, call_id: str, seq: int) -> None:
        pass

    def subscribe(self, listener: bytes, call_id: str, owner: ListenerOwner,
                  active: Active) -> str | None:
        return None

    def unsubscribe_all(self, listener: bytes) -> set[str]:
        return set()

    def stats(self) -> dict[str, int]:
        return {}


class Clock:
    """A monotonic clock the test moves by hand (`clock.now += 5`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
