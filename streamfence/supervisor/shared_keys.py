"""This host's part in the cluster's shared client identities (docs/SECURITY.md,
cluster/identities.py), run in the ledger's thread (cluster/bridge.py) so
that the supervisor's loop never waits on it:

- This host's own keys (its key store's `clients/*.key`, but for its own
  user's `local`) are published to `sf_identities` at the start, when the
  key store changes (a look every POLL_S: one stat) and every lease / 3.
- The other hosts' keys, read at each publish and followed as they change
  by a watch of the bucket, are handed to the key store (`KeyStore.share`),
  which the supervisor's authentication and the sink's read with the
  allow-list: a key added or revoked on another host is accepted or
  refused here from the next message, at no cost per message.
- Fail closed: with no good read of the bucket for a lease (the cluster
  unreachable, this host cut off or frozen), the other hosts' keys are
  refused until the next good read, so a revocation this host could not
  hear of still stops here within a lease. Its own keys are not affected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from streamfence.cluster.bridge import LedgerBridge
from streamfence.cluster.identities import Known, SharedKey
from streamfence.protocol.credentials import LOCAL_NAME
from streamfence.protocol.keys import KeyStore

log = logging.getLogger("streamfence.supervisor")
POLL_S = 0.25  # between two looks for a change of the key store (a stat)


class SharedKeys:
    """Owns this host's view of the bucket; touched by the ledger's thread only."""

    def __init__(self, store: KeyStore, bridge: LedgerBridge, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._bucket = bridge.ledger.identities
        self._lease_s = lease_s
        self._clock = clock
        self._own: dict[bytes, str] | None = None  # as last published
        self._known: Known = {}
        self._read_at: float | None = None  # when the last good read started
        self._shared: dict[bytes, str] | None = None  # as last handed to the key store
        self._fresh = False  # as at the last hand-over
        self._learnt = True  # `_known` changed since the last hand-over
        self._failing = False
        bridge.submit(self._run(), self._ended)

    async def _run(self) -> None:
        """Every POLL_S: a publish if one is due (on its own, so that a cluster
        slow to answer delays no hand-over), and the hand-over."""
        seen: Mapping[bytes, str] | None = None
        next_read = self._clock()
        publishing: asyncio.Task[None] | None = None
        while True:
            now = self._clock()
            allow_list = self._store.allow_list()
            idle = publishing is None or publishing.done()
            if idle and (allow_list is not seen or now >= next_read):
                seen = allow_list
                own = {key: name for key, name in self._store.local_keys().items()
                       if name != LOCAL_NAME}
                if own != self._own or now >= next_read:
                    next_read = now + self._lease_s / 3
                    publishing = asyncio.create_task(self._publish(own, now))
            self._hand_over(now)
            await asyncio.sleep(POLL_S)

    async def _publish(self, own: dict[bytes, str], now: float) -> None:
        try:
            if not self._bucket.watching:  # first (again): nothing stored meanwhile is missed
                await self._bucket.watch(self._changed)
            known = await self._bucket.publish(own)
        except Exception as exc:  # the cluster failed: tried again at the next look
            if not self._failing:
                log.warning("cluster: could not publish or read the shared identities (%s: "
                            "%s); trying again every %.1f s", type(exc).__name__, exc,
                            self._lease_s / 3)
            self._failing = True
            return
        if self._failing:
            log.info("cluster: the shared identities are read again")
        self._failing = False
        self._own, self._read_at = own, now
        for key, (revision, entry) in known.items():
            self._learn(key, revision, entry)

    def _changed(self, key: str, revision: int, entry: SharedKey | None) -> None:
        """From the watch: a key's new last word."""
        self._learn(key, revision, entry)
        self._hand_over(self._clock())

    def _learn(self, key: str, revision: int, entry: SharedKey | None) -> None:
        """An older word (a read that began before a change the watch brought)
        never undoes a newer one."""
        if revision >= self._known.get(key, (0, None))[0] \
                and self._known.get(key) != (revision, entry):
            self._known[key] = (revision, entry)
            self._learnt = True

    def _hand_over(self, now: float) -> None:
        """The other hosts' keys to the key store if they changed; none while
        the last good read is older than a lease (module docstring)."""
        fresh = self._read_at is not None and now - self._read_at < self._lease_s
        if fresh == self._fresh and not self._learnt:
            return
        shared = {entry.public_key: entry.name for _, entry in self._known.values()
                  if entry is not None and entry.host != self._bucket.host
                  and entry.name != LOCAL_NAME} if fresh else {}
        if shared != self._shared:
            if not fresh and self._shared:
                log.warning("cluster: no read of the shared identities for a lease (%g s): "
                            "the %d key(s) of other hosts are refused until the next",
                            self._lease_s, len(self._shared))
            self._store.share(shared)
            self._shared = shared
        self._fresh, self._learnt = fresh, False

    def _ended(self, result: Any) -> None:
        """In the supervisor's thread: `_run` ended (the bridge closed, or a fault
        here): the other hosts' keys are refused from now on (fail closed)."""
        if isinstance(result, BaseException) and not isinstance(result, (
                asyncio.CancelledError, concurrent.futures.CancelledError)):
            log.error("cluster: sharing the identities stopped (%s: %s); only this host's "
                      "own keys are accepted", type(result).__name__, result)
        self._store.forget_shared()
