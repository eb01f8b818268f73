"""The worker pool's policy, with a fake clock and fake sockets: every fork a
target needs asked for at once (or, with `refill_wait_s`, the spares only
once the starting attempts have their first chunk, or after
REFILL_WAIT_S), spares that follow the recent peak of the load
and decay back to `spare`, retirement of the idle surplus (only once idle for
a while), the bounds (`max_workers`, the liveness slots), which idle worker an
attempt gets, and a replacement forked at the kill of a fenced attempt's
worker."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from streamfence.protocol.internal.workers import (
    AttemptSettings,
    RunAttempt,
    SpawnWorker,
    ZygoteCommand,
    drop_frame,
    encode_run,
    go_frame,
    parse_run,
)
from streamfence.protocol.states import WorkerState
from streamfence.supervisor.pool import PREPARE_AHEAD, REFILL_POLL_S, REFILL_WAIT_S, Pool
from streamfence.supervisor.worker_states import Worker
from streamfence.workers.liveness import LivenessTable
from tests.fakes import Clock

HALF_LIFE_S = 30.0
RETIRE_AFTER_S = 10.0


class FakeSocket:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, parts: list[bytes]) -> None:
        self.sent.append(parts)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        raise zmq.Again()


class Harness:
    def __init__(self, tmp_path: Path, spare: int = 2, max_workers: int = 16,
                 slots: int | None = None, refill_wait_s: float = 0.0) -> None:
        self.clock = Clock()
        self.spawns: list[ZygoteCommand] = []
        self.live = LivenessTable(str(tmp_path / "live.bin"), slots or max_workers, create=True)
        self.pool = Pool(self.spawns.append, FakeSocket(), self.live,  # type: ignore[arg-type]
                         slots=slots or max_workers, spare=spare, max_workers=max_workers,
                         clock=self.clock, peak_half_life_s=HALF_LIFE_S,
                         retire_after_s=RETIRE_AFTER_S, refill_wait_s=refill_wait_s)
        self.token = 0

    def up(self) -> list[Worker]:
        """Every spawn asked for so far says hello (pid 0: a kill is never sent)."""
        up = []
        for cmd in self.spawns:
            assert isinstance(cmd, SpawnWorker)
            worker = self.pool.get(cmd.worker_id)
            if worker is not None and worker.state is WorkerState.SPAWNING:
                self.pool.on_spawned(cmd.worker_id, 0)
                assert self.pool.on_hello(cmd.worker_id, 0) is worker
                up.append(worker)
        return up

    def run(self, n: int) -> list[Worker]:
        """Reserve, prepare and start `n` attempts on idle workers."""
        busy = []
        for _ in range(n):
            self.token += 1
            worker = self.pool.reserve(f"c{self.token}", 1, self.token)
            assert worker is not None
            run = RunAttempt(self.token, f"c{self.token}", 1, "-", {}, {}, AttemptSettings())
            self.pool.prepare(worker, run)
            assert self.pool.go(worker)
            busy.append(worker)
        return busy

    def first_chunk(self, workers: list[Worker]) -> None:
        """Each worker's attempt got its first chunk (as the worker writes its row)."""
        for worker in workers:
            self.live.begin(worker.slot, worker.token)
            self.live.touch(worker.slot, 10)

    def idle(self, workers: list[Worker]) -> None:
        for worker in workers:
            assert self.pool.on_idle(worker.worker_id) is worker

    def exited(self, workers: list[Worker]) -> None:
        for worker in workers:
            assert self.pool.on_exited(worker.worker_id, worker.pid, -9) is worker

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.pool.workers.values():
            out[w.state.value] = out.get(w.state.value, 0) + 1
        return out


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.live.close()


def test_start_forks_the_spares(h: Harness) -> None:
    h.pool.maintain()
    assert len(h.spawns) == 2 and h.pool.target() == 2
    h.pool.maintain()  # forks in flight count: nothing more
    assert len(h.spawns) == 2
    h.up()
    assert h.states() == {"idle": 2}


