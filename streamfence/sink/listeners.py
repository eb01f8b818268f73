"""The sink's listeners as the rest of the sink sees them (`Listeners`,
which `Subscribers` is and tests stand in for), what a commit hands them
(`Outbox`) and hands back (`Cuts`), and what the events socket knows of each
listener (`Peer`, owned by `Subscribers`)."""

from __future__ import annotations

from typing import Protocol

from streamfence.protocol.internal.control import ListenerOwner
from streamfence.sink.shares import Active, Share

Outbox = list[tuple[set[bytes], list[bytes]]]  # (a call's listeners, its run) after its commit
Cuts = list[tuple[bytes, list[bytes]]]  # (listener, the events it was not sent, in order)


class Listeners(Protocol):
    """What the rest of the sink needs of `Subscribers` (tests give a stand-in)."""

    def deliver(self, outbox: Outbox) -> Cuts: ...
    def replay(self, listener: bytes, events: list[bytes]) -> int: ...
    def room(self, listener: bytes) -> int: ...
    def cut_off(self, listener: bytes, call_id: str, seq: int) -> None: ...
    def subscribe(self, listener: bytes, call_id: str, owner: ListenerOwner,
                  active: Active) -> str | None: ...
    def unsubscribe_all(self, listener: bytes) -> set[str]: ...
    def stats(self) -> dict[str, int]: ...


class Peer:
    """One listener (a connection to the events socket): the bytes sent it and
    not acknowledged, its last `ack` figure, when it last said anything, the
    Share they count in, the key it connected with (None: not heard yet or
    no auth), and whether it was cut for that key."""

    __slots__ = ("heard", "key", "out", "read", "revoked", "share")

    def __init__(self, share: Share) -> None:
        self.out = 0
        self.read = 0
        self.heard = 0.0
        self.share = share
        self.key: bytes | None = None
        self.revoked = False
