"""The interface a provider adapter writes one attempt's output to.

Contract: an adapter calls `chunk(nbytes)` once per real provider chunk (the
liveness signal: never for SSE comments, keep-alives or pings) and
`delta(kind, data)` once per protocol delta, in order. `kind` is a DeltaKind
value; `data` is a str for text/reasoning/refusal/notice and, for tool_call,
    {"index": int, "id": str|None, "name": str|None, "arguments": str}
where `index` is a slot number the adapter assigns (0, 1, 2 … in order of
opening). The first fragment of a slot carries its `id` and `name` (the
receiver assigns them); later fragments carry `id=None, name=None` and the
next piece of `arguments` (the receiver appends). So a receiver only ever
assigns or appends; all provider quirks are the adapter's business. When an
exception ends the attempt, the adapter reports it once with `failed(exc)` (the
worker keeps where it was raised, for the log: ARCHITECTURE §4.9) and returns
the outcome it classified it into. An adapter that reads its provider's body
itself passes the raw reads through `reads(...)`: the output may then hold
the deltas parsed from one read and write them together, before the next
read blocks (never later: a delta is never held while the provider is quiet).

The worker implements this and pushes to the sink; RecordingOutput keeps
everything in memory (tests, and the zygote's warm-up).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from streamfence.protocol.messages import DeltaKind, visible_chars

TEXT = DeltaKind.TEXT.value
REASONING = DeltaKind.REASONING.value
TOOL_CALL = DeltaKind.TOOL_CALL.value
REFUSAL = DeltaKind.REFUSAL.value
NOTICE = DeltaKind.NOTICE.value


class AttemptOutput(Protocol):
    """Where an adapter writes one attempt's output (see the module docstring)."""

    def chunk(self, nbytes: int) -> None:
        """A real provider chunk of `nbytes` payload bytes arrived."""

    def delta(self, kind: str, data: Any) -> None:
        """One protocol delta (see the module docstring for `data`)."""

    def failed(self, exc: BaseException) -> None:
        """`exc` ended the attempt (its outcome carries the classified error)."""

    def reads(self, reads: Iterable[bytes]) -> Iterator[bytes]:
        """The provider's raw body reads, passed through (module docstring)."""


class RecordingOutput:
    """An AttemptOutput that records everything, with the sink's assembly rules."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.deltas: list[tuple[str, Any]] = []
        self.visible_chars = 0  # what the sink counts as delivered
        self.exc: BaseException | None = None  # the exception that ended the attempt

    def chunk(self, nbytes: int) -> None:
        self.chunks.append(nbytes)

    def delta(self, kind: str, data: Any) -> None:
        self.deltas.append((kind, data))
        self.visible_chars += visible_chars(kind, data)

    def failed(self, exc: BaseException) -> None:
        self.exc = exc

    def reads(self, reads: Iterable[bytes]) -> Iterator[bytes]:
        return iter(reads)

    def joined(self, kind: str) -> str:
        return "".join(d for k, d in self.deltas if k == kind)

    @property
    def text(self) -> str:
        return self.joined(TEXT)

    @property
    def reasoning(self) -> str:
        return self.joined(REASONING)

    @property
    def refusal(self) -> str:
        return self.joined(REFUSAL)

    def tool_calls(self) -> list[dict[str, Any]]:
        """Assemble tool_call fragments exactly as the sink does, in slot order."""
        slots: dict[int, dict[str, Any]] = {}
        for kind, data in self.deltas:
            if kind != TOOL_CALL:
                continue
            slot = slots.get(data["index"])
            if slot is None:
                slots[data["index"]] = {"id": data["id"], "name": data["name"],
                                        "arguments": data["arguments"]}
            else:
                slot["arguments"] += data["arguments"]
        return [slots[i] for i in sorted(slots)]
