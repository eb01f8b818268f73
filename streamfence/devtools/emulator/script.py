"""Fault scripts: what the emulator does to each request, per key.

Contract
--------
* A request names a script key either as a ``#KEY`` suffix on its model
  (``"gpt-emu#zombie-1"``) or in an ``X-Emu-Key`` header (for SDKs whose
  model id cannot carry one). :func:`split_model_key` does the parsing.
* ``POST /_emu/script {"key", "steps"}`` replaces the key's queue of steps;
  each request with that key takes the next one (:meth:`ScriptBook.take`).
  A request with no key, no script, or an exhausted script gets the default
  step ``{"fault": "ok"}``.
* :func:`parse_step` is the one decoder for steps from outside. It accepts
  only the documented fields with their documented types and raises only
  :class:`ScriptError` (naming the field), so a typo in a test script fails
  loudly at ``POST /_emu/script`` instead of silently meaning "ok".
* The texts are deterministic and distinct per request: they derive from the
  emulator's global request number ``n`` (and the key), and contain
  multi-byte UTF-8 so a byte-exactness test sees some.

Nothing here does I/O; the wire modules (``openai_wire`` and later siblings
for Anthropic and Bedrock) turn a :class:`Step` into bytes.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import orjson


class ScriptError(ValueError):
    """A script or step that does not follow the documented shape."""


class Fault(enum.Enum):
    OK = "ok"
    STALL = "stall"
    DISCONNECT = "disconnect"
    NO_FINISH = "no_finish"
    MALFORMED = "malformed"
    STATUS = "status"
    EMPTY = "empty"
    ERROR_EVENT = "error_event"
    KEEPALIVE = "keepalive"
    KEEPALIVE_ONLY = "keepalive_only"  # empty frames for stall_s, then the end: no chunk
    # Bedrock only (streamfence.devtools.emulator.bedrock_wire): converse-stream answers 403
    # AccessDeniedException (IAM lacks bedrock:InvokeModelWithResponseStream)
    # while converse answers normally. Other wires have no meaning for it yet.
    ACCESS_DENIED = "access_denied"


@dataclass(frozen=True, slots=True)
class ToolCallSpec:
    name: str
    arguments: str  # sent verbatim, so a test may script truncated JSON


@dataclass(frozen=True, slots=True)
class Step:
    """One scripted response. Field meanings are documented in ``STEP_FIELDS``."""

    fault: Fault = Fault.OK
    after: int = 0
    chunks: int = 8
    chunk_delay_s: float = 0.0
    text: str | None = None
    reasoning: bool | str = False
    tool_call: ToolCallSpec | None = None
    refusal: str | None = None
    finish_reason: str | None = None
    stall_s: float = 1.0
    keepalive_every_s: float = 0.25
    status: int = 500
    retry_after: str | None = None
    message: str | None = None
    error_type: str | None = None
    error_code: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The step as the log shows it (defaults included, enums as strings)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Fault):
                value = value.value
            elif isinstance(value, ToolCallSpec):
                value = {"name": value.name, "arguments": value.arguments}
            out[f.name] = value
        return out


DEFAULT_STEP = Step()

# name -> one-line meaning; served at GET /_emu/steps.
STEP_FIELDS: dict[str, str] = {
    "fault": "one of " + ", ".join(f.value for f in Fault) + " (default ok)",
    "after": "chunks sent before the fault (default 0; counts every data chunk)",
    "chunks": "pieces each part (reasoning, text, refusal, tool arguments) is split into (default 8)",
    "chunk_delay_s": "delay between chunks (default 0: chunks are written in batches)",
    "text": "exact response text (default: deterministic, distinct per request; "
    "none with a tool_call)",
    "reasoning": "true for default reasoning text, or the reasoning text itself",
    "tool_call": '{"name": str, "arguments": str | object} streamed as a tool call',
    "refusal": "refusal text streamed as refusal deltas",
    "finish_reason": "override the finish reason (default stop, or tool_calls)",
    "stall_s": "silence (stall) or keep-alive (keepalive) duration, seconds (default 1.0)",
    "keepalive_every_s": "interval between keep-alive comments (default 0.25)",
    "status": "HTTP status for fault status (default 500)",
    "retry_after": "Retry-After header value for fault status",
    "message": "error message for status / error_event",
    "error_type": "error.type for status / error_event",
    "error_code": "error.code for status / error_event",
}

_MAX_CHUNKS = 10_000_000
_MAX_SECONDS = 3600.0


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScriptError(f"step field {name!r} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ScriptError(f"step field {name!r} must be in [{lo}, {hi}], got {value}")
    return value


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScriptError(f"step field {name!r} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and 0.0 <= seconds <= _MAX_SECONDS):
        raise ScriptError(f"step field {name!r} must be in [0, {_MAX_SECONDS}], got {value!r}")
    return seconds


def _str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ScriptError(f"step field {name!r} must be a string, got {value!r}")
    return value


def _tool_call(value: object) -> ToolCallSpec:
    if not isinstance(value, Mapping) or set(value) != {"name", "arguments"}:
        raise ScriptError(f'step field "tool_call" must be {{"name", "arguments"}}, got {value!r}')
    args = value["arguments"]
    if not isinstance(args, str):
        try:
            args = orjson.dumps(args).decode()
        except TypeError as err:
            raise ScriptError(f'step field "tool_call.arguments" is not JSON: {err}') from None
    return ToolCallSpec(name=_str("tool_call.name", value["name"]), arguments=args)


def _retry_after(value: object) -> str:
    if isinstance(value, bool):
        raise ScriptError(f"step field 'retry_after' must be seconds or a string, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return _str("retry_after", value)


def parse_step(raw: object) -> Step:
    """Decode one step from untrusted JSON; raises only :class:`ScriptError`."""
    if not isinstance(raw, Mapping):
        raise ScriptError(f"a step must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - set(STEP_FIELDS))
    if unknown:
        raise ScriptError(f"unknown step field(s) {unknown}; known: {sorted(STEP_FIELDS)}")
    kw: dict[str, Any] = {}
    for name, value in raw.items():
        if name == "fault":
            try:
                kw[name] = Fault(value)
            except ValueError:
                raise ScriptError(f"unknown fault {value!r}; {STEP_FIELDS['fault']}") from None
        elif name == "after":
            kw[name] = _int(name, value, 0, _MAX_CHUNKS)
        elif name == "chunks":
            kw[name] = _int(name, value, 1, _MAX_CHUNKS)
        elif name == "status":
            kw[name] = _int(name, value, 100, 599)
        elif name in ("chunk_delay_s", "stall_s"):
            kw[name] = _seconds(name, value)
        elif name == "keepalive_every_s":
            kw[name] = _seconds(name, value)
            if kw[name] < 0.001:
                raise ScriptError("step field 'keepalive_every_s' must be at least 0.001")
        elif name == "reasoning":
            if not isinstance(value, bool | str):
                raise ScriptError(
                    f"step field 'reasoning' must be a bool or a string, got {value!r}"
                )
            kw[name] = value
        elif name == "tool_call":
            kw[name] = None if value is None else _tool_call(value)
        elif name == "retry_after":
            kw[name] = None if value is None else _retry_after(value)
        else:  # text, refusal, finish_reason, message, error_type, error_code
            kw[name] = None if value is None else _str(name, value)
    return Step(**kw)


def parse_steps(raw: object) -> list[Step]:
    if not isinstance(raw, list):
        raise ScriptError(f"'steps' must be a list of step objects, got {raw!r}")
    steps = []
    for i, item in enumerate(raw):
        try:
            steps.append(parse_step(item))
        except ScriptError as err:
            raise ScriptError(f"steps[{i}]: {err}") from None
    return steps


class ScriptBook:
    """Per-key queues of steps; a request takes the next step of its key."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Step]] = {}

    def set(self, key: str, steps: Sequence[Step]) -> None:
        self._queues[key] = deque(steps)

    def take(self, key: str | None) -> Step:
        if key is None:
            return DEFAULT_STEP
        queue = self._queues.get(key)
        if not queue:
            return DEFAULT_STEP
        return queue.popleft()

    def pending(self) -> dict[str, int]:
        return {key: len(q) for key, q in self._queues.items() if q}

    def clear(self) -> None:
        self._queues.clear()


