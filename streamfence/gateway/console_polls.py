"""The console's questions to the daemon, shared (gateway/console.py): one
poll per distinct question, at most one ask per interval, however many open
pages watch it; a page joining has the question asked again at once and
gets that answer (its page was rendered just now: an answer from before
would set it back, and its stream shows it is live), then every changed
answer after. So the daemon's load from the console grows with the
distinct views open (an identity's list with its filters, one call, the
status), not with the viewers or their deltas.

A question is keyed by the viewing identity and what it asks: two viewers
of one identity see the same answers (the daemon scopes by identity), two
identities never share one. A poll stops when its last page goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable
from typing import Any

Ask = Callable[[], Awaitable[Any]]


class _Poll:
    """One question: its latest answer (or the exception that came instead),
    numbered by change; the asks started and the last answered; the task
    asking it; the pages watching it."""

    def __init__(self, ask: Ask, interval_s: float) -> None:
        self.answer: Any = None
        self.version = 0  # the answer's number: it grows when the answer changes
        self.started = 0  # asks started
        self.answered = 0  # the number (by start) of the last ask answered
        self.watchers = 0
        self.changed = asyncio.Condition()
        self.wake = asyncio.Event()  # a page joined: ask now
        self.task = asyncio.create_task(self._run(ask, interval_s))

    def newer_than(self, version: int) -> bool:
        return self.version != version

    def answered_from(self, ask: int) -> bool:
        return self.answered >= ask

    async def _run(self, ask: Ask, interval_s: float) -> None:
        while True:
            self.wake.clear()  # a page joining during the ask gets the next one
            self.started += 1
            number = self.started
            try:
                answer: Any = await ask()
            except Exception as exc:  # a page shows it as trouble; the poll goes on
                answer = exc
            async with self.changed:
                if self.version == 0 or not _same(answer, self.answer):
                    self.answer, self.version = answer, self.version + 1
                self.answered = number
                self.changed.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), interval_s)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, BaseException) or isinstance(b, BaseException):
        return type(a) is type(b) and str(a) == str(b)
    return bool(a == b)


class Polls:
    """Owns the polls in flight, by key."""

    def __init__(self) -> None:
        self._polls: dict[Hashable, _Poll] = {}

    def __len__(self) -> int:
        return len(self._polls)

    async def watch(self, key: Hashable, ask: Ask, interval_s: float
                    ) -> AsyncGenerator[Any, None]:
        """The answers to `key` (asked by `ask` when no page asks it yet): the
        answer to an ask started after the join, whether it changed or not,
        then each that differs from the one before; an exception the ask
        raised is yielded, not raised."""
        poll = self._polls.get(key)
        if poll is None:
            poll = self._polls[key] = _Poll(ask, interval_s)
        poll.wake.set()
        poll.watchers += 1
        fresh = poll.started + 1  # the ask the wake brings (after one in flight, if any)
        try:
            async with poll.changed:
                await poll.changed.wait_for(functools.partial(poll.answered_from, fresh))
                seen, answer = poll.version, poll.answer
            yield answer
            while True:
                async with poll.changed:
                    await poll.changed.wait_for(functools.partial(poll.newer_than, seen))
                    seen, answer = poll.version, poll.answer
                yield answer
        finally:
            poll.watchers -= 1
            if poll.watchers == 0:
                del self._polls[key]
                poll.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll.task

    async def close(self) -> None:
        for poll in self._polls.values():
            poll.task.cancel()
        await asyncio.gather(*(p.task for p in self._polls.values()), return_exceptions=True)
        self._polls.clear()
