"""The fence as a pure function: unit tests and property-based tests.

The property tests run random interleavings of authorize / fence / delta /
final / finish against an independent reference model written from the rule
itself ("accepted iff the attempt is the authorized, still-open epoch at that
moment and the seq is the next one"), and check that refused events never
change the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamfence.sink.fence import (
    AttemptState,
    AuthorizeRefusal,
    FenceTable,
    FinalVerdict,
    Verdict,
)

# ---- unit tests ------------------------------------------------------------------


def test_unknown_call_is_refused() -> None:
    t = FenceTable()
    assert t.check("c", 1, 1) is Verdict.UNKNOWN_CALL
    assert t.snapshot() == {}


def test_authorized_attempt_accepts_contiguous_seqs() -> None:
    t = FenceTable()
    assert t.authorize("c", 1) is None
    assert [t.check("c", 1, s) for s in (1, 2, 3)] == [Verdict.ACCEPT] * 3
    view = t.view("c")
    assert view is not None and view.last_seq == 3 and view.open


def test_an_attempt_that_continues_an_answer_starts_after_its_last_seq() -> None:
    """A rebind (ARCHITECTURE §2.8): attempt 2 writes on after attempt 1's seq 5."""
    t = FenceTable()
    assert t.authorize("c", 1) is None
    assert [t.check("c", 1, s) for s in range(1, 6)] == [Verdict.ACCEPT] * 5
    assert t.authorize("c", 2, after_seq=5) is None
    assert t.check("c", 2, 1) is Verdict.DUPLICATE
    assert t.check("c", 1, 6) is Verdict.STALE_ATTEMPT
    assert t.check("c", 2, 6) is Verdict.ACCEPT
    assert t.close_on_final("c", 2, 6) is FinalVerdict.ACCEPT


def test_gap_and_duplicate_are_refused_without_consuming() -> None:
    t = FenceTable()
    t.authorize("c", 1)
    assert t.check("c", 1, 1) is Verdict.ACCEPT
    before = t.snapshot()
    assert t.check("c", 1, 3) is Verdict.GAP
    assert t.check("c", 1, 1) is Verdict.DUPLICATE
    assert t.snapshot() == before
    assert t.check("c", 1, 2) is Verdict.ACCEPT


def test_new_epoch_supersedes_old_attempt() -> None:
    t = FenceTable()
    t.authorize("c", 1)
    assert t.check("c", 1, 1) is Verdict.ACCEPT
    assert t.authorize("c", 2) is None
    assert t.check("c", 1, 2) is Verdict.STALE_ATTEMPT
    assert t.check("c", 2, 1) is Verdict.ACCEPT  # seq restarts per attempt
    assert t.check("c", 3, 1) is Verdict.FUTURE_ATTEMPT


def test_authorize_requires_a_higher_epoch() -> None:
    t = FenceTable()
    t.authorize("c", 3)
    assert t.authorize("c", 3) is AuthorizeRefusal.STALE_EPOCH
    assert t.authorize("c", 2) is AuthorizeRefusal.STALE_EPOCH
    assert t.authorize("c", 0) is AuthorizeRefusal.BAD_ATTEMPT
    assert t.authorize("c", 4) is None


def test_fence_closes_only_the_current_attempt() -> None:
    t = FenceTable()
    t.authorize("c", 2)
    assert t.fence("c", 1) is False  # older: no-op
    assert t.check("c", 2, 1) is Verdict.ACCEPT
    assert t.fence("c", 2) is True
    assert t.check("c", 2, 2) is Verdict.CLOSED
    assert t.fence("c", 2) is False  # already closed


def test_fence_of_a_future_attempt_burns_that_epoch() -> None:
    t = FenceTable()
    t.authorize("c", 1)
    t.fence("c", 5)
    assert t.check("c", 1, 1) is Verdict.STALE_ATTEMPT
    assert t.authorize("c", 5) is not None  # can never be the writer now
    assert t.authorize("c", 6) is None
    t.fence("new", 2)
    assert t.authorize("new", 2) is not None


