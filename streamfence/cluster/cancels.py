"""Cancels across hosts (docs/ARCHITECTURE.md §4.17): a host forwards a
cancel of a call another host runs to that host over core NATS (request
and reply on `sf.cancel.<host>`, not stored: a cancel nobody serves went
nowhere), and serves the ones forwarded to it. One `Cancels` per Ledger,
on its connection (`Ledger.cancels`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from streamfence.cluster.settings import ClusterSettings

CANCELS_SUBJECT = "sf.cancel."  # + host: cancels forwarded to it (core NATS: not stored)


class Cancels:
    """Owns nothing but the connection's use for cancels."""

    def __init__(self, nc: NatsClient, settings: ClusterSettings) -> None:
        self._nc = nc
        self._settings = settings

    async def serve(self, asked: Callable[[str, str], None]) -> None:
        """Hand each cancel another host forwards to this one to `asked(call_id,
        reply_to)`; `answer(reply_to, ...)` answers it."""
        async def got(msg: Msg) -> None:
            try:
                call_id = msgpack.unpackb(msg.data or b"", raw=False)
            except ValueError:
                call_id = None
            if isinstance(call_id, str) and msg.reply:
                asked(call_id, msg.reply)
            elif msg.reply:  # not a call id: nothing here is cancelled
                await self.answer(msg.reply, {"op": "unknown"})
        await self._nc.subscribe(CANCELS_SUBJECT + self._settings.host, cb=got)

    async def answer(self, reply_to: str, answer: dict[str, Any]) -> None:
        await self._nc.publish(reply_to, msgpack.packb(answer))

    async def forward(self, host: str, call_id: str) -> dict[str, Any]:
        """`host`'s answer to a cancel of `call_id`. Raises NoRespondersError if
        no host serves `host`'s cancels (the cancel went nowhere), TimeoutError
        if none answered within timeout_s: core NATS may still deliver it (the
        host was frozen), or the host acted and its answer was lost."""
        reply = await self._nc.request(CANCELS_SUBJECT + host, msgpack.packb(call_id),
                                       timeout=self._settings.timeout_s)
        answer: dict[str, Any] = msgpack.unpackb(reply.data or b"\x80", raw=False)
        return answer
