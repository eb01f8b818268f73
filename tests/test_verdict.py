"""The verdict of the demo and the chaos scripts (streamfence.devtools.verdict),
on hand-built records: it must say PASS for a clean batch and name every
kind of damage it is there to catch (lost, duplicated, interleaved,
superseded). Pure functions, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from streamfence.devtools.verdict import BAD, CallRecord, judge, tally, verdict_ok

HELLO = "Hello, world."


class Events:
    """Builds a call's events as a subscriber receives them, numbering `seq`."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def _add(self, event: dict[str, Any]) -> Events:
        self.events.append(dict(event, call_id="c1", seq=len(self.events) + 1))
        return self

    def text(self, attempt: int, *pieces: str) -> Events:
        for piece in pieces:
            self._add({"op": "delta", "attempt": attempt, "kind": "text", "data": piece})
        return self

    def reasoning(self, attempt: int, piece: str) -> Events:
        return self._add({"op": "delta", "attempt": attempt, "kind": "reasoning", "data": piece})

    def reset(self, attempt: int) -> Events:
        return self._add({"op": "reset", "attempt": attempt})

    def done(self, status: str, content: str, attempts: int = 1) -> Events:
        return self._add({"op": "done", "status": status, "attempts": attempts,
                          "response": {"content": content, "finish_reason": "stop"}})

    def record(self, key: str = "k") -> CallRecord:
        return CallRecord(call_id="c1", key=key, events=list(self.events))


def sent(*texts: str, cut: str | None = None) -> list[dict[str, Any]]:
    """The emulator's log of a key: one row per request; `sent_text` is what it
    wrote before the stream ended (all of `text` unless `cut` says less)."""
    rows = [{"text": t, "sent_text": t} for t in texts]
    if cut is not None:
        rows[-1]["sent_text"] = cut
    return rows


# ---- PASS: what a correct daemon produces -----------------------------------------------

def test_a_clean_completed_call_is_only_completed() -> None:
    record = Events().text(1, "Hello, ", "world.").done("completed", HELLO).record()
    assert judge(record, sent(HELLO)) == ["completed"]


def test_reasoning_deltas_do_not_count_as_text() -> None:
    record = (Events().reasoning(1, "thinking...").text(1, HELLO)
              .done("completed", HELLO).record())
    assert judge(record, sent(HELLO)) == ["completed"]


def test_a_retry_after_a_reset_keeps_only_the_winning_attempt() -> None:
    """Attempt 1 delivered text and stalled; attempt 2 resets and streams
    the whole answer: one answer, from one attempt, is not damage."""
    record = (Events().text(1, "Hel").reset(2).text(2, "Hello, ", "world.")
              .done("completed", HELLO, attempts=2).record())
    assert judge(record, sent(HELLO, HELLO)) == ["completed"]


def test_a_partial_call_whose_content_is_a_prefix_of_what_was_sent() -> None:
    record = Events().text(1, "Hello, ").done("partial", "Hello, ").record()
    assert judge(record, sent(HELLO, cut="Hello, w")) == ["partial"]


def test_a_failed_call_without_text_is_only_failed() -> None:
    record = Events().done("failed", "").record()
    assert judge(record, []) == ["failed"]


def test_a_clean_batch_passes() -> None:
    outcomes = [
        judge(Events().text(1, HELLO).done("completed", HELLO).record(), sent(HELLO)),
        judge(Events().text(1, "Hel").done("partial", "Hel").record(), sent(HELLO, cut="Hell")),
        judge(Events().done("failed", "").record(), []),
    ]
    counts = tally(outcomes)
    assert counts["submitted"] == 3
    assert (counts["completed"], counts["partial"], counts["failed"]) == (1, 1, 1)
    assert all(counts[k] == 0 for k in BAD)
    assert verdict_ok(counts)


# ---- FAIL: every kind of damage is named ------------------------------------------------

