"""What a client operation asks of its shell: the effects a flow yields.

Each operation is a *flow* (`Flow`): a generator that builds the request,
yields the I/O it needs as effects, and returns the interpreted reply (or
raises ClientError / TimeoutError). A shell (the sync `Client`, the asyncio
`AsyncClient`) runs a flow to its end by performing each effect on its socket
and resuming the flow with nothing:

    Send(frames, what, to_events)
                        send the frames, on the request socket, or with
                        `to_events` on the events socket. A failure (a send
                        timeout, raised as `core.send_failed(what)`, or a
                        closed client) is thrown into the flow, whose cleanup
                        then runs.
    Wait(deadline, on)  receive frames from both sockets, routing each through
                        `core.router`, until one answers a waiting request or
                        `deadline` passes; returning early is allowed. `on`
                        names what the flow waits for (a ref, a call id,
                        `client_router.LISTENING`; None: anything), so a shell
                        serving many flows wakes only the one concerned.

Deadlines are `time.monotonic()` values.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Send:
    frames: list[bytes]
    what: str  # names the request in a send-timeout error
    to_events: bool = False  # on the events socket (`listen`)


@dataclass(slots=True)
class Wait:
    deadline: float
    on: str | None = None  # the key the router marks `woken` for it (None: any message)


Effect = Send | Wait
Flow = Generator[Effect, None, T]
