"""Trying an operation again, under a named policy: the one way cluster mode
waits out a cluster that did not answer, or a race it lost (§4.17).

A `RetryPolicy` says which failures are worth another try and how long to
wait before each: `first_s`, then each wait times `factor` plus `step_s`, at
most `cap_s`. It gives up (the last failure is raised as it was) after
`tries` tries, or once `budget_s` has passed since the first try began (a
try already begun is not cut short: the last one may end past the budget).
A budget that scales with the cluster's `timeout_s` is set with `within()`
where the settings are known. Each policy is a constant named for the
situation it waits out, beside the code that uses it.

A try that fails without an exception of its own (a compare-and-set lost,
no leader yet, a host that no longer has the call) raises `TryAgain`; the
caller turns the last one into its own answer when the tries run out, so a
`TryAgain` never leaves the function that retries it.

`retry_async` takes the clock and the sleep, so a test runs
a policy to its end without waiting. A first try that succeeds costs a
call and a clock read (each of the ledger's appends goes through two).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

T = TypeVar("T")
OnRetry = Callable[[BaseException, float], None]  # the failure, the wait before the next try


class TryAgain(Exception):
    """A try's own verdict that it should be tried again (module docstring)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    retry_on: tuple[type[BaseException], ...]
    first_s: float = 0.0  # the wait before the second try
    factor: float = 1.0  # each later wait: the one before times this, plus step_s
    step_s: float = 0.0
    cap_s: float = math.inf  # no wait longer than this
    budget_s: float = math.inf  # no try begins once this has passed since the first
    tries: int | None = None  # no more tries than this
    only_if: Callable[[BaseException], bool] | None = None  # of the retry_on, which

    def __post_init__(self) -> None:
        if not self.retry_on:
            raise ValueError("a retry policy names the failures it retries")
        if min(self.first_s, self.step_s, self.cap_s, self.budget_s) < 0 or self.factor < 1:
            raise ValueError(f"a retry policy's waits only grow: {self}")
        if self.tries is not None and self.tries < 1:
            raise ValueError(f"a retry policy tries at least once: {self}")

    def within(self, budget_s: float) -> RetryPolicy:
        """This policy, giving up once `budget_s` has passed."""
        return replace(self, budget_s=budget_s)

    def next_wait(self, wait: float | None) -> float:
        """The wait after `wait` (None: the first)."""
        if wait is None:
            return min(self.first_s, self.cap_s)
        return min(wait * self.factor + self.step_s, self.cap_s)

    def gives_up(self, failure: BaseException, tries: int, elapsed_s: float) -> bool:
        """After `tries` tries that failed (the last with `failure`), `elapsed_s`
        since the first began: no more."""
        return ((self.only_if is not None and not self.only_if(failure))
                or (self.tries is not None and tries >= self.tries)
                or elapsed_s >= self.budget_s)


async def retry_async(policy: RetryPolicy, attempt: Callable[[], Awaitable[T]], *,
                      on_retry: OnRetry | None = None, clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> T:
    """`await attempt()`, tried again under `policy`; its result, or the last
    failure. `on_retry(failure, wait)` runs before each wait."""
    start, tries = clock(), 0
    wait: float | None = None
    while True:
        try:
            return await attempt()
        except policy.retry_on as failure:
            tries += 1
            if policy.gives_up(failure, tries, clock() - start):
                raise
            wait = policy.next_wait(wait)
            if on_retry is not None:
                on_retry(failure, wait)
            if wait > 0:
                await sleep(wait)