def test_final_is_accepted_only_with_the_last_seq() -> None:
    t = FenceTable()
    t.authorize("c", 1)
    for s in (1, 2):
        t.check("c", 1, s)
    assert t.close_on_final("c", 1, 3) is FinalVerdict.SEQ_MISMATCH
    assert t.close_on_final("c", 1, 1) is FinalVerdict.SEQ_MISMATCH
    assert t.check("c", 1, 3) is Verdict.ACCEPT  # a refused final changes nothing
    assert t.close_on_final("c", 1, 3) is FinalVerdict.ACCEPT
    assert t.close_on_final("c", 1, 3) is FinalVerdict.REPEATED
    assert t.check("c", 1, 4) is Verdict.CLOSED
    view = t.view("c")
    assert view is not None and view.state is AttemptState.ENDED


def test_final_of_superseded_or_fenced_attempt_is_refused() -> None:
    t = FenceTable()
    assert t.close_on_final("c", 1, 0) is FinalVerdict.UNKNOWN_CALL
    t.authorize("c", 1)
    t.authorize("c", 2)
    assert t.close_on_final("c", 1, 0) is FinalVerdict.STALE_ATTEMPT
    assert t.close_on_final("c", 3, 0) is FinalVerdict.FUTURE_ATTEMPT
    t.fence("c", 2)
    assert t.close_on_final("c", 2, 0) is FinalVerdict.CLOSED


def test_finish_closes_and_refuses_new_epochs() -> None:
    t = FenceTable()
    t.authorize("c", 1)
    t.finish("c")
    assert t.check("c", 1, 1) is Verdict.CLOSED
    assert t.authorize("c", 2) is AuthorizeRefusal.CALL_FINISHED


def test_seeded_table_is_closed_until_a_higher_epoch() -> None:
    """After a restart the table comes from the store's max epoch per call."""
    t = FenceTable()
    t.seed("c", 4)
    assert t.check("c", 4, 1) is Verdict.CLOSED
    assert t.authorize("c", 4) is not None
    assert t.authorize("c", 5) is None
    t.seed("c", 1)  # memory is never older than the store: ignored
    view = t.view("c")
    assert view is not None and view.epoch == 5 and view.open


# ---- property tests ----------------------------------------------------------------

CALLS = ("a", "b")


@dataclass(frozen=True)
class Op:
    kind: str  # authorize | fence | delta | final | finish
    call: str
    attempt: int
    seq_offset: int = 0  # delta/final: seq relative to the reference's next seq


ops_strategy = st.lists(
    st.one_of(
        st.builds(Op, st.just("authorize"), st.sampled_from(CALLS), st.integers(1, 5)),
        st.builds(Op, st.just("fence"), st.sampled_from(CALLS), st.integers(1, 5)),
        # deltas are the common event; mostly well-formed so acceptance is exercised
        st.builds(Op, st.just("delta"), st.sampled_from(CALLS), st.integers(1, 5),
                  st.sampled_from((0, 0, 0, 0, -1, 1, 2))),
        st.builds(Op, st.just("delta"), st.sampled_from(CALLS), st.integers(1, 5),
                  st.just(0)),
        st.builds(Op, st.just("final"), st.sampled_from(CALLS), st.integers(1, 5),
                  st.sampled_from((0, 0, 1, -1))),
        st.builds(Op, st.just("finish"), st.sampled_from(CALLS), st.just(0)),
    ),
    max_size=60,
)


@dataclass
class Reference:
    """The rule, written from scratch: a history, not the table's fields."""

    granted: dict[str, list[int]] = field(default_factory=dict)  # successful authorizes
    seen: dict[str, list[int]] = field(default_factory=dict)  # every epoch authorized/fenced
    closed: set[tuple[str, int]] = field(default_factory=set)  # (call, attempt) fenced/ended
    finished: set[str] = field(default_factory=set)
    accepted: dict[tuple[str, int], list[int]] = field(default_factory=dict)

    def writer(self, call: str) -> int | None:
        """The attempt allowed to write `call` right now, if any."""
        grants = self.granted.get(call)
        if not grants or call in self.finished:
            return None
        current = grants[-1]
        if max(self.seen[call]) != current or (call, current) in self.closed:
            return None
        return current

    def next_seq(self, call: str, attempt: int) -> int:
        return len(self.accepted.get((call, attempt), [])) + 1


