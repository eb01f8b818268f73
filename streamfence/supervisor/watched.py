"""The descriptors the supervisor's loop polls, each with its handler.

One table, in the order the loop serves them in a turn: a slot per source
(a socket, a child's sentinel, a pipe), whose source may change while the
daemon runs (a restarted child's, a new sink connection) or be absent (a
child that is down). `poll` returns the handlers of the ready slots in
table order, as they were when the poll returned: a handler that swaps a
slot's source does not make the new one ready in the same turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

Handler = Callable[[], object]  # what it returns is not looked at


class Watched:
    """Owns the loop's poller and its slots: name -> handler (in table order)
    and the source each watches now."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._handlers: dict[str, Handler] = {}
        self._sources: dict[str, Any] = {}

    def slot(self, name: str, handler: Handler, source: Any = None) -> None:
        """A slot at the end of the table; `source` (a zmq socket, a file
        descriptor, or an object with `fileno`): watched from now on, if given."""
        self._handlers[name] = handler
        if source is not None:
            self.watch(name, source)

    def watch(self, name: str, source: Any) -> None:
        """Watch `source` for slot `name`, in place of what it watched."""
        self.unwatch(name)
        self._poller.register(source, zmq.POLLIN)
        self._sources[name] = source

    def unwatch(self, name: str) -> None:
        source = self._sources.pop(name, None)
        if source is not None:
            self._poller.unregister(source)

    def poll(self, timeout_ms: int) -> list[Handler]:
        """Wait up to `timeout_ms` for any slot; the ready slots' handlers."""
        ready = dict(self._poller.poll(timeout_ms))
        return [handler for name, handler in self._handlers.items()
                if name in self._sources and _polled_as(self._sources[name]) in ready]


def _polled_as(source: Any) -> Any:
    """What zmq's poller reports a ready source as: a socket or a descriptor
    as itself, another object by its descriptor."""
    return source if isinstance(source, (zmq.Socket, int)) else source.fileno()
