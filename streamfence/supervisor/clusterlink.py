"""The supervisor's side of cluster mode (docs/ARCHITECTURE.md §4.17, rules
1 and 2): a call's record replicated before it is `accepted`, and each
attempt's ownership taken by compare-and-set before the sink hears of it.

Both go through the bridge (cluster/bridge.py) and answer by callback in
the supervisor's own loop (`run_done`, when `fd` is readable), as the
journal's commits and the sink's replies do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.ledger import Owner
from streamfence.cluster.settings import ClusterSettings

log = logging.getLogger("streamfence.supervisor")

class ClusterLink:
    """Owns the bridge and, per live call, the owner entry this host last wrote."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.bridge = LedgerBridge(settings)
        self._owners: dict[str, Owner] = {}
        self.accepted = 0
        self.moved = 0  # calls found owned by another host

    @property
    def fd(self) -> int:
        return self.bridge.fd

    def run_done(self) -> None:
        self.bridge.run_done()

    def accept(self, call_id: str, record: bytes, then: Callable[[str | None], None]) -> None:
        """Store the call's record at the cluster's replication; `then(None)` once
        stored, or `then(why not)`."""
        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("the cluster did not store call %s: %s", call_id, result)
                then(f"{type(result).__name__}: {result}")
            else:
                self.accepted += 1
                then(None)
        self.bridge.submit(self.bridge.ledger.accept(call_id, record), done)

    def take(self, call_id: str, epoch: int, then: Callable[[bool | str], None]) -> None:
        """Own the call at `epoch` (an attempt about to start): `then(True)`;
        `then(False)`: another host owns it; `then(why)`: the cluster failed."""
        ledger = self.bridge.ledger
        seen = self._owners.get(call_id)

        async def take() -> Owner | None:
            current = seen if seen is not None else await ledger.owner(call_id)
            if current is not None and current.host != self.settings.host:
                return None  # another host's (taking over is the leases' job)
            held = await ledger.take(call_id, current, epoch)
            return held.owner if held is not None else None

        def done(result: Any) -> None:
            if isinstance(result, BaseException):
                log.warning("the cluster did not take call %s at epoch %d: %s", call_id,
                            epoch, result)
                then(f"{type(result).__name__}: {result}")
            elif result is None:
                self.moved += 1
                self._owners.pop(call_id, None)
                then(False)
            else:
                self._owners[call_id] = result
                then(True)
        self.bridge.submit(take(), done)

    def forget(self, call_id: str) -> None:
        self._owners.pop(call_id, None)

    def stats(self) -> dict[str, Any]:
        return {"host": self.settings.host, "accepted": self.accepted, "moved": self.moved,
                "owned": len(self._owners)}

    def close(self) -> None:
        self.bridge.close()
