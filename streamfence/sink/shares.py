"""Each identity's share of the events socket (docs/SECURITY.md, "Limits").

The supervisor names, with every subscribe, the identity it is charged to
and that identity's caps (`ListenerOwner` in C_SUBSCRIBE). A `Share` is one
identity's part: the bytes its listeners hold unacknowledged (kept by
sink/subscribers.py, on the hot path, against `IDENTITY_BYTES`), and the
calls each of its listeners was subscribed to, for the caps on listeners
and subscriptions (`admit`; past one: `too_many_subscriptions`, counted).
This is Redis's per-class `client-output-buffer-limit` and Kafka's
per-client quota, per identity: one identity's backlog never takes another's
room.

A listener is charged to the identity that subscribed it first, until it has
no subscription left. Subscriptions end in many places (a done, a cut-off,
a replay's end, a call evicted), so the records are not kept exact: the
ended ones are pruned when a cap is reached, and whenever the records have
doubled since the last prune (so they stay within twice the live ones),
with `active(listener, call_id)` (sink/replays.py's view of who follows
what).
"""

from __future__ import annotations

from collections.abc import Callable

from streamfence.protocol.internal.control import ListenerOwner

PRUNE_FLOOR = 64  # records an identity may gather before the first prune

Active = Callable[[bytes, str], bool]  # does this listener still follow this call?


class Share:
    """One identity's part: `out`, the bytes its listeners hold unacknowledged
    (sink/subscribers.py keeps it); `listeners`, each listener's calls (ended
    ones included until pruned); `records`, their number."""

    __slots__ = ("listeners", "name", "next_prune", "out", "records")

    def __init__(self, name: str) -> None:
        self.name = name
        self.out = 0
        self.listeners: dict[bytes, set[str]] = {}
        self.records = 0
        self.next_prune = PRUNE_FLOOR

    def prune(self, active: Active) -> list[bytes]:
        """Forget the subscriptions that ended; the listeners left with none
        are forgotten too, and returned."""
        records, gone = 0, []
        for listener in list(self.listeners):
            calls = {c for c in self.listeners[listener] if active(listener, c)}
            if calls:
                self.listeners[listener] = calls
                records += len(calls)
            else:
                del self.listeners[listener]
                gone.append(listener)
        self.records = records
        self.next_prune = max(PRUNE_FLOOR, 2 * records)
        return gone


class Shares:
    """Owns the Shares by identity name and which Share each listener is charged to."""

    def __init__(self) -> None:
        self.nobody = Share("")  # listeners no subscribe named (yet): `listen` replies, errors
        self._by_name: dict[str, Share] = {}
        self.of: dict[bytes, Share] = {}  # listener -> the Share it is charged to
        self.refused_listeners = 0
        self.refused_subscriptions = 0

    def admit(self, listener: bytes, call_id: str, owner: ListenerOwner,
              active: Active) -> str | None:
        """Record that `listener` follows `call_id` for `owner`: None, or why
        not (the `too_many_subscriptions` reason, counted). A listener already
        charged to another identity stays charged there (module docstring)."""
        share = self.of.get(listener)
        if share is None or listener not in share.listeners:
            share = self._by_name.get(owner.name)
            if share is None:
                share = self._by_name[owner.name] = Share(owner.name)
        calls = share.listeners.get(listener)
        if calls is not None and call_id in calls:
            return None  # a subscribe again: it replaces the one before
        if share.records >= share.next_prune:
            self._prune(share, active)
            calls = share.listeners.get(listener)
        cap = owner.max_listeners
        if calls is None and cap and len(share.listeners) >= cap:
            self._prune(share, active)
            if len(share.listeners) >= cap:
                self.refused_listeners += 1
                return (f"too_many_subscriptions: identity {owner.name!r} has {cap} listeners "
                        f"with subscriptions (max_listeners {cap}); close one, or raise "
                        f"[identities.{owner.name}] max_listeners")
        cap = owner.max_subscriptions
        if cap and share.records >= cap:
            self._prune(share, active)
            calls = share.listeners.get(listener)
            if share.records >= cap:
                self.refused_subscriptions += 1
                return (f"too_many_subscriptions: identity {owner.name!r} has {cap} "
                        f"subscriptions (max_subscriptions {cap}); wait for a call's done, "
                        f"or raise [identities.{owner.name}] max_subscriptions")
        if calls is None:
            calls = share.listeners[listener] = set()
        calls.add(call_id)
        share.records += 1
        self.of[listener] = share
        return None

    def _prune(self, share: Share, active: Active) -> None:
        for listener in share.prune(active):
            if self.of.get(listener) is share:
                del self.of[listener]

    def drop(self, listener: bytes) -> set[str]:
        """Forget every subscription of `listener` (its key was revoked): the
        calls it was recorded as following."""
        share = self.of.pop(listener, None)
        if share is None:
            return set()
        calls = share.listeners.pop(listener, set())
        share.records -= len(calls)
        return calls

    def stats(self) -> dict[str, int]:
        return {"events_refused.max_listeners": self.refused_listeners,
                "events_refused.max_subscriptions": self.refused_subscriptions,
                "events_identities": len(self._by_name)}
