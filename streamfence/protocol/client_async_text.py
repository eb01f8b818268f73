"""`AsyncTextStream`: the asyncio twin of `client.TextStream`, the text of
one call as an async iterator (`AsyncClient.stream_text`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol, TypeVar

from streamfence.protocol.client_core import ClientCore
from streamfence.protocol.client_effects import Flow
from streamfence.protocol.client_shell import TextFlow

T = TypeVar("T")


class AsyncShell(Protocol):
    """What the stream needs of its `AsyncClient` (a Protocol: no import cycle)."""

    _core: ClientCore

    async def _call(self, flow: Flow[T]) -> T: ...
    def _send_cancels(self) -> None: ...


class AsyncTextStream(TextFlow):
    """The asyncio twin of TextStream (`async for`; `async with` or `aclose()` closes it)."""

    def __init__(self, client: AsyncShell, provider: str, request: Mapping[str, Any],
                 markers: bool, timeout_s: float | None, detach: bool,
                 submit_kw: dict[str, Any]) -> None:
        super().__init__(client._core, provider, request, markers, timeout_s, detach,
                         submit_kw)
        self._client = client

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        piece = await self._client._call(self.next_piece())
        if piece is None:
            raise StopAsyncIteration
        return piece

    def close(self) -> None:
        """As TextStream.close."""
        super().close()
        self._client._send_cancels()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (no module global: a finalizer may run at interpreter exit)
            self.close()
        except Exception:
            pass
