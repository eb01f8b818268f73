"""Response assembly: the accepted content of a call's current attempt.

Contract:

- One `Content` per attempt. Every authorize starts a fresh one, so the
  `done` response holds exactly the winning attempt's content (a retried
  attempt re-streams reasoning and tool calls from the start; keeping the
  superseded attempt's would duplicate them). A `reset` event tells
  subscribers to void what they saw; the content here is already per attempt.
- Per delta the cost is one list append (`add[kind](data)`); strings are
  joined and tool-call fragments assembled only in `build_response`.
- Tool-call fragments carry a slot `index` assigned by the worker (it already
  opens a new slot when a provider reuses an index with a new id). Per slot,
  the first non-empty `id` and `name` are kept (assigned, not appended) and
  `arguments` fragments are joined in arrival order.
- `notice` deltas are user-visible warnings, kept apart from the content.
- Memory is bounded: once an attempt's stored events pass `KEEP_BYTES`
  (`stored`, told by the sink at each commit), its text deltas (text,
  reasoning, refusal) are only counted from then on, and the `done` response says
  `content_omitted`: the deltas in the transcript are the answer, and the
  client library assembles it from them (PROTOCOL §6). Tool-call fragments
  are kept: the response's tool calls are assembled here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamfence.protocol.internal.control import FinishMeta
from streamfence.protocol.messages import DeltaKind, empty_response, visible_chars

TEXT = DeltaKind.TEXT.value
REFUSAL = DeltaKind.REFUSAL.value

REASONING = DeltaKind.REASONING.value
KEEP_BYTES = 1 << 20  # an attempt's text kept for its done response, about; then counted only


class Content:
    """Accumulated content of one attempt."""

    __slots__ = ("add", "kept", "notices", "omitted", "omitted_visible", "reasoning",
                 "refusal", "text", "tools")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tools: list[dict[str, Any]] = []
        self.notices: list[str] = []
        self.kept = 0  # bytes of this attempt's stored events, until `spill`
        self.omitted = -1  # text deltas counted, not kept (-1: every one is kept)
        self.omitted_visible = 0  # ... and their visible characters
        # kind -> bound append: the hot path does one dict lookup and one call.
        self.add: dict[str, Callable[[Any], None]] = {
            TEXT: self.text.append,
            REASONING: self.reasoning.append,
            REFUSAL: self.refusal.append,
            DeltaKind.TOOL_CALL.value: self.tools.append,
            DeltaKind.NOTICE.value: self.notices.append,
        }

    def stored(self, events: list[bytes]) -> None:
        """`events` of this attempt are stored: past KEEP_BYTES in all, spill."""
        if self.omitted < 0:
            self.kept += sum(map(len, events))
            if self.kept >= KEEP_BYTES:
                self.spill()

    def spill(self) -> None:
        """From now on count the text deltas instead of keeping them (see the
        module docstring). `add` is changed in place: the hot path holds it."""
        if self.omitted >= 0:
            return
        self.omitted_visible = self.visible_chars()
        self.omitted = len(self.text) + len(self.reasoning) + len(self.refusal)
        for kept in (self.text, self.reasoning, self.refusal):
            kept.clear()
        self.add[TEXT] = self._count_text
        self.add[REASONING] = self._count
        self.add[REFUSAL] = self._count_refusal

    def _count(self, data: str) -> None:
        self.omitted += 1

    def _count_text(self, data: str) -> None:
        self.omitted += 1
        self.omitted_visible += visible_chars(TEXT, data)

    def _count_refusal(self, data: str) -> None:
        self.omitted += 1
        self.omitted_visible += visible_chars(REFUSAL, data)

    def deltas(self) -> int:
        """Accepted deltas of this attempt (kept or counted)."""
        return (len(self.text) + len(self.reasoning) + len(self.refusal) + len(self.tools)
                + len(self.notices) + max(0, self.omitted))

    def visible_chars(self) -> int:
        """What a user has seen of this attempt (`protocol.messages.visible_chars`,
        per accepted delta): the supervisor's "visible text delivered" test."""
        # Text and refusal deltas are str (sink/intake.py checks): each counts
        # len(d.strip()), as visible_chars says, without a call per delta.
        strip = str.strip
        return (sum(map(len, map(strip, self.text))) + sum(map(len, map(strip, self.refusal)))
                + self.omitted_visible)

    def tool_fragments(self) -> int:
        return len(self.tools)

    def tool_calls(self, dropped_indexes: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """Assemble the fragments into calls, by slot index, leaving out dropped slots."""
        slots: dict[int, tuple[list[str | None], list[str]]] = {}
        for frag in self.tools:
            index: int = frag["index"]
            slot = slots.get(index)
            if slot is None:
                slot = ([None, None], [])
                slots[index] = slot
            ident, args = slot
            if ident[0] is None and frag.get("id"):
                ident[0] = frag["id"]
            if ident[1] is None and frag.get("name"):
                ident[1] = frag["name"]
            piece = frag.get("arguments")
            if piece:
                args.append(piece)
        return [
            {"id": slots[i][0][0], "name": slots[i][0][1], "arguments": "".join(slots[i][1])}
            for i in sorted(slots)
            if i not in dropped_indexes
        ]

    def build_response(self, meta: FinishMeta) -> dict[str, Any]:
        """The normalized `done` response: this content plus C_FINISH's `meta`."""
        response = empty_response()
        if self.omitted >= 0:
            response["content_omitted"] = True
        else:
            response["content"] = "".join(self.text)
            response["reasoning"] = "".join(self.reasoning)
            response["refusal"] = "".join(self.refusal) if self.refusal else None
        response["tool_calls"] = self.tool_calls(frozenset(meta.dropped_tool_indexes))
        for key in ("finish_reason", "usage", "model", "provider_response_id"):
            value = getattr(meta, key)
            if value is not None:
                response[key] = value
        response["partial"] = meta.partial
        response["dropped_tool_names"] = list(meta.dropped_tool_names)
        return response