def test_a_call_without_done_is_lost() -> None:
    record = Events().text(1, "Hello").record()
    assert judge(record, sent(HELLO)) == ["lost"]
    assert judge(CallRecord(call_id="c1", key="k"), []) == ["lost"]


def test_two_dones_are_duplicated() -> None:
    record = (Events().text(1, HELLO).done("completed", HELLO)
              .done("completed", HELLO).record())
    assert judge(record, sent(HELLO)) == ["completed", "duplicated"]


def test_a_repeated_seq_is_duplicated() -> None:
    record = Events().text(1, HELLO).done("completed", HELLO).record()
    record.events.insert(1, dict(record.events[0]))  # the same delta delivered twice
    labels = judge(record, sent(HELLO))
    assert labels[0] == "completed"
    assert "duplicated" in labels


def test_an_older_attempt_after_a_newer_one_is_superseded() -> None:
    """A delta of attempt 1 arriving after attempt 2 began: the fence leaked."""
    record = (Events().reset(2).text(2, "Hello, ").text(1, "x").text(2, "world.")
              .done("completed", HELLO, attempts=2).record())
    labels = judge(record, sent(HELLO, HELLO))
    assert labels[0] == "completed"
    assert "superseded" in labels
    assert "interleaved" in labels  # and its text is mixed into the answer


def test_text_of_two_attempts_without_a_reset_is_interleaved() -> None:
    record = (Events().text(1, "Hello, ").text(2, "world.")
              .done("completed", HELLO, attempts=2).record())
    assert judge(record, sent(HELLO, HELLO)) == ["completed", "interleaved"]


def test_content_that_differs_from_the_streamed_text_is_interleaved() -> None:
    record = Events().text(1, HELLO).done("completed", HELLO + " Hello").record()
    assert "interleaved" in judge(record, sent(HELLO + " Hello"))


def test_completed_content_that_the_emulator_never_sent_is_interleaved() -> None:
    record = Events().text(1, "Hello, wrld.").done("completed", "Hello, wrld.").record()
    assert judge(record, sent(HELLO)) == ["completed", "interleaved"]


def test_partial_content_that_is_not_a_prefix_of_what_was_sent_is_interleaved() -> None:
    record = Events().text(1, "Hellx").done("partial", "Hellx").record()
    assert judge(record, sent(HELLO, cut="Hello, w")) == ["partial", "interleaved"]


def test_labels_are_not_repeated() -> None:
    """Two attempts' text and content the emulator never sent: interleaved once."""
    record = (Events().text(1, "A").text(2, "B")
              .done("completed", "AB", attempts=2).record())
    labels = judge(record, sent(HELLO, HELLO))
    assert labels == ["completed", "interleaved"]


@pytest.mark.parametrize("bad", BAD)
def test_any_damaged_call_fails_the_verdict(bad: str) -> None:
    outcomes = [["completed"], ["partial"], ["completed", bad] if bad != "lost" else ["lost"]]
    counts = tally(outcomes)
    assert counts[bad] == 1
    assert counts["submitted"] == 3
    assert not verdict_ok(counts)


def test_a_batch_with_a_lost_and_an_interleaved_call_fails() -> None:
    outcomes = [
        judge(Events().text(1, HELLO).done("completed", HELLO).record(), sent(HELLO)),
        judge(Events().text(1, "Hel").record(), sent(HELLO)),
        judge(Events().text(1, "Hel").text(2, "lo").done("completed", "Hello", 2).record(),
              sent("Hello", "Hello")),
    ]
    counts = tally(outcomes)
    assert (counts["lost"], counts["interleaved"], counts["completed"]) == (1, 1, 2)
    assert not verdict_ok(counts)


def test_tally_has_every_key_even_at_zero() -> None:
    counts = tally([])
    assert counts["submitted"] == 0
    for key in ("completed", "partial", "failed", "cancelled", *BAD):
        assert counts[key] == 0
    assert verdict_ok(counts)
