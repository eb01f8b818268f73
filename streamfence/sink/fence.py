"""The fence: which attempt may write a call's transcript, and which seq comes next.

Contract (pure, no I/O, no clock):

- Every call has an **epoch**: the highest attempt number the sink has seen
  authorized or fenced for it. Epochs only grow (Kafka-style producer
  fencing), so a superseded attempt can never become the writer again.
- At most one attempt per call is **open**: the current epoch, after
  `authorize` and before `fence` / an accepted final / `finish`.
- `check(call, attempt, seq)` is the whole single-writer rule: a delta is
  accepted only from the open current epoch with exactly the next seq
  (seq starts at 1 per attempt and is contiguous; an attempt that continues
  another's answer after a sink restart starts after that answer's last
  seq). Accepting consumes the seq; a refused delta never changes any state.
- The table can be rebuilt after a sink restart from the store's max epoch
  per call (`seed`); rebuilt entries are closed until the supervisor
  authorizes a higher epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    """The sink's answer to one delta."""

    ACCEPT = "accept"
    STALE_ATTEMPT = "stale_attempt"  # attempt below the call's epoch: superseded
    FUTURE_ATTEMPT = "future_attempt"  # attempt above the epoch: never authorized
    UNKNOWN_CALL = "unknown_call"
    CLOSED = "closed"  # the current epoch, but fenced, ended or finished
    GAP = "gap"  # seq beyond the next expected one: something was lost
    DUPLICATE = "duplicate"  # seq already accepted


class FinalVerdict(Enum):
    """The sink's answer to an attempt's final message."""

    ACCEPT = "accept"
    REPEATED = "repeated"  # the same final was accepted before: ack again, nothing new
    UNKNOWN_CALL = "unknown_call"
    STALE_ATTEMPT = "stale_attempt"
    FUTURE_ATTEMPT = "future_attempt"
    CLOSED = "closed"
    SEQ_MISMATCH = "seq_mismatch"  # last_seq is not the last accepted seq


class AuthorizeRefusal(Enum):
    """Why `authorize` refused an attempt (the sink's R_REFUSED reason starts with it)."""

    BAD_ATTEMPT = "bad_attempt"  # attempt numbers start at 1
    CALL_FINISHED = "call_finished"  # the call has its done event
    STALE_EPOCH = "stale_epoch"  # not above the call's epoch


class AttemptState(Enum):
    """State of a call's current epoch."""

    OPEN = "open"  # authorized: its deltas are accepted
    FENCED = "fenced"  # closed by the supervisor, a finish, or rebuilt after a restart
    ENDED = "ended"  # closed by its own accepted final message


# Module-level aliases: `check` runs once per delta, a global load is cheaper
# than an Enum class attribute lookup.
_OPEN = AttemptState.OPEN
_FENCED = AttemptState.FENCED
_ENDED = AttemptState.ENDED
_ACCEPT = Verdict.ACCEPT
_STALE = Verdict.STALE_ATTEMPT
_FUTURE = Verdict.FUTURE_ATTEMPT
_UNKNOWN = Verdict.UNKNOWN_CALL
_CLOSED = Verdict.CLOSED
_GAP = Verdict.GAP
_DUPLICATE = Verdict.DUPLICATE


@dataclass(slots=True)
class _Entry:
    epoch: int
    state: AttemptState
    next_seq: int  # next seq expected from attempt `epoch`
    finished: bool = False  # the call has its done event: no attempt may start


@dataclass(frozen=True, slots=True)
class FenceView:
    """A read-only snapshot of one call's fence entry."""

    epoch: int
    state: AttemptState
    last_seq: int  # last accepted seq of attempt `epoch` (0: none)
    finished: bool

    @property
    def open(self) -> bool:
        return self.state is _OPEN