def split_model_key(model: str, header_key: str | None = None) -> tuple[str, str | None]:
    """``"gpt-emu#k1"`` -> ``("gpt-emu", "k1")``; the header wins if both are given."""
    base, sep, suffix = model.rpartition("#")
    if sep and suffix:
        model, key = base, suffix
    else:
        key = None
    if header_key:
        key = header_key
    return model, key


# Deterministic words with multi-byte UTF-8 (2-, 3- and 4-byte sequences).
_WORDS = (
    "alpha", "café", "naïve", "Grüße", "日本語", "bravo", "🙂ok", "résumé",
    "Ωmega", "数据", "señor", "zulu", "façade", "ß", "kilo", "Ünïcode",
)  # fmt: skip


def _words(n: int, count: int) -> str:
    return " ".join(_WORDS[(n * 7 + i) % len(_WORDS)] for i in range(count))


def default_text(n: int, key: str | None, chunks: int) -> str:
    """The default answer of request ``n``: distinct per request, >= ``chunks`` chars."""
    head = f"Answer {n} for {key}: " if key else f"Answer {n}: "
    return head + _words(n, max(8, chunks)) + "."


def default_reasoning(n: int, chunks: int) -> str:
    return f"Thinking about request {n}: " + _words(n + 3, max(4, chunks)) + "."


def split_text(text: str, pieces: int) -> list[str]:
    """Split ``text`` into ``pieces`` non-empty parts (fewer if it is shorter)."""
    if not text:
        return []
    pieces = max(1, min(pieces, len(text)))
    size = len(text)
    bounds = [i * size // pieces for i in range(pieces + 1)]
    return [text[bounds[i] : bounds[i + 1]] for i in range(pieces)]
