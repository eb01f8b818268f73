"""Deadlines kept in a heap, so the supervisor's loop sleeps until the nearest
one instead of scanning every call on a fixed tick (docs/ARCHITECTURE.md §4.12)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """At most one deadline per key. Re-arming or clearing a key leaves its old
    heap entry behind; an entry is skipped when it surfaces if it is no longer
    the key's deadline (lazy deletion), and the heap is rebuilt when such
    leftovers outnumber the live entries."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._when: dict[K, float] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._when)

    def arm(self, key: K, when: float) -> None:
        """`key` is due at `when` (monotonic seconds), replacing any earlier arming."""
        self._when[key] = when
        heapq.heappush(self._heap, (when, next(self._order), key))
        if len(self._heap) > 2 * len(self._when) + 64:
            self._heap = [(w, next(self._order), k) for k, w in self._when.items()]
            heapq.heapify(self._heap)

    def clear(self, key: K) -> None:
        self._when.pop(key, None)

    def next_due(self) -> float | None:
        """The earliest deadline, or None if none is armed."""
        heap = self._heap
        while heap and self._when.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[K]:
        """The keys whose deadline is at or before `now`, earliest first; each is
        disarmed (the caller re-arms what should fire again)."""
        due: list[K] = []
        heap, when = self._heap, self._when
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            if when.get(key) == at:
                del when[key]
                due.append(key)
        return due