class FenceTable:
    """Per-call epochs and seqs. See the module docstring for the contract."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: dict[str, _Entry] = {}

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def view(self, call_id: str) -> FenceView | None:
        e = self._calls.get(call_id)
        if e is None:
            return None
        return FenceView(e.epoch, e.state, e.next_seq - 1, e.finished)

    def snapshot(self) -> dict[str, tuple[int, AttemptState, int, bool]]:
        """The whole table as plain values (for tests and diagnostics)."""
        return {c: (e.epoch, e.state, e.next_seq, e.finished) for c, e in self._calls.items()}

    # ---- supervisor-driven transitions --------------------------------------

    def seed(self, call_id: str, epoch: int, finished: bool = False) -> None:
        """Load a call known from the store (after a restart): closed at `epoch`.

        A call already in the table is left alone: memory is never older than
        the store.
        """
        if call_id not in self._calls:
            self._calls[call_id] = _Entry(epoch, _FENCED, 1, finished)

    def authorize(self, call_id: str, attempt: int, after_seq: int = 0) -> AuthorizeRefusal | None:
        """Make `attempt` the only writer of `call_id`, its first seq
        `after_seq` + 1. Returns None, or why not."""
        if attempt < 1:
            return AuthorizeRefusal.BAD_ATTEMPT
        e = self._calls.get(call_id)
        if e is None:
            self._calls[call_id] = _Entry(attempt, _OPEN, after_seq + 1)
            return None
        if e.finished:
            return AuthorizeRefusal.CALL_FINISHED
        if attempt <= e.epoch:
            # Equal is refused too: re-opening an epoch would let a worker that
            # was fenced out (and may still be alive) write again.
            return AuthorizeRefusal.STALE_EPOCH
        e.epoch = attempt
        e.state = _OPEN
        e.next_seq = after_seq + 1
        return None

    def fence(self, call_id: str, attempt: int) -> bool:
        """Close `attempt`. Returns True if that closed the open attempt.

        Fencing an attempt above the epoch raises the epoch (closed), so that
        attempt can never be authorized later; fencing an older one is a no-op.
        Fencing always narrows who may write, so it is never refused.
        """
        e = self._calls.get(call_id)
        if e is None:
            self._calls[call_id] = _Entry(attempt, _FENCED, 1)
            return False
        if attempt > e.epoch:
            e.epoch = attempt
            e.state = _FENCED
            e.next_seq = 1
            return False
        if attempt == e.epoch and e.state is _OPEN:
            e.state = _FENCED
            return True
        return False

    def finish(self, call_id: str) -> None:
        """The call is done: close its open attempt and refuse new epochs."""
        e = self._calls.get(call_id)
        if e is None:
            self._calls[call_id] = _Entry(0, _FENCED, 1, True)
            return
        if e.state is _OPEN:
            e.state = _FENCED
        e.finished = True

    def evict(self, call_id: str) -> None:
        """Forget a finished call (its epoch stays in the store)."""
        self._calls.pop(call_id, None)

    # ---- worker-driven ------------------------------------------------------

    def check(self, call_id: str, attempt: int, seq: int) -> Verdict:
        """The single-writer rule for one delta. ACCEPT consumes `seq`."""
        e = self._calls.get(call_id)
        if e is None:
            return _UNKNOWN
        if attempt != e.epoch:
            return _STALE if attempt < e.epoch else _FUTURE
        if e.state is not _OPEN:
            return _CLOSED
        if seq != e.next_seq:
            return _GAP if seq > e.next_seq else _DUPLICATE
        e.next_seq = seq + 1
        return _ACCEPT

    def close_on_final(self, call_id: str, attempt: int, last_seq: int) -> FinalVerdict:
        """An attempt's final message: accepted only from the open current epoch
        whose last accepted seq is `last_seq` (so nothing it sent was lost)."""
        e = self._calls.get(call_id)
        if e is None:
            return FinalVerdict.UNKNOWN_CALL
        if attempt != e.epoch:
            return FinalVerdict.STALE_ATTEMPT if attempt < e.epoch else FinalVerdict.FUTURE_ATTEMPT
        if last_seq != e.next_seq - 1:
            return FinalVerdict.CLOSED if e.state is not _OPEN else FinalVerdict.SEQ_MISMATCH
        if e.state is _ENDED:
            return FinalVerdict.REPEATED
        if e.state is not _OPEN:
            return FinalVerdict.CLOSED
        e.state = _ENDED
        return FinalVerdict.ACCEPT
