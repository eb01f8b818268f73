"""What the three provider adapters share to turn a stream into an AttemptOutcome.

Contract:
- `ToolSlots(out)`: the base of the adapters' assemblers (ChatStreamAssembler,
  MessagesStreamAssembler, ConverseStreamAssembler). Slot n is the n-th tool call opened
  (0, 1, 2 …): its name (None until known), id and argument pieces; `_slot_by` maps the
  provider's index or block to it. It also keeps what every attempt reports (model,
  response id, in-stream error, `done`, `saw_content`). `fail`, `fail_payload` and
  `fail_text` end the attempt on an in-stream error; `raised(exc, error)` ends it on an
  exception, keeping the partial state. At the end, `_settle` drops the calls that are
  not `kept` (all of them after an error; a drop turns the finish into "length" unless
  it is content_filter) and `_final` builds the AttemptOutcome (`diag` left empty: the
  worker fills it). Each subclass keeps its own per-chunk path inline: the base adds no
  call per chunk.
- `failed_outcome(error)`: the outcome of an attempt that raised before any assembler
  existed.
- `raised_here(exc, module_file)`: did a shape error start in the adapter's code (its
  module or this one) rather than in `out`? Only then is it the provider's bad chunk.
- `sse_events(http)`, `json_body(body, what)`, `complete_body(...)`: the SSE adapters'
  shared framing of a streamed body, a whole JSON body and the non-streaming fall-back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import httpx2
import orjson

from streamfence.protocol.internal.outcome import AttemptError, AttemptOutcome
from streamfence.workers.errors import MalformedStreamError, classify_payload
from streamfence.workers.output import TOOL_CALL, AttemptOutput
from streamfence.workers.sse import iter_sse_events

UNNAMED = "unknown"  # a dropped call that never got a name


class ToolSlots:
    """Owns one attempt's tool-call slots and what every attempt reports (model, response
    id, in-stream error); builds its AttemptOutcome. See the module docstring."""

    # Each subclass puts SLOTS in its own __slots__: declared on this base, the same slots
    # measured 1.5-3% slower per chunk (CPython 3.11). mypy is shown them here, where the
    # methods that use them are.
    SLOTS = ("_args", "_delta", "_failed", "_ids", "_names", "_slot_by", "done", "error",
             "model", "response_id", "saw_content")
    __slots__ = SLOTS if TYPE_CHECKING else ()

    def __init__(self, out: AttemptOutput) -> None:
        self._delta = out.delta
        self._failed = out.failed
        self._names: list[str | None] = []  # a slot is open towards `out` once named
        self._ids: list[str | None] = []
        self._args: list[list[str]] = []
        self._slot_by: dict[Any, int] = {}
        self.model: str | None = None
        self.response_id: str | None = None
        self.error: AttemptError | None = None
        self.done = False  # the attempt is over (an in-stream error, or its end): stop reading
        self.saw_content = False

    def _new_slot(self, key: Any, tool_id: str | None = None, name: str | None = None) -> int:
        slot = len(self._names)
        self._names.append(name)
        self._ids.append(tool_id)
        self._args.append([])
        self._slot_by[key] = slot
        return slot

    def _name_slot(self, slot: int, name: Any) -> None:
        """Name a slot and open it towards `out`: id, name and the arguments so far."""
        self._names[slot] = name = str(name)
        self._delta(TOOL_CALL, {"index": slot, "id": self._ids[slot], "name": name,
                                "arguments": "".join(self._args[slot])})

    def fail(self, error: AttemptError) -> None:
        """An in-stream provider error (or a chunk we cannot read) ends the attempt."""
        self.error = error
        self.done = True

    def fail_payload(self, payload: Any) -> None:
        """An in-stream error object (`{"error": {...}}` chunk or `event: error`)."""
        self.fail(classify_payload(payload))

    def fail_text(self, text: str) -> None:
        """An `event: error` whose data is not JSON: the text is the message."""
        self.fail(classify_payload({"error": {"message": text}}))

    def _args_ok(self, slot: int, *, want_object: bool = False) -> bool:
        args = "".join(self._args[slot])
        if not args.strip():
            return True  # a call without arguments; the stop reason vouches for it
        try:
            value = orjson.loads(args)
        except orjson.JSONDecodeError:
            return False
        return not want_object or type(value) is dict

    def _named_json(self, slot: int) -> bool:
        """The OpenAI and Bedrock rule: keep a call that got a name and JSON arguments."""
        return self._names[slot] is not None and self._args_ok(slot)

    def finish(self, error: AttemptError | None = None) -> AttemptOutcome:
        """The outcome. `error`: the classified exception that ended the attempt."""
        raise NotImplementedError

    def raised(self, exc: BaseException, error: AttemptError) -> AttemptOutcome:
        """`exc` (classified as `error`) ended the attempt: report it, keep the partial state."""
        self._failed(exc)
        return self.finish(error)

    def _settle(self, error: AttemptError | None, finish: str | None,
                kept: Callable[[int], bool]) -> tuple[list[int], str | None]:
        """(dropped slots, finish reason): every call after an error, else those not kept."""
        slots = range(len(self._names))
        if error is not None:
            return list(slots), finish
        dropped = [s for s in slots if not kept(s)]
        if dropped and finish != "content_filter":
            finish = "length"  # truncated arguments
        return dropped, finish

    def _final(self, error: AttemptError | None, finish: str | None,
               usage: dict[str, Any] | None, dropped: list[int]) -> AttemptOutcome:
        return AttemptOutcome(
            ok=error is None, finish_reason=finish, usage=usage, model=self.model,
            provider_response_id=self.response_id,
            dropped_tool_names=tuple(self._names[s] or UNNAMED for s in dropped),
            dropped_tool_indexes=tuple(dropped), error=error)


def failed_outcome(error: AttemptError) -> AttemptOutcome:
    """The outcome of an attempt that raised before any assembler existed."""
    return AttemptOutcome(ok=False, error=error)


def raised_here(exc: BaseException, module_file: str) -> bool:
    """Did a shape error start in the adapter (`module_file` or this module), not in `out`?"""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename in (module_file, __file__)


def sse_events(http: httpx2.Response, out: AttemptOutput
               ) -> Iterator[tuple[bytes | None, bytes | None]] | None:
    """The body's SSE events, its reads passed through `out.reads`; None when it
    is one JSON document (stream=True ignored)."""
    ctype = http.headers.get("content-type", "")
    if "json" in ctype and "event-stream" not in ctype:
        return None
    # iter_raw skips httpx2's decoder and re-chunker layers (~10% of the per-read cost).
    encoding = http.headers.get("content-encoding", "identity").lower()
    return iter_sse_events(out.reads(http.iter_raw() if encoding in ("", "identity")
                                     else http.iter_bytes()))


def json_body(body: bytes, what: str) -> dict[str, Any]:
    """A whole response body as a JSON object, or MalformedStreamError naming `what`."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise MalformedStreamError(f"{what} body is not JSON: {body[:200]!r}") from None
    if type(obj) is not dict:
        raise MalformedStreamError(f"{what} body is not a JSON object")
    return obj



Asm = TypeVar("Asm", bound=ToolSlots)


def complete_body(open_response: Callable[[], contextlib.AbstractContextManager[Any]],
                  out: AttemptOutput, asm: Asm, feed_body: Callable[[Asm, bytes], None],
                  classify: Callable[[BaseException], AttemptError]) -> AttemptOutcome:
    """The non-streaming fall-back: read the whole body, one chunk, fed through `asm`."""
    try:
        with open_response() as resp:
            body = resp.http_response.read()
        out.chunk(len(body))
        feed_body(asm, body)
    except Exception as exc:
        return asm.raised(exc, classify(exc))
    return asm.finish()
