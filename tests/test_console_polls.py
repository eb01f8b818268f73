"""The console's shared polls (gateway/console_polls.py): however many pages
watch one question, the daemon is asked it once per interval; a page gets
the latest answer when it joins and each changed answer after; a question
nobody watches is no longer asked. Pure asyncio: the asks are counted
functions; every wait has a timeout."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from streamfence.gateway.console_polls import Polls

INTERVAL_S = 0.005
WAIT_S = 10.0


class Asked:
    """An ask that answers `answers(n)` for its n-th call (from 1), counted."""

    def __init__(self, answers: Any = lambda n: n) -> None:
        self.n = 0
        self._answers = answers
        self.reached = asyncio.Event()
        self.target = 0

    async def __call__(self) -> Any:
        self.n += 1
        if self.n >= self.target > 0:
            self.reached.set()
        answer = self._answers(self.n)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def until(self, n: int) -> None:
        self.target = n
        if self.n < n:
            await asyncio.wait_for(self.reached.wait(), WAIT_S)


async def _take(answers: AsyncGenerator[Any, None], n: int) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(WAIT_S):
        async for answer in answers:
            out.append(answer)
            if len(out) == n:
                break
    return out


def test_pages_watching_one_question_share_its_asks() -> None:
    async def main() -> None:
        polls, asked = Polls(), Asked()
        async with aclosing(polls.watch("q", asked, INTERVAL_S)) as a, \
                aclosing(polls.watch("q", asked, INTERVAL_S)) as b:
            seen_a, seen_b = await asyncio.gather(_take(a, 5), _take(b, 5))
            assert len(polls) == 1
            # b joined before the first answer: both saw the same answers, each asked once
            assert seen_a == seen_b == [1, 2, 3, 4, 5], (seen_a, seen_b)
            assert asked.n <= 6, f"{asked.n} asks for 5 answers to two pages"
            late = polls.watch("q", asked, INTERVAL_S)
            first = (await _take(late, 1))[0]
            await late.aclose()
            assert first > 5, f"a page joining late got an old answer first: {first}"
        assert len(polls) == 0, "a question nobody watches is still asked"
        stopped_at = asked.n
        await asyncio.sleep(INTERVAL_S * 20)  # a window for an ask that should not come
        assert asked.n == stopped_at
    asyncio.run(main())


def test_a_page_joining_has_the_question_asked_again_at_once() -> None:
    """A page was rendered just now: the poll's last answer may be older, so a
    join asks at once instead of at the next interval (an hour here)."""
    async def main() -> None:
        polls, asked = Polls(), Asked()
        async with aclosing(polls.watch("q", asked, 3600.0)) as first:
            assert await _take(first, 1) == [1]
            async with aclosing(polls.watch("q", asked, 3600.0)) as joined:
                assert await _take(joined, 1) == [2]
            assert await _take(first, 1) == [2]
        same = Asked(lambda n: "unchanged")
        async with aclosing(polls.watch("s", same, 3600.0)) as first:
            assert await _take(first, 1) == ["unchanged"]
            async with aclosing(polls.watch("s", same, 3600.0)) as joined:
                # the joining page gets the fresh answer though it did not change
                assert await _take(joined, 1) == ["unchanged"]
            assert same.n == 2
    asyncio.run(main())


def test_two_questions_are_asked_apart() -> None:
    async def main() -> None:
        polls, one, other = Polls(), Asked(), Asked(lambda n: -n)
        async with aclosing(polls.watch(("alice", "calls"), one, INTERVAL_S)) as a, \
                aclosing(polls.watch(("bob", "calls"), other, INTERVAL_S)) as b:
            assert await _take(a, 2) == [1, 2]
            assert await _take(b, 2) == [-1, -2]
            assert len(polls) == 2
    asyncio.run(main())


def test_an_answer_that_did_not_change_is_not_sent_again_and_failures_are_answers() -> None:
    async def main() -> None:
        polls = Polls()
        asked = Asked(lambda n: "same" if n < 10 else TimeoutError("no answer") if n < 20
                      else "back")
        async with aclosing(polls.watch("q", asked, INTERVAL_S)) as answers:
            got = await _take(answers, 3)
            assert got[0] == "same" and isinstance(got[1], TimeoutError) and got[2] == "back", \
                got
            assert asked.n >= 20
        await polls.close()
    asyncio.run(main())