@pytest.mark.slow
@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy)
def test_fence_matches_the_reference_rule(ops: list[Op]) -> None:
    t = FenceTable()
    ref = Reference()
    for op in ops:
        before = t.snapshot()
        if op.kind == "authorize":
            ok = t.authorize(op.call, op.attempt) is None
            may = op.call not in ref.finished and op.attempt > max(ref.seen.get(op.call, [0]))
            assert ok == may, (op, before)
            if ok:
                ref.granted.setdefault(op.call, []).append(op.attempt)
                ref.seen.setdefault(op.call, []).append(op.attempt)
                # epochs are monotonic per call
                assert ref.granted[op.call] == sorted(set(ref.granted[op.call]))
            else:
                assert t.snapshot() == before, "a refused authorize changed the table"
        elif op.kind == "fence":
            t.fence(op.call, op.attempt)
            ref.seen.setdefault(op.call, []).append(op.attempt)
            ref.closed.add((op.call, op.attempt))
        elif op.kind == "finish":
            t.finish(op.call)
            ref.finished.add(op.call)
            ref.seen.setdefault(op.call, []).append(0)
        elif op.kind == "delta":
            seq = ref.next_seq(op.call, op.attempt) + op.seq_offset
            verdict = t.check(op.call, op.attempt, seq)
            should = ref.writer(op.call) == op.attempt and op.seq_offset == 0
            assert (verdict is Verdict.ACCEPT) == should, (op, seq, verdict, before)
            if should:
                ref.accepted.setdefault((op.call, op.attempt), []).append(seq)
            else:
                assert t.snapshot() == before, f"a refused delta changed the table ({verdict})"
                _check_refusal_reason(verdict, ref, op, seq)
        else:  # final
            last = ref.next_seq(op.call, op.attempt) - 1 + op.seq_offset
            fv = t.close_on_final(op.call, op.attempt, last)
            should = ref.writer(op.call) == op.attempt and op.seq_offset == 0
            if fv is FinalVerdict.ACCEPT:
                assert should, (op, last, before)
                ref.closed.add((op.call, op.attempt))
            else:
                assert not should, (op, fv, before)
                assert t.snapshot() == before, f"a refused final changed the table ({fv})"

    # The accepted deltas of every attempt are exactly 1..n, in order.
    for seqs in ref.accepted.values():
        assert seqs == list(range(1, len(seqs) + 1))


def _check_refusal_reason(verdict: Verdict, ref: Reference, op: Op, seq: int) -> None:
    seen = ref.seen.get(op.call)
    if not seen:
        assert verdict is Verdict.UNKNOWN_CALL
        return
    epoch = max(seen)
    if op.attempt < epoch:
        assert verdict is Verdict.STALE_ATTEMPT
    elif op.attempt > epoch:
        assert verdict is Verdict.FUTURE_ATTEMPT
    elif ref.writer(op.call) != op.attempt:
        assert verdict is Verdict.CLOSED
    else:
        assert verdict is (Verdict.GAP if op.seq_offset > 0 else Verdict.DUPLICATE)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.integers(1, 3), max_size=40), st.integers(1, 3))
def test_only_the_open_epoch_writes_under_interleaving(writes: list[int], switch_to: int) -> None:
    """Two writers, a switch of authorization mid-stream: every accepted delta
    after the switch carries the new epoch."""
    t = FenceTable()
    t.authorize("c", 1)
    next_seq = {1: 1, 2: 1, 3: 1}
    switched = False
    for i, attempt in enumerate(writes):
        if i == len(writes) // 2 and switch_to > 1:
            assert t.authorize("c", switch_to) is None
            switched = True
        verdict = t.check("c", attempt, next_seq[attempt])
        if verdict is Verdict.ACCEPT:
            next_seq[attempt] += 1
            assert attempt == (switch_to if switched else 1)
