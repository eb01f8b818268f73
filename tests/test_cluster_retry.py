"""Cluster mode's retry helper (streamfence/cluster/retry.py), run to its end
on a fake clock whose only way forward is the helper's own sleeps: which
failures are tried again, the waits between tries, and when it gives up.
The named policies keep the timings of the loops they replaced."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import pytest
from nats.js.errors import BadRequestError

from streamfence.cluster.ledger import (
    APPEND_IN_FLIGHT,
    CONNECTING,
    ELECTING,
    EPOCH_RACED,
    IN_FLIGHT,
    NO_STREAM,
    WRONG_LAST_SEQUENCE,
)
from streamfence.cluster.retry import RetryPolicy, TryAgain, retry_async
from streamfence.supervisor.clusterlink import ACCEPTING, CANCEL_MOVED, ENTRY_RACED


class FakeTime:
    """A clock that moves only when slept on (and by `tick` per try)."""

    def __init__(self, tick_s: float = 0.0) -> None:
        self.now = 100.0
        self.tick_s = tick_s  # what each try costs
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, wait_s: float) -> None:
        self.slept.append(wait_s)
        self.now += wait_s

    async def sleep_async(self, wait_s: float) -> None:
        self.sleep(wait_s)


class Failing:
    """An operation that fails with `failures` in turn, then returns "done"."""

    def __init__(self, time: FakeTime, failures: list[BaseException]) -> None:
        self.time = time
        self.failures = failures
        self.tries = 0

    def __call__(self) -> str:
        self.tries += 1
        self.time.now += self.time.tick_s
        if self.failures:
            raise self.failures.pop(0)
        return "done"

    async def async_call(self) -> str:
        return self()


def _async(policy: RetryPolicy, op: Failing, **kw: Callable[..., None]) -> str:
    return asyncio.run(retry_async(policy, op.async_call, clock=op.time.clock,
                                   sleep=op.time.sleep_async, **kw))


def _waits(policy: RetryPolicy, n: int) -> list[float]:
    out, wait = [], None
    for _ in range(n):
        wait = policy.next_wait(wait)
        out.append(round(wait, 6))
    return out


def test_a_first_try_that_succeeds_neither_sleeps_nor_tries_again() -> None:
    op = Failing(FakeTime(), [])
    assert _async(RetryPolicy((OSError,), first_s=1.0, tries=3), op) == "done"
    assert op.tries == 1 and op.time.slept == []


def test_the_waits_double_up_to_the_cap_until_a_try_succeeds() -> None:
    op = Failing(FakeTime(), [OSError("down")] * 7)
    policy = RetryPolicy((OSError,), first_s=0.05, factor=2.0, cap_s=1.0, budget_s=60.0)
    assert _async(policy, op) == "done"
    assert op.tries == 8
    assert [round(w, 6) for w in op.time.slept] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_out_of_tries_the_last_failure_is_raised_as_it_was() -> None:
    failures: list[BaseException] = [OSError(f"try {n}") for n in range(1, 6)]
    last = failures[-1]
    op = Failing(FakeTime(), failures)
    with pytest.raises(OSError) as raised:
        _async(RetryPolicy((OSError,), first_s=0.005, step_s=0.005, tries=5), op)
    assert raised.value is last
    assert op.tries == 5
    assert [round(w, 6) for w in op.time.slept] == [0.005, 0.01, 0.015, 0.02]


def test_the_budget_counts_the_tries_too_and_lets_a_begun_try_end() -> None:
    """1 s a try plus 1 s a wait: the budget of 4.5 s has passed after the
    third try (5 s in), which is the last; a try begun at 4 s is not cut."""
    op = Failing(FakeTime(tick_s=1.0), [TimeoutError()] * 10)
    with pytest.raises(TimeoutError):
        _async(RetryPolicy((TimeoutError,), first_s=1.0, budget_s=4.5), op)
    assert op.tries == 3 and op.time.slept == [1.0, 1.0]


def test_a_failure_it_does_not_name_is_raised_at_once() -> None:
    op = Failing(FakeTime(), [ValueError("a bug")])
    with pytest.raises(ValueError):
        _async(RetryPolicy((OSError,), first_s=1.0, tries=9), op)
    assert op.tries == 1 and op.time.slept == []


def test_only_if_picks_among_the_named_failures() -> None:
    raced, other = OSError(11, "again"), OSError(2, "gone")
    op = Failing(FakeTime(), [raced, raced, other])
    with pytest.raises(OSError) as raised:
        _async(RetryPolicy((OSError,), tries=9, only_if=lambda e: getattr(e, "errno", 0) == 11), op)
    assert raised.value is other and op.tries == 3


def test_a_policy_without_waits_never_sleeps() -> None:
    op = Failing(FakeTime(), [TryAgain()] * 4)
    assert _async(RetryPolicy((TryAgain,), tries=5), op) == "done"
    assert op.tries == 5 and op.time.slept == []


def test_on_retry_hears_each_failure_and_wait_before_it_is_slept() -> None:
    heard: list[tuple[str, float, int]] = []
    op = Failing(FakeTime(), [OSError("a"), OSError("b"), OSError("c")])

    def on_retry(failure: BaseException, wait_s: float) -> None:
        heard.append((str(failure), wait_s, len(op.time.slept)))
    with pytest.raises(OSError):
        _async(RetryPolicy((OSError,), first_s=0.5, factor=2.0, tries=3), op,
              on_retry=on_retry)
    assert heard == [("a", 0.5, 0), ("b", 1.0, 1)]  # none at the give-up


@pytest.mark.parametrize("bad", [
    {"retry_on": ()}, {"first_s": -1.0}, {"factor": 0.5}, {"step_s": -0.1}, {"tries": 0},
])
def test_a_policy_that_makes_no_sense_is_refused(bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"retry_on": (OSError,), **bad}
    with pytest.raises(ValueError):
        RetryPolicy(**fields)  # type: ignore[arg-type]


def test_within_sets_the_budget_and_keeps_the_rest() -> None:
    policy = RetryPolicy((OSError,), first_s=0.2)
    assert policy.within(30.0).budget_s == 30.0 and policy.budget_s == math.inf
    assert policy.within(30.0).first_s == 0.2


def test_an_append_raced_by_one_in_flight_is_tried_again_a_refused_one_not() -> None:
    """An append raced by one still in flight (10164) is tried again; one
    refused for its sequence (10071) is not: it is fenced."""
    raced, refused = BadRequestError(err_code=IN_FLIGHT), BadRequestError(
        err_code=WRONG_LAST_SEQUENCE)
    op = Failing(FakeTime(), [raced, raced, refused])
    with pytest.raises(BadRequestError) as raised:
        _async(APPEND_IN_FLIGHT, op)
    assert raised.value is refused and op.tries == 3


@pytest.mark.parametrize(("policy", "waits", "tries", "budget_s"), [
    (CONNECTING, [0.2, 0.2, 0.2], None, math.inf),  # budget 6 × timeout_s, at use
    (ELECTING, [0.05, 0.05, 0.05], None, math.inf),  # 4 × timeout_s
    (NO_STREAM, [0.05, 0.05, 0.05], None, math.inf),  # 1 × timeout_s
    (APPEND_IN_FLIGHT, [0.005, 0.01, 0.015, 0.02], 5, math.inf),
    (EPOCH_RACED, [0.0, 0.0, 0.0], 20, math.inf),
    (ACCEPTING, [0.1, 0.1, 0.1], None, math.inf),  # 3 × timeout_s
    (ENTRY_RACED, [0.0, 0.0, 0.0], 5, math.inf),
    (CANCEL_MOVED, [0.0, 0.0, 0.0], 5, math.inf),
], ids=["CONNECTING", "ELECTING", "NO_STREAM", "APPEND_IN_FLIGHT", "EPOCH_RACED", "ACCEPTING",
         "ENTRY_RACED", "CANCEL_MOVED"])
def test_the_named_policies_keep_the_timings_of_the_loops_they_replaced(
        policy: RetryPolicy, waits: list[float], tries: int | None, budget_s: float) -> None:
    assert _waits(policy, len(waits)) == waits
    assert policy.tries == tries and policy.budget_s == budget_s