def test_demand_asks_for_every_fork_at_once(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    h.run(2)  # the two spares take the first two calls of a burst of 12
    h.pool.maintain(demand=10)
    # one maintain: the 10 queued calls plus 2 spares, all asked for now
    assert len(h.spawns) == 2 + 12
    assert h.pool.target() == 2 + 10 + 2
    # the forks for waiting calls first, cold; the spares warm up after their hello
    assert [c.warm for c in h.spawns if isinstance(c, SpawnWorker)] == [True] * 2 + [False] * 10 + [True] * 2


def test_next_due_only_while_the_pool_is_above_its_floor(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    assert h.pool.next_due() is None, "an idle pool at its floor never needs to wake"
    h.pool.maintain(demand=6)
    h.up()
    h.pool.maintain(demand=0)  # the burst went away before it ran: 8 idle, floor 2
    due = h.pool.next_due()
    assert due is not None and due >= h.clock.now + RETIRE_AFTER_S - 1e-9
    h.clock.now += 600.0  # the peak decays, the surplus retires
    h.pool.maintain()
    assert h.pool.next_due() is None and h.pool.retired_total == 6


def test_spares_follow_the_peak_then_decay_back_to_spare(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    h.pool.maintain(demand=8)
    h.up()
    busy = h.run(8)
    h.pool.maintain(demand=0)
    h.up()
    assert h.states() == {"busy": 8, "idle": 2}
    h.idle(busy)  # the burst is over
    h.pool.maintain(demand=0)
    assert h.states() == {"idle": 10}, "the peak keeps its workers ready"
    assert h.pool.target() == 8 + 2
    h.clock.now += HALF_LIFE_S  # the peak halves: 8 -> 4
    h.pool.maintain()
    assert h.pool.target() == 4 + 2 and h.states() == {"idle": 6, "killing": 4}
    assert h.pool.retired_total == 4 and h.pool.killed_total == 0
    h.exited([w for w in h.pool.workers.values() if w.state is WorkerState.KILLING])
    h.clock.now += 10 * HALF_LIFE_S
    h.pool.maintain()
    assert h.pool.target() == 2 and h.states() == {"idle": 2, "killing": 4}


def test_the_same_burst_again_finds_its_workers_ready(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_workers=64)
    h.pool.maintain()
    h.up()
    h.pool.maintain(demand=30)
    h.up()
    busy = h.run(32)
    h.pool.maintain(demand=0)
    h.up()
    h.idle(busy)
    forks = len(h.spawns)
    h.clock.now += 20.0
    h.pool.maintain(demand=0)
    # 32 * 0.5 ** (20 / 30) = 20.2: 20 + 2 spares kept, 12 retired
    assert h.pool.count(WorkerState.IDLE) == 22 and h.pool.retired_total == 12
    h.run(22)  # the next burst's first 22 calls need no fork
    h.pool.maintain(demand=10)
    assert len(h.spawns) == forks + 10 + 2  # its last ones and the spares: forked at once
    h.live.close()


def test_busy_workers_are_never_retired_and_a_lower_peak_keeps_spare(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    h.pool.maintain(demand=3)
    h.up()
    busy = h.run(5)
    h.clock.now += 100 * HALF_LIFE_S
    h.pool.maintain(demand=0)
    h.up()
    assert h.states() == {"busy": 5, "idle": 2}  # load 5 + spare 2
    h.idle(busy[:1])
    h.pool.maintain(demand=0)  # 4 busy + 2 spares wanted, but the peak is 5 for now
    assert h.states() == {"busy": 4, "idle": 3}
    h.clock.now += 100 * HALF_LIFE_S
    h.pool.maintain(demand=0)  # the surplus idle one goes; no busy one ever does
    assert h.states() == {"busy": 4, "idle": 2, "killing": 1}


def test_a_short_dip_of_the_load_retires_nothing(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    h.clock.now += 100 * HALF_LIFE_S
    h.pool.maintain(demand=1)  # one call: its worker and a spare beyond the two
    h.up()
    (worker,) = h.run(1)
    h.idle([worker])
    h.clock.now += 100 * HALF_LIFE_S
    h.pool.maintain(demand=0)  # the peak is gone, but one worker was idle just now
    assert h.states() == {"idle": 2, "killing": 1}
    assert worker.state is WorkerState.IDLE


def test_max_workers_bounds_forks_and_target(tmp_path: Path) -> None:
    h = Harness(tmp_path, spare=2, max_workers=6, slots=8)
    h.pool.maintain(demand=20)
    assert len(h.spawns) == 6 and h.pool.target() == 6
    h.up()
    busy = h.run(6)
    h.pool.kill(busy[0])  # killing, not yet reaped: still holds its place
    h.pool.maintain(demand=20)
    assert len(h.spawns) == 6 and h.pool.live() == 6
    h.exited(busy[:1])
    h.pool.maintain(demand=20)
    assert len(h.spawns) == 7 and h.pool.live() == 6
    h.live.close()


def test_liveness_slots_bound_forks(tmp_path: Path) -> None:
    h = Harness(tmp_path, spare=2, max_workers=16, slots=4)
    h.pool.maintain(demand=10)
    assert len(h.spawns) == 4 and sorted(c.slot for c in h.spawns  # type: ignore[union-attr]
                                        ) == [0, 1, 2, 3]
    h.live.close()


def test_reserve_prefers_the_last_used_worker_then_the_oldest_new_one(h: Harness) -> None:
    h.pool.maintain(demand=2)
    first, second, third, _fourth = h.up()
    a, b = h.run(2)
    assert (a, b) == (first, second)  # new workers: the longest idle first
    h.idle([b, a])  # a is the most recently idle of the used ones
    assert h.run(1) == [a]
    assert h.run(1) == [b]
    assert h.run(1) == [third]


def test_retire_takes_new_workers_before_used_ones_and_kills_them(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    h.pool.maintain(demand=4)
    workers = h.up()
    for i, worker in enumerate(workers):
        worker.pid = 100 + i
    used = h.run(2)  # workers 1 and 2 (the longest idle new ones)
    h.idle(used)
    h.clock.now += 100 * HALF_LIFE_S
    h.pool.maintain(demand=0)
    # 6 idle, 2 wanted: the 4 new ones go first, then none of the used ones
    assert sorted(w.worker_id for w in h.pool.workers.values()
                  if w.state is WorkerState.KILLING) == [3, 4, 5, 6]
    assert [w.state for w in used] == [WorkerState.IDLE, WorkerState.IDLE]
    assert killed == [(102, signal.SIGKILL), (103, signal.SIGKILL), (104, signal.SIGKILL),
                      (105, signal.SIGKILL)]


def test_a_fenced_kill_forks_its_replacement_at_once(h: Harness) -> None:
    h.pool.maintain()
    h.up()
    (worker,) = h.run(1)
    h.pool.maintain(demand=0)
    h.up()
    h.clock.now += 100 * HALF_LIFE_S  # no peak left: only the load counts
    before = len(h.spawns)
    h.pool.kill(worker)  # fenced: its call will retry
    h.pool.maintain(demand=0)
    assert len(h.spawns) == before + 1
    h.exited([worker])
    h.up()
    h.clock.now += 1.0  # the retry's backoff: its worker is not retired meanwhile
    h.pool.maintain(demand=0)
    assert h.states() == {"idle": 3}
    h.clock.now += HALF_LIFE_S
    h.pool.maintain(demand=0)  # no retry came: back to the spares
    assert h.states() == {"idle": 2, "killing": 1}


def test_status_counts_and_snapshot(h: Harness) -> None:
    h.pool.maintain(demand=1)
    h.up()
    h.run(1)
    assert h.pool.count(WorkerState.BUSY) == 1 and h.pool.count(WorkerState.IDLE) == 2
    snap: list[dict[str, Any]] = h.pool.snapshot()
    assert [w["state"] for w in snap] == ["busy", "idle", "idle"]


def _warm(spawns: list[ZygoteCommand]) -> list[bool]:
    return [c.warm for c in spawns if isinstance(c, SpawnWorker)]


def test_spares_wait_until_the_starting_attempts_have_their_first_chunk(tmp_path: Path) -> None:
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    h.pool.maintain()
    assert _warm(h.spawns) == [True, True], "an idle pool forks its spares at once"
    h.up()
    busy = h.run(2)  # a burst of 5: two calls take the spares, three wait
    h.pool.maintain(demand=3)
    assert _warm(h.spawns) == [True, True, False, False, False], \
        "the waiting calls' forks go at once, the spares wait"
    assert h.pool.refills_deferred == 1
    due = h.pool.next_due()
    assert due is not None and due < h.clock.now + REFILL_WAIT_S
    cold = h.up()
    busy += h.run(3)
    h.pool.maintain(demand=0)
    h.first_chunk(busy[:4])
    h.pool.maintain(demand=0)
    assert len(h.spawns) == 5, "one attempt still waits for its first chunk"
    h.first_chunk(busy[4:])
    h.pool.maintain(demand=0)
    assert _warm(h.spawns)[5:] == [True, True] and len(cold) == 3
    assert h.pool.next_due() is None or h.pool.next_due() >= h.clock.now + 1.0  # type: ignore[operator]
    h.live.close()


def test_spares_wait_at_most_refill_wait_max(tmp_path: Path) -> None:
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    h.pool.maintain()
    h.up()
    h.run(1)  # its first chunk never comes (a reasoning model thinking)
    h.pool.maintain(demand=0)
    assert len(h.spawns) == 2
    h.clock.now += REFILL_WAIT_S
    h.pool.maintain(demand=0)
    assert _warm(h.spawns) == [True, True, True]
    h.live.close()


def test_a_fenced_attempts_replacement_waits_for_the_retrys_first_chunk(
        tmp_path: Path) -> None:
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    h.pool.maintain()
    h.up()
    (worker,) = h.run(1)
    h.first_chunk([worker])
    h.pool.maintain(demand=0)
    h.up()
    h.clock.now += 100 * HALF_LIFE_S
    forks = len(h.spawns)
    h.pool.kill(worker)  # fenced: its call retries on a spare
    h.pool.maintain(demand=0)
    assert len(h.spawns) == forks, "no fork while the killed worker's call is to retry"
    h.exited([worker])
    (retry,) = h.run(1)
    h.pool.maintain(demand=0)
    assert len(h.spawns) == forks, "nor while the retry awaits its first chunk"
    h.first_chunk([retry])
    h.pool.maintain(demand=0)
    assert len(h.spawns) > forks
    h.live.close()


def _signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def _one_running(h: Harness) -> Worker:
    """An attempt running on a worker with a pid (the signals to it are recorded)."""
    h.pool.maintain()
    h.up()
    (worker,) = h.run(1)
    worker.pid = 4242
    return worker


def test_a_stale_attempts_worker_is_stopped_at_once_and_killed_once_its_retry_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _signals(monkeypatch)
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    worker = _one_running(h)
    h.pool.kill(worker, stalled=True)  # the sink acknowledged its stale attempt's fence
    assert sent == [(4242, signal.SIGSTOP)]
    h.pool.maintain(demand=0)
    assert sent == [(4242, signal.SIGSTOP)], "not killed in the turn that fenced it"
    due = h.pool.next_due()
    assert due is not None and due <= h.clock.now + REFILL_POLL_S
    (retry,) = h.run(1)  # the retry, on a spare
    h.clock.now += REFILL_POLL_S
    h.pool.maintain(demand=0)
    assert sent == [(4242, signal.SIGSTOP)], "nor while the retry awaits its first chunk"
    h.first_chunk([retry])
    h.pool.maintain(demand=0)
    assert sent == [(4242, signal.SIGSTOP), (4242, signal.SIGKILL)]
    h.pool.maintain(demand=0)
    assert len(sent) == 2, "killed once"
    h.exited([worker])
    h.live.close()


def test_a_stopped_worker_is_killed_within_refill_wait_whatever_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _signals(monkeypatch)
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    worker = _one_running(h)
    h.pool.kill(worker, stalled=True)
    h.run(1)  # an attempt whose first chunk never comes
    h.clock.now += REFILL_WAIT_S - REFILL_POLL_S
    h.pool.maintain(demand=0)
    assert sent == [(4242, signal.SIGSTOP)]
    assert h.pool.next_due() == pytest.approx(h.clock.now + REFILL_POLL_S)
    h.clock.now += REFILL_POLL_S
    h.pool.maintain(demand=0)
    assert sent[-1] == (4242, signal.SIGKILL)
    h.live.close()


def test_without_a_refill_wait_a_fenced_worker_is_killed_at_once(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _signals(monkeypatch)
    worker = _one_running(h)
    h.pool.kill(worker, stalled=True)
    assert sent == [(4242, signal.SIGKILL)]


def test_a_worker_whose_stream_may_still_send_is_killed_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel's or a deadline's fence: the provider may still be sending
    (and billing), so its connection is closed now, refill wait or not."""
    sent = _signals(monkeypatch)
    h = Harness(tmp_path, refill_wait_s=REFILL_WAIT_S)
    worker = _one_running(h)
    h.pool.kill(worker)
    assert sent == [(4242, signal.SIGKILL)]
    h.live.close()


def test_at_most_prepare_ahead_attempts_prepare_while_authorized(tmp_path: Path) -> None:
    """The first PREPARE_AHEAD reserved workers get their W_RUN at once; the
    rest get it just before their W_GO; a released prepared worker is told
    W_DROP and frees its place, a held one is told nothing."""
    h = Harness(tmp_path, spare=5)
    h.pool.maintain()
    workers = h.up()
    socket = h.pool.socket
    assert isinstance(socket, FakeSocket)
    sent = socket.sent
    runs = {}
    for n, worker in enumerate(workers[:PREPARE_AHEAD + 2], start=1):
        assert h.pool.reserve(f"c{n}", 1, n) is worker
        runs[n] = RunAttempt(n, f"c{n}", 1, "-", {}, {}, AttemptSettings())
        h.pool.prepare(worker, runs[n])
    assert [parse_run(frame).token for _, frame in sent] == list(range(1, PREPARE_AHEAD + 1))
    sent.clear()
    last = PREPARE_AHEAD + 2
    assert h.pool.go(workers[last - 1])  # a held one: its W_RUN, then its W_GO
    assert [frame for _, frame in sent] == [encode_run(runs[last]), go_frame(last)]
    sent.clear()
    h.pool.release(workers[0])  # prepared: dropped, and its place is free again
    h.pool.release(workers[last - 2])  # held: nothing was sent
    assert [frame for _, frame in sent] == [drop_frame(1)]
    sent.clear()
    again = h.pool.reserve("c9", 1, 9)
    assert again is not None
    h.pool.prepare(again, RunAttempt(9, "c9", 1, "-", {}, {}, AttemptSettings()))
    assert [parse_run(frame).token for _, frame in sent] == [9]
