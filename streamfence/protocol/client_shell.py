"""What the two shells (client.py's `Client`, client_async.py's `AsyncClient`)
share besides their transport: `ClientBase` (the core and its settings),
`TextFlow` (the state of one `stream_text`) and `shown_as` (a shell's method
shown as the flow it runs).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from streamfence.protocol.client_base import finished_ok, text_piece
from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.client_effects import Flow
from streamfence.protocol.client_reader import EventReader
from streamfence.protocol.credentials import Credentials
from streamfence.protocol.messages import Op

F = TypeVar("F", bound=Callable[..., Any])


def shown_as(flow: Callable[..., Any]) -> Callable[[F], F]:
    """Give a shell's method the name, docstring and parameters of the flow it runs
    (not its return annotation: the method returns what the flow returns)."""
    def show(method: F) -> F:
        functools.update_wrapper(method, flow)
        setattr(method, "__signature__",  # noqa: B010 (mypy knows no such attribute)
                inspect.signature(flow).replace(return_annotation=inspect.Signature.empty))
        return method
    return show


class TextFlow:
    """The state of one `stream_text`: submits on the first piece, then reads the text.

    `call_id` is set once the call was accepted, `done` once its done event
    came. A call that ends `failed` or `cancelled` raises CallFailed after its
    text; after the end, an exception or `close()`, every further piece is
    None (the end). Closed (or left by an exception) before its done, the
    call is cancelled unless `detach` (module docstring).
    """

    def __init__(self, core: ClientCore, provider: str, request: Mapping[str, Any],
                 markers: bool, timeout_s: float | None, detach: bool,
                 submit_kw: dict[str, Any]) -> None:
        self.call_id: str | None = None
        self.done: dict[str, Any] | None = None
        self.detach = detach
        self._core, self._provider, self._request = core, provider, request
        self._markers, self._timeout_s, self._submit_kw = markers, timeout_s, submit_kw
        self._events: EventReader | None = None
        self._over = False
        self._left = False  # `close` left the accepted call (once)

    def close(self) -> None:
        """No more pieces; an accepted call without its done is left (`ClientCore.leave`:
        cancelled unless detached). Idempotent, no I/O: the shell sends the cancel."""
        self._over = True
        if self.call_id is not None and self.done is None and not self._left:
            self._left = True
            self._core.leave(self.call_id)

    def next_piece(self) -> Flow[str | None]:
        """The next piece of text (see client_base.text_piece); None at the end."""
        if self._over:
            return None
        try:
            if self._events is None:
                call_id = yield from self._core.submit(
                    self._provider, self._request, subscribe=True, **self._submit_kw)
                self.call_id = call_id
                if not self.detach:
                    self._core.owned.add(call_id)
                if self._over:  # closed (by another task) while the submit was out
                    self.close()
                    return None
                self._events = self._core.events(call_id, self._timeout_s)
            events = self._events
            while (event := events.take() or (yield from events.wait())) is not None:
                if event["op"] == Op.DONE:
                    self._over = True
                    self.done = dict(event)
                    self._core.owned.discard(events.call_id)
                    finished_ok(event)
                    return None
                piece = text_piece(event, self._markers)
                if piece:
                    return piece
            self._over = True
            return None
        except BaseException:
            self.close()
            raise


class ClientBase:
    """What both shells share besides their transport: the core and its settings."""

    def __init__(self, endpoint: str, timeout_s: float, max_frame: int,
                 credentials: Credentials | None) -> None:
        self._core = ClientCore(endpoint, timeout_s, max_frame, credentials)
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._core.endpoint

    @property
    def timeout_s(self) -> float:
        return self._core.timeout_s

    def last_seq(self, call_id: str) -> int:
        """Highest seq of `call_id` handed out by events(); 0 if none.

        A program that reconnects (or restarts, having stored it) resumes
        with `subscribe(call_id, from_seq=last_seq)`: the next event is seq+1.
        """
        return self._core.router.last_seq(call_id)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the client of {self.endpoint} is closed")
