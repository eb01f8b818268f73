"""The verdict of a batch of calls: computed from what subscribers received
(the transcript) and the emulator's own record of what it sent, never from
the daemon's counters. Shared by `streamfence demo` and the chaos scripts."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallRecord:
    call_id: str
    key: str  # the emulator script key of the call
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # what the client ran into

    @property
    def done(self) -> dict[str, Any] | None:
        dones = [e for e in self.events if e.get("op") == "done"]
        return dones[-1] if dones else None


def _visible_after_reset(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for e in events:
        if e.get("op") == "reset":
            out.clear()
        elif e.get("op") == "delta" and e.get("kind") == "text":
            out.append(e)
    return out


def judge(record: CallRecord, sent: list[dict[str, Any]]) -> list[str]:
    """Outcome labels of one call: its status, plus any of lost, duplicated,
    interleaved, superseded. `sent` is the emulator's log for the call's key."""
    done = record.done
    if done is None:
        return ["lost"]
    labels = [str(done.get("status"))]
    seqs = [e["seq"] for e in record.events if "seq" in e]
    if sum(1 for e in record.events if e.get("op") == "done") > 1 or len(seqs) != len(set(seqs)):
        labels.append("duplicated")
    attempts = [e["attempt"] for e in record.events if e.get("op") in ("delta", "reset")]
    if any(b < a for a, b in itertools.pairwise(attempts)):
        labels.append("superseded")
    texts = _visible_after_reset(record.events)
    if len({e["attempt"] for e in texts}) > 1:
        labels.append("interleaved")
    content = (done.get("response") or {}).get("content") or ""
    streamed = "".join(e["data"] for e in texts)
    if content != streamed:
        labels.append("interleaved")
    if content:
        if labels[0] == "completed":
            whole = [r.get("text") for r in sent]
            if content not in whole:
                labels.append("interleaved")
        else:
            prefixes = [r.get("sent_text") or "" for r in sent]
            if not any(p.startswith(content) for p in prefixes):
                labels.append("interleaved")
    return sorted(set(labels), key=labels.index)


BAD = ("lost", "duplicated", "interleaved", "superseded")


def tally(outcomes: list[list[str]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    counts["submitted"] = len(outcomes)
    for labels in outcomes:
        for label in labels:
            counts[label] += 1
    for key in ("completed", "partial", "failed", "cancelled", *BAD):
        counts.setdefault(key, 0)
    return counts


def verdict_ok(counts: Counter[str]) -> bool:
    return all(counts[k] == 0 for k in BAD)
