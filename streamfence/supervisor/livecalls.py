"""The live calls: every call accepted (or being accepted) and not done, by
id, and what they hold against the budgets: how many calls and how many
request bytes per owner, and the bytes of all of them (`max_in_flight`,
`max_in_flight_bytes`, `in_flight_bytes_max`), and how many group calls are
on each deployment (a `least_in_flight` group's choice,
supervisor/deployments.py). The AttemptDriver adds and
removes calls (its `enqueue` and `_forget` are the only ways in and out);
admission, acceptance and `status` read. `call_context`: a live call's
fields for its log lines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from streamfence.config.groups import Deployment
from streamfence.protocol.codec import encode
from streamfence.protocol.states import CallState
from streamfence.supervisor.calls import BUSY_STATES, Call


def call_context(call: Call, **fields: Any) -> dict[str, Any]:
    """A call's fields for its log lines (`extra=`): who submitted it, its
    session, id and attempt, its provider profile and model (protocol/logs.py
    CONTEXT_FIELDS); `fields`: the line's own (a status, a finish_reason),
    keys of their own in JSON logs."""
    context: dict[str, Any] = {
        "identity": call.owner, "session_id": call.spec.session_id, "call_id": call.call_id,
        "attempt": call.epoch, "provider": call.profile.name,
        "model": call.model}
    fields = {key: value for key, value in fields.items() if value is not None}
    if fields:
        context["fields"] = fields
    return context


class LiveCalls:
    """Owns the live calls by id and their counts and request bytes per owner."""

    def __init__(self, in_flight_bytes_max: int) -> None:
        self._in_flight_bytes_max = in_flight_bytes_max  # for `status` only
        self._calls: dict[str, Call] = {}
        self._in_flight: Counter[str] = Counter()  # owner -> live calls
        # The request bytes of the live calls (`Call.request_bytes`): per owner
        # and in all; taken in `add`, given back in `remove`, as in_flight.
        self._in_flight_bytes: Counter[str] = Counter()
        self._bytes_total = 0
        # Group calls whose current deployment is (profile, model): from the
        # choice of an attempt's deployment to the call's next choice or end.
        self._on_deployment: Counter[tuple[str, str]] = Counter()

    def add(self, call: Call) -> None:
        self._calls[call.call_id] = call
        self._in_flight[call.owner] += 1
        if not call.request_bytes:
            # A recovered call has no submit frame: its journaled request's encoding.
            call.request_bytes = len(encode(call.spec.request))
        self._in_flight_bytes[call.owner] += call.request_bytes
        self._bytes_total += call.request_bytes

    def remove(self, call: Call) -> None:
        """A call no longer live: its count and its request bytes go back to
        its owner's and the daemon's budgets."""
        del self._calls[call.call_id]
        owner = call.owner
        self._in_flight[owner] -= 1
        self._in_flight_bytes[owner] -= call.request_bytes
        self._bytes_total -= call.request_bytes
        if not self._in_flight[owner]:
            del self._in_flight[owner]
            del self._in_flight_bytes[owner]
        if call.deployment is not None:
            self._leave(call.deployment)

    def place(self, call: Call, deployment: Deployment) -> None:
        """A group call's next attempt goes to `deployment`."""
        if call.deployment is not None:
            self._leave(call.deployment)
        call.deployment = deployment
        self._on_deployment[(deployment.profile, deployment.model)] += 1

    def _leave(self, deployment: Deployment) -> None:
        key = (deployment.profile, deployment.model)
        self._on_deployment[key] -= 1
        if not self._on_deployment[key]:
            del self._on_deployment[key]

    def on_deployment(self, deployment: Deployment) -> int:
        """Group calls on `deployment` now (its profile and model)."""
        return self._on_deployment[(deployment.profile, deployment.model)]

    def get(self, call_id: str) -> Call | None:
        return self._calls.get(call_id)

    def __getitem__(self, call_id: str) -> Call:
        return self._calls[call_id]

    def has(self, call_id: str) -> bool:
        return call_id in self._calls

    def __iter__(self) -> Iterator[Call]:
        return iter(self._calls.values())

    def in_flight(self, owner: str) -> int:
        """Calls of `owner` accepted and not yet done."""
        return self._in_flight[owner]

    def in_flight_bytes(self, owner: str | None = None) -> int:
        """The request bytes of the calls accepted and not yet done: `owner`'s,
        or every call's."""
        return self._bytes_total if owner is None else self._in_flight_bytes[owner]

    def busy(self) -> int:
        """Calls with an attempt in flight (queued and backing-off ones wait in the journal)."""
        return sum(1 for c in self._calls.values() if c.state in BUSY_STATES)

    def status(self, owner: str | None = None) -> dict[str, Any]:
        """Live calls by state, the bytes their requests hold (all of them also
        per owner, and the budget), and the first 100 of them; only `owner`'s if given."""
        calls = [c for c in self._calls.values() if owner is None or c.owner == owner]
        by_state: dict[str, int] = {}
        for call in calls:
            by_state[call.state.value] = by_state.get(call.state.value, 0) + 1
        queued = sum(1 for c in calls if c.state is CallState.QUEUED)
        held: dict[str, Any] = {"in_flight_bytes": self.in_flight_bytes(owner)}
        if owner is None:
            held.update(in_flight_bytes_max=self._in_flight_bytes_max,
                        in_flight_bytes_by_owner=dict(self._in_flight_bytes))
        return {"active": len(calls), "queued": queued, "by_state": by_state, **held,
                "running": [{"call_id": c.call_id, "owner": c.owner, "state": c.state.value,
                             "attempt": c.epoch, "session_id": c.spec.session_id,
                             "provider": c.profile.name} for c in calls[:100]]}
