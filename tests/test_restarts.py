"""The restart policy of the sink and the zygote (supervisor/restarts.py,
docs/ARCHITECTURE.md §4.14), on a fake clock: back-off that grows and starts
over, when the daemon gives up, and the log's rate limit."""

from __future__ import annotations

import logging
import signal

import pytest

from streamfence.protocol.lifecycle import ExitCode
from streamfence.supervisor.restarts import (
    FIRST_DELAY_S,
    LOG_EVERY_S,
    MAX_DELAY_S,
    STABLE_AFTER_S,
    START_FAILURES_MAX,
    GiveUp,
    Restart,
    RestartPolicy,
)
from tests.fakes import Clock

KILLED = -signal.SIGKILL


def _served(policy: RestartPolicy, clock: Clock, up_s: float) -> None:
    """The child starts, serves, and lives `up_s` seconds."""
    assert policy.take_due(clock.now) or policy.due() is None
    policy.started()
    policy.ready()
    clock.now += up_s


def _restart(policy: RestartPolicy, clock: Clock, code: int) -> Restart:
    decision = policy.died(code)
    assert isinstance(decision, Restart), decision
    assert policy.down and policy.due() == decision.at == clock.now + decision.delay_s
    clock.now = decision.at
    return decision


def test_deaths_after_serving_back_off_to_the_cap_and_never_give_up() -> None:
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    delays = []
    for _ in range(20):  # far more than the 5 deaths a minute that once stopped the daemon
        _served(policy, clock, 2.0)
        delays.append(_restart(policy, clock, KILLED).delay_s)
    assert delays[:8] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, MAX_DELAY_S]
    assert delays[8:] == [MAX_DELAY_S] * 12


def test_the_back_off_starts_over_once_the_child_stayed_up() -> None:
    clock = Clock()
    policy = RestartPolicy("zygote", clock)
    for _ in range(5):
        _served(policy, clock, 1.0)
        _restart(policy, clock, 1)
    _served(policy, clock, STABLE_AFTER_S + 0.1)
    assert _restart(policy, clock, 1).delay_s == FIRST_DELAY_S


def test_the_restart_is_due_only_after_its_delay() -> None:
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    _served(policy, clock, 5.0)
    policy.died(KILLED)
    assert policy.down and not policy.serving
    assert not policy.take_due(clock.now + FIRST_DELAY_S / 2)
    assert policy.take_due(clock.now + FIRST_DELAY_S)
    assert not policy.down and policy.due() is None
    assert not policy.take_due(clock.now + 10.0)  # taken once


def test_a_fatal_exit_code_gives_up_at_once_with_its_reason() -> None:
    clock = Clock()
    policy = RestartPolicy("sink", clock, {ExitCode.CANNOT_BIND: "port taken"})
    _served(policy, clock, 100.0)
    decision = policy.died(ExitCode.CANNOT_BIND)
    assert decision == GiveUp("the sink cannot start: port taken")
    assert not policy.down


def test_exits_before_serving_in_a_row_give_up() -> None:
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    for _ in range(START_FAILURES_MAX - 1):
        policy.started()
        clock.now += 0.3
        _restart(policy, clock, 1)
    policy.started()
    decision = policy.died(1)
    assert isinstance(decision, GiveUp)
    assert decision.reason == (f"the sink cannot start: it exited before it was ready "
                               f"{START_FAILURES_MAX} times in a row (last: 1)")


def test_serving_once_resets_the_count_of_failures_to_start() -> None:
    clock = Clock()
    policy = RestartPolicy("zygote", clock)
    for _ in range(START_FAILURES_MAX - 1):
        policy.started()
        _restart(policy, clock, ExitCode.BOOT_FAILED)
    _served(policy, clock, 1.0)
    for _ in range(START_FAILURES_MAX - 1):
        _restart(policy, clock, ExitCode.BOOT_FAILED)
        policy.started()


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_kills_before_serving_are_not_failures_to_start(signum: int) -> None:
    """An operator's or the OOM killer's kill says nothing of whether it can start."""
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    for _ in range(START_FAILURES_MAX * 3):
        policy.started()
        _restart(policy, clock, -signum)


def test_a_crash_before_serving_is_a_failure_to_start() -> None:
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    for _ in range(START_FAILURES_MAX - 1):
        policy.started()
        _restart(policy, clock, -signal.SIGSEGV)
    policy.started()
    assert isinstance(policy.died(-signal.SIGSEGV), GiveUp)


def test_each_restart_is_logged_once_with_its_delay_and_at_the_cap_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "streamfence.supervisor")
    clock = Clock()
    policy = RestartPolicy("sink", clock)
    for _ in range(8):  # delays 0.1 … 6.4, then the first at the cap
        _served(policy, clock, 1.0)
        _restart(policy, clock, KILLED)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 8
    assert lines[0] == ("the sink exited with -9 (signal SIGKILL) after 1.0s; restarting it "
                        "in 0.1s")
    assert lines[-1].endswith(f"restarting it in {MAX_DELAY_S:.1f}s")
    caplog.clear()
    # At the cap: 11 s per death (1 s up, 10 s down), so 5 deaths fit in the next minute.
    deaths = 0
    while not caplog.records:
        _served(policy, clock, 1.0)
        _restart(policy, clock, KILLED)
        deaths += 1
    assert deaths * (1.0 + MAX_DELAY_S) >= LOG_EVERY_S
    assert caplog.records[0].getMessage().endswith(
        f"restarting it in {MAX_DELAY_S:.1f}s; {deaths - 1} more restart(s) since the last line")


def test_a_child_not_yet_ready_is_said_so() -> None:
    clock = Clock()
    policy = RestartPolicy("zygote", clock)
    policy.started()
    clock.now += 0.5
    assert not policy.serving
    decision = policy.died(KILLED)
    assert isinstance(decision, Restart) and decision.delay_s == FIRST_DELAY_S


def test_a_child_that_dies_while_the_daemon_stops_is_no_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stop signal sent to the whole process group stops the children too
    (the zygote dies of SIGTERM, the sink exits 0): said at INFO, still
    restarted (the sink stores the drained calls' ends)."""
    caplog.set_level(logging.INFO, "streamfence.supervisor")
    clock = Clock()
    deaths = (("zygote", -signal.SIGTERM, "-15 (signal SIGTERM)"), ("sink", 0, "0 (OK)"))
    for name, code, _ in deaths:
        policy = RestartPolicy(name, clock)
        _served(policy, clock, 2.0)
        assert isinstance(policy.died(code, stopping=True), Restart)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"the {name} exited with {said} after 2.0s while the daemon stops; "
                 "restarting it in 0.1s") for name, _, said in deaths]
